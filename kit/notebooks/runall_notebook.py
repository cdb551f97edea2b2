"""One notebook of a run-all: its own papermill process (kernel ``KERNEL``) under its time limit, what it has done so
far (``Live``: its cells, and the events its probe runner appends), and the stop of the whole run on SIGINT / SIGTERM
(``STOP``), which kills every process it started, kernels and ranks with them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gradkit import config as kconfig
from gradkit import launch
from gradkit.judge.records import RUN_ID_ENV
from gradkit.notebooks.runall_params import REPO
from gradkit.probes.runner import PROGRESS_ENV as RUNNER_PROGRESS_ENV

KERNEL = "gradkit"
# jupyter_client's words when a kernel process ends before it answers its first request: no cell has run, so the
# notebook is started once more. Kernels started at once can race for the ports jupyter_client picked and released
# (papermill #511, jupyter_client #154): the loser exits with "Address already in use" before its first reply
KERNEL_DIED_AT_START = "Kernel died before replying to kernel_info"


def failing_cell(executed: Path) -> dict | None:
    """The first cell of an executed notebook that raised, or the one still running when it was stopped."""
    import nbformat

    try:
        nb = nbformat.read(str(executed), as_version=4)
    except Exception:  # noqa: BLE001 - no notebook written at all: nothing to point at
        return None
    running = None
    added = ("injected-parameters", "papermill-error-cell-tag")  # cells papermill put in: not the notebook's own
    cells = [c for c in nb.cells if not set(c.get("metadata", {}).get("tags", [])) & set(added)]
    for i, cell in enumerate(cells):  # i = the cell's index in the stored notebook
        if cell.cell_type != "code":
            continue
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error" and o.get("ename") != "PapermillExecutionError":
                return {"index": i, "source": cell.source[:600], "ename": o.get("ename"),
                        "evalue": str(o.get("evalue"))[:600], "traceback_tail": "\n".join(o.get("traceback", []))[-1500:]}
        if cell.get("metadata", {}).get("papermill", {}).get("status") == "running":
            running = {"index": i, "source": cell.source[:600], "ename": "Timeout", "evalue": "still running when stopped"}
    return running


class Stop:
    """A run-all being stopped (SIGINT / SIGTERM): no queued notebook starts, running ones are killed whole."""

    def __init__(self):
        self.signal: str | None = None
        self.running: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()

    def install(self) -> dict:
        """Take SIGINT and SIGTERM for one run (a fresh state); returns the handlers to put back after it."""
        self.signal = None
        return {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}

    def __call__(self, signum, _frame=None) -> None:
        with self.lock:
            self.signal = self.signal or signal.Signals(signum).name
            running = list(self.running)
        for pid in running:  # papermill, its kernel and the kernel's ranks
            launch.kill_tree(pid)


STOP = Stop()


def execute(path: Path, out: Path, params: dict, timeout_s: float, run_id: str = "") -> dict:
    """Run one notebook in its own papermill process; never raises for the notebook's own failures. A kernel that
    dies before its first reply (``KERNEL_DIED_AT_START``: no cell ran) gets one more start, said in ``retried``."""
    entry = _execute(path, out, params, timeout_s, run_id)
    if entry["status"] == "failed" and not entry.get("failing_cell") and \
            KERNEL_DIED_AT_START in _log(path, out).read_text(errors="replace"):  # a failed start wrote its log
        first = entry
        entry = _execute(path, out, params, timeout_s, run_id)
        entry["retried"] = f"its first kernel died before replying, {first['wall_s']:g} s after the start"
        entry["wall_s"] = round(entry["wall_s"] + first["wall_s"], 1)
    return entry


def _log(path: Path, out: Path) -> Path:
    """Where a notebook's papermill process writes what it prints."""
    return out / f"{path.stem}.papermill.log"


def _execute(path: Path, out: Path, params: dict, timeout_s: float, run_id: str) -> dict:
    """One papermill process for one notebook.

    ``run_id`` reaches the kernel as ``GRADKIT_RUN_ID``: every record it writes carries it. The notebook gets a
    temporary folder of its own (``TMPDIR``: its ranks' world folders), removed when it ends however it ends;
    papermill dies with this process, its kernel with papermill, the ranks with the kernel."""
    executed = out / path.name
    entry = {"notebook": path.name, "executed": str(executed), "parameters": params, "timeout_s": timeout_s}
    if STOP.signal:
        return {**entry, "status": "stopped", "wall_s": 0.0, "error": f"not started: the run was stopped ({STOP.signal})"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(params, f)  # JSON is YAML: papermill reads it with -f
    log = _log(path, out)
    cmd = [sys.executable, "-m", "papermill", str(path), str(executed), "-f", f.name, "-k", KERNEL,
           "--cwd", str(REPO), "--execution-timeout", str(int(timeout_s)), "--no-progress-bar",
           "--request-save-on-cell-execute"]
    tmp = Path(tempfile.mkdtemp(prefix=f"gradkit-{path.stem}-"))
    env = {**{k: v for k, v in os.environ.items() if k != kconfig.FRONTEND_ENV},  # headless, even when started
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "TMPDIR": str(tmp), RUNNER_PROGRESS_ENV: str(tmp / "progress.jsonl")}  # from a JupyterLab kernel
    if run_id:
        env[RUN_ID_ENV] = run_id
    t0 = time.time()
    proc = None
    try:
        with open(log, "wb") as logf, STOP.lock:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=launch.session_dying_with_parent)
            STOP.running[proc.pid] = proc
            LIVE[path.name] = Live(executed, tmp / "progress.jsonl")
        if STOP.signal:  # the stop came while it was being started
            launch.kill_tree(proc.pid)
        try:
            code = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            launch.kill_tree(proc.pid)  # papermill, its kernel, and the kernel's ranks
            proc.wait()
            code, timed_out = None, True
    finally:
        if proc is not None:
            STOP.running.pop(proc.pid, None)
        LIVE.pop(path.name, None)
        os.unlink(f.name)
        shutil.rmtree(tmp, ignore_errors=True)
    entry["wall_s"] = round(time.time() - t0, 1)
    if code == 0:
        entry["status"] = "ok"
        return entry
    cell = failing_cell(executed)
    if STOP.signal and not timed_out:
        entry.update(status="stopped", failing_cell=cell, error=f"stopped by {STOP.signal}"
                     + (f" in cell {cell['index']}" if cell else ""))
        return entry
    entry["status"] = "timeout" if timed_out else "failed"
    entry["failing_cell"] = cell
    if timed_out:
        entry["error"] = f"stopped at its limit of {timeout_s:g} s" + (f" in cell {cell['index']}" if cell else "")
    elif cell:
        entry["error"] = f"cell {cell['index']}: {cell['ename']}: {cell['evalue']}"[:1000]
    else:
        entry["error"] = f"papermill exited with {code}: " + log.read_text(errors="replace")[-800:]
    return entry


class Live:
    """What a running notebook has done so far, read from outside its kernel: cells from the executed notebook
    papermill saves after every cell, cases from the events its runner appends
    (``gradkit.probes.runner.PROGRESS_ENV``)."""

    def __init__(self, executed: Path, events: Path):
        self.executed = executed
        self.cells, self.total = 0, None
        self.since = time.time()  # an executed notebook older than this is a previous run's, not yet overwritten
        self.world: dict = {}
        self.done = 0
        self.read_events = launch.PartialReader(events, self._hear)  # whole lines only, each once

    def _hear(self, event: dict) -> None:
        if event.get("kind") == "world":
            self.world, self.done = event, 0
        elif event.get("kind") == "case":
            self.done = event.get("done", self.done + 1)

    def poll(self) -> None:
        try:
            if self.executed.stat().st_mtime < self.since:
                raise OSError("a previous run's notebook")
            nb = json.loads(self.executed.read_text())  # papermill may be writing it: then keep the last count
            states = [c.get("metadata", {}).get("papermill", {}).get("status") for c in nb["cells"]]
            self.cells, self.total = states.count("completed"), len(states)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        self.read_events()

    def say(self, name: str) -> str:
        bits = [f"{Path(name).stem} cell {self.cells}/{self.total or '?'}"]
        if self.world:
            bits.append(f"{self.world.get('probe', '')} on {self.world.get('label')}: {self.done}/{self.world.get('planned')} cases")
            if self.world.get("first_time") and not self.done:
                bits.append(f"first launch: {self.world['first_time']}")
        return ", ".join(bits)


LIVE: dict[str, Live] = {}
