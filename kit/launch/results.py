"""Reading what a world's ranks left in its folder: whole result and error records, rank 0's partial reports as
they come, and the ``RankFailed`` that names the rank to blame."""
from __future__ import annotations

import json
import signal
from pathlib import Path

from gradkit.launch.spec import RankFailed


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return ""


def is_complete(path: Path) -> bool:
    """A rank's result file that is whole (the worker renames it into place; a foreign writer may not)."""
    return _read_whole(path) is not None


class PartialReader:
    """Hands each complete line rank 0 appended to its partial file to ``on_partial``, once."""

    def __init__(self, path: Path, on_partial):
        self.path, self.on_partial, self.offset = path, on_partial, 0

    def __call__(self) -> None:
        if self.on_partial is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        done = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += done
        for line in data[:done].decode().splitlines():
            if line.strip():
                self.on_partial(json.loads(line))


def read_partials(job: Path, world_size: int) -> dict:
    out = {}
    for r in range(world_size):
        path = job / f"rank{r}.partial.jsonl"
        if path.exists():
            out[r] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def how_it_ended(code: int) -> str:
    """'killed by signal 9 (SIGKILL)' / 'exited with code 1'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _read_whole(path: Path) -> dict | None:
    """A rank's record (result or error), or None when it cannot be read: missing, or half-written (a rank
    killed mid-write by an older kit, or a foreign writer)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# Errors a rank raises because a peer failed (gradkit.probes.ranks.judging: a peer did not reach the barrier after a
# case): never the cause where another rank failed too, whatever the order in which their exits were seen
CONSEQUENCES = ("WorldDesynchronised",)


def blame(bad: list[int], codes: list, job: Path, logs: list[Path], by_exit: bool = True,
          started_in: Path | None = None) -> RankFailed:
    """The rank to blame: the first to go (``bad`` is in exit order). Its own exception if it raised one;
    else how it died (a signal, an exit code) and its last output. The others' errors come after, as context:
    when one rank dies, its peers fail a moment later in their collectives (a peer that raised one of
    ``CONSEQUENCES`` is never blamed over another failed rank). Under torchrun or the DeepSpeed
    launcher (``by_exit=False``) the kit sees launchers, not ranks: the first rank to raise is blamed."""
    tails = {r: tail(logs[r]) for r in range(len(logs))}
    found = [*(started_in.glob("rank*.error.json") if started_in else []), *job.glob("rank*.error.json")]
    errors = {e["rank"]: e for e in map(_read_whole, found) if e}
    first = bad[0]
    if errors and (not by_exit or all(codes[r] >= 0 for r in bad)):
        first = min(errors.values(), key=lambda x: x["time"])["rank"]  # every rank exited itself: the first raise
    if errors.get(first, {}).get("type") in CONSEQUENCES and len(bad) > 1:
        first = next(r for r in bad if r != first)  # it stopped because a peer did: the peer is the cause
    if not by_exit:
        bad = [first]
    later = [f"rank {r} {how_it_ended(codes[r])}" + (f" after {errors[r]['type']}: {errors[r]['message'][:200]}"
                                                     if r in errors else "") for r in bad if r != first]
    context = ("\nThen: " + "; ".join(later)) if later else ""
    if first in errors:
        e = errors[first]
        return RankFailed(f"rank {first} raised {e['type']}: {e['message']}{context}\n--- traceback of rank {first} ---\n"
                          f"{e['traceback']}", rank=first, traceback=e["traceback"], logs=tails)
    return RankFailed(f"rank {first} died: {how_it_ended(codes[first])}, without a Python traceback{context}\n"
                      f"--- last output of rank {first} ---\n{tails[first][-1500:]}", rank=first, logs=tails)
