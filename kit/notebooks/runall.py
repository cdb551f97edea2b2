"""Execute the notebooks with papermill, in parallel, and collect their verdicts into one summary.

    python -m kit.notebooks.runall [--params scripts/params/quick.yaml] [--out runs/latest] [--jobs 2]
                         [--timeout 1800] [NOTEBOOK ...]

- **Parameters** come from a YAML file (``defaults`` for every notebook that has the knob, ``notebooks``
  per notebook stem, ``timeouts`` in seconds per stem) and are checked against each notebook's
  ``parameters`` cell (``papermill.inspect_notebook``) before anything runs: papermill itself only warns
  about unknown names.
- **Each notebook runs in its own papermill process** with a wall-clock limit (its ``timeouts`` entry or
  ``--timeout``); at the limit the process group, kernel included, is killed. ``--jobs`` notebooks run
  at a time (each launches its own ranks). A failed or timed-out notebook is reported with its failing
  cell and does not stop the others.
- **Prefetch** (``kit.stacks.prefetch``; ``--no-prefetch``: none): before any notebook starts, every overlay the
  notebooks' stacks need is installed and every DeepSpeed comm op their worlds load is built, in parallel and
  with a progress bar of its own, so that no notebook cell waits on pip or a compiler. A release the package
  index does not have is bad input (exit 2, no notebook started).
- **Aggregating notebooks** (those with a ``LOAD_RESULTS`` parameter, i.e. the overview) run after the
  bug notebooks and read the records those just wrote.
- **The summary** (``summary.md``, ``summary.json``, ``verdict_matrix.png`` / ``.json``) links to every
  executed notebook, and lists any verdict that changed since the previous run into the same folder.
- **The site** (``OUT/site/index.html``, ``kit.notebooks.site``): the summary and every executed notebook as static HTML
  pages with their figures and a table of contents, to read without running anything (``--no-site``: none).
Exit status: 0 all notebooks ran, 1 one or more failed, 2 bad input (nothing ran).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from kit import config as kconfig
from kit import launch, probes
from kit.judge import records
from kit.judge import tables as report
from kit.judge.records import RUN_ID_ENV
from kit.notebooks import overview, site
from kit.probes.runner import PROGRESS_ENV as RUNNER_PROGRESS_ENV
from kit.stacks import prefetch as kprefetch

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
KERNEL = "gradkit"
AGGREGATE_PARAMETER = "LOAD_RESULTS"
DEFAULT_TIMEOUT_S = 1800.0


def notebook_parameters(path) -> dict:
    import papermill

    return dict(papermill.inspect_notebook(str(path)))


def validate_parameters(path, params: dict, known: dict | None = None) -> None:
    """Raise ``ConfigError`` naming every parameter the notebook does not have."""
    known = notebook_parameters(path) if known is None else known
    if not known:
        raise kconfig.ConfigError(f"{path} has no cell tagged 'parameters'")
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise kconfig.ConfigError(f"{Path(path).name}: unknown parameter(s) {unknown}; it has {sorted(known)}")


def load_params(path) -> dict:
    """``{"defaults": {...}, "notebooks": {stem: {...}}, "timeouts": {stem: s}}`` from YAML (all keys optional)."""
    import yaml

    keys = ("defaults", "notebooks", "timeouts")
    if path is None:
        return {k: {} for k in keys}
    if not Path(path).is_file():
        raise kconfig.ConfigError(f"no such parameters file: {path}")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise kconfig.ConfigError(f"{path} is not a YAML parameters file{at}: "
                                  f"{str(e).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise kconfig.ConfigError(f"{path} must map 'defaults', 'notebooks' and 'timeouts', not hold a "
                                  f"{type(data).__name__} ({str(data)[:60]!r})")
    for k in keys:
        if not isinstance(data.get(k) or {}, dict):
            raise kconfig.ConfigError(f"{path}: '{k}' must be a mapping, got {data[k]!r:.80}")
    for stem, values in (data.get("notebooks") or {}).items():
        if not isinstance(values, dict):
            raise kconfig.ConfigError(f"{path}: notebooks.{stem} must map parameter names to values, got {values!r:.80}")
    extra = set(data) - set(keys)
    if extra:
        raise kconfig.ConfigError(f"{path}: unknown top-level key(s) {sorted(extra)}; use {list(keys)}")
    spec = {k: data.get(k) or {} for k in keys}
    for stem, t in spec["timeouts"].items():
        try:
            kconfig.check_timeout(t)
        except kconfig.ConfigError as e:
            raise kconfig.ConfigError(f"{path}: timeouts.{stem}: {e}") from None
    return spec


def notebook_defaults(path: Path, known: dict | None = None) -> dict:
    """The values of a notebook's ``parameters`` cell, as Python values."""
    import ast

    known = notebook_parameters(path) if known is None else known
    return {name: ast.literal_eval(p["default"]) for name, p in known.items()}


# The kit's notebooks whose parameters are checked by a module of their own, not by a probe's ``check_notebook``: the
# notebooks that are not a probe's, and 07, which four probes share.
TOOL_NOTEBOOKS = {"00_overview.ipynb": "kit.notebooks.overview", "05_explorer.ipynb": "kit.notebooks.explore",
                  "06_sweep.ipynb": "kit.notebooks.sweep", "07_without_deepspeed.ipynb": "kit.notebooks.without_ds",
                  "08_new_bug.ipynb": "kit.notebooks.bisect_known"}


def check_notebook_values(path: Path, params: dict, known: dict | None = None, source: str = "") -> list:
    """Every value a kit notebook will run with (its defaults, then ``params``), checked by the notebook's own
    ``check_notebook`` -- before any kernel starts. ``ConfigError`` names the notebook and where the values
    came from; notebooks outside notebooks/ (a user's, a test's) have no such check. Returns the ``(probe,
    stack)`` pairs the notebook's worlds will run (what ``kit.stacks.prefetch`` prepares), [] when it does not say."""
    import importlib

    if path.parent != NOTEBOOKS.resolve():
        return []
    checks = {name: probe.check_notebook for name, probe in probes.by_notebook().items() if probe.check_notebook}
    checks.update({name: importlib.import_module(module).check_notebook for name, module in TOOL_NOTEBOOKS.items()})
    if path.name not in checks:
        return []
    try:
        values = {**notebook_defaults(path, known), **params}
        if "INTERACTIVE" in values:
            kconfig.interactive(values["INTERACTIVE"])
        return list(checks[path.name](values) or [])
    except kconfig.ConfigError as e:
        raise kconfig.ConfigError(f"{path.name}{f' ({source})' if source else ''}: {e}") from None


def params_for(path: Path, spec: dict, out: Path, aggregate_from: Path | None = None, known: dict | None = None) -> dict:
    known = notebook_parameters(path) if known is None else known
    params = {k: v for k, v in spec["defaults"].items() if k in known}  # defaults apply where they fit
    params.update(spec["notebooks"].get(path.stem, {}))  # named ones must fit
    if "RESULTS_DIR" in known:
        params["RESULTS_DIR"] = str(out)
    if AGGREGATE_PARAMETER in known and aggregate_from is not None and AGGREGATE_PARAMETER not in params:
        params[AGGREGATE_PARAMETER] = str(aggregate_from)
    validate_parameters(path, params, known)
    return params


# ---------------------------------------------------------------------------------------------- one notebook

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
    """Run one notebook in its own papermill process; never raises for the notebook's own failures.

    ``run_id`` reaches the kernel as ``GRADKIT_RUN_ID``: every record it writes carries it. The notebook gets a
    temporary folder of its own (``TMPDIR``: its ranks' world folders), removed when it ends however it ends;
    papermill dies with this process, its kernel with papermill, the ranks with the kernel."""
    executed = out / path.name
    entry = {"notebook": path.name, "executed": str(executed), "parameters": params, "timeout_s": timeout_s}
    if STOP.signal:
        return {**entry, "status": "stopped", "wall_s": 0.0, "error": f"not started: the run was stopped ({STOP.signal})"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(params, f)  # JSON is YAML: papermill reads it with -f
    log = out / f"{path.stem}.papermill.log"
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
    papermill saves after every cell, cases from the events its runner appends (``kit.probes.runner.PROGRESS_ENV``)."""

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


# ---------------------------------------------------------------------------------------------- the run

def previous_summary(js: Path) -> dict:
    """The summary of the last run into this folder; ``{}`` when there is none to build on (no summary, an
    unreadable one, or one written by an older kit in another shape)."""
    try:
        old = json.loads(js.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or not isinstance(old.get("notebooks", []), list):
        return {}
    old["notebooks"] = [e for e in old.get("notebooks", []) if isinstance(e, dict) and "notebook" in e
                        and "executed" in e and "status" in e]
    return old


def summarise(entries: list[dict], out: Path, run_id: str, params_file: str | None = None,
              stopped: str | None = None, prefetch: dict | None = None) -> tuple[Path, Path]:
    """``summary.json`` / ``summary.md`` and the verdict matrix over every notebook that ran in run ``run_id``."""
    js = out / "summary.json"
    before = previous_summary(js)
    write_run_file(out, run_id, entries)  # the run's id and every notebook's final status
    # One folder, one truth: the notebooks of this run, and those an earlier run left here (with the run id
    # that produced them); records only of the run that last executed each notebook, only if it finished.
    mine = {e["notebook"] for e in entries}
    entries = entries + [{**e, "from_run": e.get("run_id") or before.get("run_id")}
                         for e in before.get("notebooks", []) if e["notebook"] not in mine]
    by_nb = {e["notebook"]: records.run_records(out, {Path(e["notebook"]).stem})[0] for e in entries}
    for e in entries:
        e.setdefault("run_id", run_id)
    cells = overview.verdict_matrix([r for recs in by_nb.values() for r in recs])
    previous = before.get("matrix") if isinstance(before.get("matrix"), list) else None
    changed = None
    if previous is not None:  # compared only where a notebook ran again with the same parameters
        old = {e["notebook"]: e.get("parameters") for e in before.get("notebooks", [])}
        same = {b.id for b in probes.registry().values() if b.notebook in mine and b.notebook in old
                and old[b.notebook] == next(e.get("parameters") for e in entries if e["notebook"] == b.notebook)}
        rerun = {b.id for b in probes.registry().values() if b.notebook in mine}
        keep = lambda cs: [c for c in cs if c["bug"] in same or c["bug"] not in rerun]  # noqa: E731
        changed = overview.differences(keep(previous), keep(cells))
    if cells:
        overview.save_matrix(cells, out)
    summary = {"notebooks": [{**e, "verdicts": report.verdict_rows(by_nb[e["notebook"]])} for e in entries],
               "matrix": cells, "changed_since_previous": changed, "run_id": run_id, "params_file": params_file,
               "stopped": stopped, "prefetch": prefetch}
    js.write_text(json.dumps(summary, indent=1, default=str))
    ok = sum(e["status"] == "ok" for e in entries)
    lines = ["# gradkit run-all summary", "",
             f"{ok} of {len(entries)} notebooks ran to the end (their last cells assert what they found).", ""]
    if prefetch and (prefetch["wall_s"] or prefetch["problems"]):
        lines += [f"Prefetch ({prefetch['wall_s']} s before the notebooks): " + "; ".join(prefetch["done"] + [
            f"**not ready:** {p}" for p in prefetch["problems"]]) + ".", ""]
    if stopped:
        lines += [f"**The run was stopped ({stopped})**: the notebooks marked `stopped` were killed with their "
                  "kernels and ranks, or never started; what finished before is below.", ""]
    if cells:
        link = lambda nb: nb  # noqa: E731 - the executed copies sit next to this file
        lines += ["## Verdict matrix", "", "![verdict matrix](verdict_matrix.png)", "",
                  overview.matrix_table(cells, link=link), "",
                  "Each cell: the worst verdict of the probe's measured configuration on that DeepSpeed release, "
                  "with the effective/reference ratio (1.000 = correct; B2: the pipeline stage furthest from 1; B1: the "
                  "Trainer's step, with whether GAS changes it, and the steps without DeepSpeed in their own column) and "
                  "the cosine of the configuration shown.", ""]
    if changed is not None:
        lines += ["Verdicts identical to the previous run into this folder." if not changed else
                  "**Verdicts changed since the previous run into this folder:** " + "; ".join(changed), ""]
    for e in entries:
        earlier = f" (from the earlier run {e['from_run']})" if e.get("from_run") else ""
        lines.append(f"## [{e['notebook']}]({Path(e['executed']).name}) — {e['status']} in {e['wall_s']} s{earlier}")
        if e["status"] != "ok":
            cell = e.get("failing_cell") or {}
            lines += ["", f"**{e['status'].capitalize()}:** `{e['error']}`", ""]
            if cell.get("source"):
                lines += [f"Cell {cell['index']}:", "", "```python", cell["source"], "```", ""]
            continue
        if by_nb[e["notebook"]]:
            lines += ["", report.verdict_table(by_nb[e["notebook"]]), ""]
    md = out / "summary.md"
    md.write_text("\n".join(lines) + "\n")
    return md, js


def default_jobs() -> int:
    """Two notebooks at a time where there are 2 cores: their ranks mostly wait in collectives, overlay
    installs and comm-op builds, so two 2-rank notebooks share 2 cores well (``scripts/bench.py`` measures it)."""
    return max(1, min(2, os.cpu_count() or 1))


def read_run_file(out: Path) -> dict:
    """``run.json`` of a folder as ``{"run_id", "notebooks": {name: {"status", "run_id"}}}`` (empty if none)."""
    try:
        run = json.loads((out / records.RUN_FILE).read_text())
        return {"run_id": run["run_id"], "notebooks": {
            k: (v if isinstance(v, dict) else {"status": v, "run_id": run["run_id"]}) for k, v in run["notebooks"].items()}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"run_id": None, "notebooks": {}}


def write_run_file(out: Path, run_id: str, entries: list[dict]) -> Path:
    """``run.json``: this run's id, and every notebook of the folder with its status and the run that last executed
    it -- the notebooks of this run updated, the others kept (what ``records.run_records`` trusts)."""
    run = read_run_file(out)
    notebooks = {**run["notebooks"], **{e["notebook"]: {"status": e["status"], "run_id": run_id} for e in entries}}
    path = out / records.RUN_FILE
    path.write_text(json.dumps({"run_id": run_id, "notebooks": notebooks}, indent=1, sort_keys=True))
    return path


LOCK_FILE = ".runall.lock"


def lock_folder(out: Path):
    """Hold ``out`` for this run (an open file with an exclusive lock); a clear refusal if another run holds it."""
    import fcntl

    f = open(out / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise kconfig.ConfigError(f"{out} is in use by another run-all ({holder}): wait for it to end, or give "
                                  "--out another folder") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def resolve_notebook(arg: str) -> Path:
    """A notebook as the README writes it: a path, or a name (with or without .ipynb) in notebooks/."""
    p = Path(arg)
    for cand in (p, NOTEBOOKS / p.name, NOTEBOOKS / f"{p.name}.ipynb"):
        if cand.suffix == ".ipynb" and cand.is_file():
            return cand.resolve()
    raise kconfig.ConfigError(f"no such notebook: {arg} (looked for it as given and in {NOTEBOOKS})")


def new_run_id() -> str:
    import uuid

    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"


def prefetch(needs: list, jobs: int, progress: bool) -> dict:
    """``kit.stacks.prefetch`` of the run's stacks, in a process of its own that Stop kills whole (its pip installs and
    one-rank worlds with it): ``{"status", "wall_s", "done", "problems"}``. A release the package index does not
    have is bad input (``ConfigError``): no notebook starts."""
    needs = kprefetch.needs_of(needs)
    if not kprefetch.pending(needs):
        return {"status": "ok", "wall_s": 0.0, "done": [], "problems": [], "stacks": len(needs)}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="gradkit-prefetch-") as tmp:
        (Path(tmp) / "needs.json").write_text(json.dumps([n.as_json() for n in needs]))
        cmd = [sys.executable, "-m", "kit.stacks.prefetch", "--needs", str(Path(tmp) / "needs.json"), "--jobs", str(jobs),
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
            said = {"done": [], "problems": [f"kit.stacks.prefetch ended with status {code} before saying what it did"]}
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
    ``prefetch_jobs`` > 0: first the overlays and comm ops of every stack the notebooks name (``kit.stacks.prefetch``,
    that many builds at a time); what it did goes into ``report["prefetch"]``."""
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="notebooks to run (default: notebooks/*.ipynb)")
    ap.add_argument("--params", help="YAML file of parameters (scripts/params/*.yaml)")
    ap.add_argument("--out", default=str(REPO / "runs" / "latest"), help="folder for executed notebooks and summary")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="per-notebook wall-clock limit in seconds (a params file's 'timeouts' override it)")
    ap.add_argument("--jobs", type=int, default=default_jobs(), help="notebooks run at the same time")
    ap.add_argument("--device", choices=kconfig.DEVICES, help="DEVICE for every notebook (overrides the params file)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-site", action="store_true", help="no HTML site of the executed notebooks (OUT/site)")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="no prefetch step: each notebook installs its overlays and builds its comm ops itself")
    a = ap.parse_args(argv)
    kconfig.check_timeout(a.timeout)
    kconfig.check_positive_int("jobs", a.jobs)
    paths = [resolve_notebook(p) for p in a.notebooks] or sorted(NOTEBOOKS.glob("*.ipynb"))
    kconfig.check_environment()
    spec = load_params(a.params)
    spec["file"] = a.params or ""
    if a.device:
        kconfig.check_device(a.device)  # cuda without a visible GPU: refused here, not in six notebooks
        spec["defaults"]["DEVICE"] = a.device
    # a params file covers the kit's notebooks; entries for the ones not run now are left unused (so quick.yaml
    # serves any subset), entries for a notebook that exists nowhere are a typo
    stems = {p.stem for p in paths} | {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    unknown_nb = (set(spec["notebooks"]) | set(spec["timeouts"])) - stems
    if unknown_nb:
        raise kconfig.ConfigError(f"parameters or timeouts given for notebook(s) that do not exist: {sorted(unknown_nb)}")
    run_stems = {p.stem for p in paths}
    spec["notebooks"] = {k: v for k, v in spec["notebooks"].items() if k in run_stems}
    spec["timeouts"] = {k: v for k, v in spec["timeouts"].items() if k in run_stems}
    out = Path(a.out).expanduser().resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise kconfig.ConfigError(f"--out {out} cannot be written to ({e.strerror or e})") from None
    folder_lock = lock_folder(out)  # noqa: F841 - held until this process ends
    run_id = new_run_id()
    previous = STOP.install()
    try:
        report: dict = {}
        entries = run(paths, out, spec, a.jobs, a.timeout, progress=not a.no_progress, run_id=run_id,
                      prefetch_jobs=0 if a.no_prefetch else kprefetch.default_jobs(), report=report)
        params_file = None
        if a.params:
            pf = Path(a.params).resolve()
            params_file = str(pf.relative_to(REPO)) if pf.is_relative_to(REPO) else str(pf)
        md, js = summarise(entries, out, run_id, params_file, stopped=STOP.signal, prefetch=report.get("prefetch"))
        index = None if a.no_site or STOP.signal else build_site(out)
    finally:
        for sig, handler in previous.items():  # a caller in the same process (a test, a kernel) gets its own back
            signal.signal(sig, handler)
    failed = [e["notebook"] for e in entries if e["status"] != "ok"]
    print(f"executed notebooks: {out}\nsummary: {md}\n         {js}" + (f"\nsite:    {index}" if index else ""))
    if STOP.signal:
        print(f"stopped by {STOP.signal}: {len(failed)} notebook(s) did not finish; the summary says which",
              file=sys.stderr)
        return 128 + signal.Signals[STOP.signal].value  # 130 for SIGINT, 143 for SIGTERM
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
    return 1 if failed or index is False else 0


def build_site(out: Path):
    """The static site of the executed notebooks (``kit.notebooks.site``): its index, or False (said on stderr) when it
    could not be built; the run's own results stand either way."""
    try:
        return site.build(out)
    except Exception as e:  # noqa: BLE001 - a site that fails to render is reported, the run is kept
        print(f"site not built: {type(e).__name__}: {e}", file=sys.stderr)
        return False


if __name__ == "__main__":
    kconfig.run_cli(main)
