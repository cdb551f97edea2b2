"""Which optimizer steps the watch judges: the first ``first`` steps (2 by default: a state carried from one step
into the next only shows from step 2), then every ``every``-th, the steps listed in ``steps``, and the next step
after a request: ``Schedule.request()`` called on every rank, or a file named ``judge-next`` dropped into the
watch's output folder (looked for every ``poll`` steps; the ranks agree on it with one one-number all-reduce, and
rank 0 removes it). Every other step costs nothing but a counter."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REQUEST_FILE = "judge-next"


@dataclass
class Schedule:
    first: int = 2
    every: int = 100  # 0: never after the first ones
    steps: set = field(default_factory=set)
    poll: int = 10  # look for a request file every this many steps (0: never)
    _requested: bool = False

    def __post_init__(self):
        if min(self.first, self.every, self.poll) < 0:
            raise ValueError(f"gradkit watch: first, every and poll must be >= 0 (got {self.first}, {self.every}, "
                             f"{self.poll})")
        self.steps = {int(s) for s in self.steps}

    def request(self) -> None:
        """Judge the next step whatever the schedule says (call it on every rank)."""
        self._requested = True

    def judged(self, step: int, asked_by_file: bool = False) -> bool:
        """Is optimizer step ``step`` (1-based) judged? Takes a pending request."""
        asked, self._requested = self._requested or asked_by_file, False
        return asked or step <= self.first or step in self.steps or bool(self.every and step % self.every == 0)

    def polls(self, step: int) -> bool:
        """Does the watch look for a request file before step ``step``?"""
        return bool(self.poll) and step % self.poll == 0

    @staticmethod
    def file_request(folder) -> bool:
        return (Path(folder) / REQUEST_FILE).exists()

    @staticmethod
    def take_file(folder) -> None:
        (Path(folder) / REQUEST_FILE).unlink(missing_ok=True)
