"""The notebooks of a run-all as one batch: the prefetch of their stacks first (``prefetch``), then the bug notebooks
``jobs`` at a time and the aggregating ones after them (``run``), with one progress bar over the cells of them all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from gradkit import config as kconfig
from gradkit import launch, probes
from gradkit.notebooks.runall_notebook import LIVE, STOP, execute
from gradkit.notebooks.runall_params import (
    AGGREGATE_PARAMETER,
    REPO,
    check_notebook_values,
    notebook_parameters,
    params_for,
)
from gradkit.notebooks.runall_summary import write_run_file
from gradkit.stacks import prefetch as kprefetch


def default_jobs() -> int:
    """Two notebooks at a time where there are 2 cores: their ranks mostly wait in collectives, overlay
    installs and comm-op builds, so two 2-rank notebooks share 2 cores well (``scripts/bench.py`` measures it)."""
    return max(1, min(2, os.cpu_count() or 1))


def new_run_id() -> str:
    import uuid

    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"


def prefetch(needs: list, jobs: int, progress: bool) -> dict:
    """``gradkit.stacks.prefetch`` of the run's stacks, in a process of its own that Stop kills whole (its pip installs
    and one-rank worlds with it): ``{"status", "wall_s", "done", "problems"}``. A release the package index does not
    have is bad input (``ConfigError``): no notebook starts."""
    needs = kprefetch.needs_of(needs)
    if not kprefetch.pending(needs):
        return {"status": "ok", "wall_s": 0.0, "done": [], "problems": [], "stacks": len(needs)}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gradkit-prefetch-") as tmp:
        (Path(tmp) / "needs.json").write_text(json.dumps([n.as_json() for n in needs]))
        cmd = [sys.executable, "-m", "gradkit.stacks.prefetch", "--needs", str(Path(tmp) / "needs.json"), "--jobs", str(jobs),
               "--result", str(Path(tmp) / "result.json")] + ([] if progress else ["--no-progress"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        with STOP.lock:
            if STOP.signal:
                return {"status": "stopped", "wall_s": 0.0, "done": [], "problems": [], "stacks": len(needs)}
            proc = subprocess.Popen(cmd, env=env, preexec_fn=launch.session_dying_with_parent)
            STOP.running[proc.pid] = proc
        try:
            code = proc.wait()
        finally:
            STOP.running.pop(proc.pid, None)
        try:
            said = json.loads((Path(tmp) / "result.json").read_text())
        except (OSError, ValueError):
            said = {"done": [],
                    "problems": [f"gradkit.stacks.prefetch ended with status {code} before saying what it did"]}
    if STOP.signal:
        return {"status": "stopped", "wall_s": round(time.time() - t0, 1), "done": [], "problems": [],
                "stacks": len(needs)}
    if said.get("unknown"):
        raise kconfig.ConfigError(said["unknown"])
    return {"status": "ok" if code == 0 else "incomplete", "wall_s": round(time.time() - t0, 1),
            "done": said.get("done", []), "problems": said.get("problems", []), "stacks": len(needs)}


def run(paths: list[Path], out: Path, spec: dict, jobs: int, timeout_s: float, progress: bool = True,
        run_id: str = "", prefetch_jobs: int = 0, report: dict | None = None) -> list[dict]:
    """Bug notebooks first, ``jobs`` at a time; then the aggregating ones, reading what the first wave wrote
    (``run.json`` says which notebooks of this run finished: only their records reach the overview).
    ``prefetch_jobs`` > 0: first the overlays and comm ops of every stack the notebooks name
    (``gradkit.stacks.prefetch``, that many builds at a time); what it did goes into ``report["prefetch"]``."""
    known = {p: notebook_parameters(p) for p in paths}
    aggregating = [p for p in paths if AGGREGATE_PARAMETER in known[p]]
    first = [p for p in paths if p not in aggregating]
    bug_notebooks = set(probes.by_notebook())
    source = out if any(p.name in bug_notebooks for p in first) else None  # else the overview runs the probes itself
    plan = {p: params_for(p, spec, out, source if p in aggregating else None, known[p]) for p in paths}  # all checked first
    needs = [need for p in paths for need in check_notebook_values(p, plan[p], known[p], spec.get("file", ""))]
    if prefetch_jobs:
        got = prefetch(needs, prefetch_jobs, progress)
        if report is not None:
            report["prefetch"] = got
        for line in got["problems"]:
            print(f"prefetch: not ready: {line} (its notebooks will record it as cannot-run)", file=sys.stderr)
        if got["wall_s"] and got["status"] != "stopped":
            print(f"prefetch: {len(got['done'])} stack(s) made ready in {got['wall_s']} s", file=sys.stderr)
    entries: dict[Path, dict] = {}
    bar = _bar(sum(_cells(p) for p in paths), progress)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(bar, paths, entries, stop), daemon=True)
    if progress:
        watcher.start()
    run_id = run_id or new_run_id()
    try:
        for wave in (first, aggregating):
            if wave is aggregating:
                write_run_file(out, run_id, [entries[p] for p in first])
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                futures = {pool.submit(execute, p, out, plan[p], float(spec["timeouts"].get(p.stem, timeout_s)), run_id): p
                           for p in wave}
                for fut in as_completed(futures):
                    e = entries[futures[fut]] = fut.result()
                    bar.write(f"{e['notebook']}: {e['status']} in {e['wall_s']} s" + (f" — {e['error']}" if e.get("error") else ""))
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        bar.close()
    return [entries[p] for p in paths]


def _bar(total: int, enabled: bool):
    """Cells run over cells planned, in every notebook of the run; the running notebooks' cell and cases after it."""
    from tqdm import tqdm

    return tqdm(total=total, desc="cells", unit="cell", file=sys.stderr, disable=not enabled)


def _cells(path: Path) -> int:
    """Cells papermill will run: the notebook's own, and the parameters cell it injects."""
    return len(json.loads(path.read_text())["cells"]) + 1


def _watch(bar, paths: list[Path], entries: dict, stop: threading.Event, every_s: float = 1.0) -> None:
    """Until ``stop``: the bar counts the cells run in every notebook and names what each running one is doing."""
    planned = {p.name: _cells(p) for p in paths}
    while True:
        stopped = stop.wait(every_s)  # once more after the stop: the bar ends on what really finished
        live = dict(LIVE)
        for name, lv in live.items():
            lv.poll()
            if lv.total:
                planned[name] = lv.total
        finished = sum(planned[e["notebook"]] for e in list(entries.values()))  # failed ones say so in their line
        bar.total = sum(planned.values())
        bar.n = finished + sum(lv.cells for lv in live.values())
        bar.set_postfix_str("; ".join(lv.say(name) for name, lv in sorted(live.items())), refresh=False)
        bar.refresh()
        if stopped:
            return
