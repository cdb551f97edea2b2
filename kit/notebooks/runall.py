"""Execute the notebooks with papermill, in parallel, and collect their verdicts into one summary.

    python -m gradkit.notebooks.runall [--params scripts/params/quick.yaml] [--out runs/latest] [--jobs 2]
                         [--timeout 1800] [NOTEBOOK ...]

- **Parameters** come from a YAML file (``defaults`` for every notebook that has the knob, ``notebooks``
  per notebook stem, ``timeouts`` in seconds per stem) and are checked against each notebook's
  ``parameters`` cell (``papermill.inspect_notebook``) before anything runs: papermill itself only warns
  about unknown names.
- **Each notebook runs in its own papermill process** with a wall-clock limit (its ``timeouts`` entry or
  ``--timeout``); at the limit the process group, kernel included, is killed. ``--jobs`` notebooks run
  at a time (each launches its own ranks). A failed or timed-out notebook is reported with its failing
  cell and does not stop the others.
- **Prefetch** (``gradkit.stacks.prefetch``; ``--no-prefetch``: none): before any notebook starts, every overlay the
  notebooks' stacks need is installed and every DeepSpeed comm op their worlds load is built, in parallel and
  with a progress bar of its own, so that no notebook cell waits on pip or a compiler. A release the package
  index does not have is bad input (exit 2, no notebook started).
- **Aggregating notebooks** (those with a ``LOAD_RESULTS`` parameter, i.e. the overview) run after the
  bug notebooks and read the records those just wrote.
- **The summary** (``summary.md``, ``summary.json``, ``verdict_matrix.png`` / ``.json``) links to every
  executed notebook, and lists any verdict that changed since the previous run into the same folder.
- **The site** (``OUT/site/index.html``, ``gradkit.notebooks.site``): the summary and every executed notebook as static
  HTML pages with their figures and a table of contents, to read without running anything (``--no-site``: none).
Exit status: 0 all notebooks ran, 1 one or more failed, 2 bad input (nothing ran).

Where each part is: ``runall_params`` (the parameters file, each notebook's parameters, the checks of their values
before anything runs), ``runall_notebook`` (one notebook's papermill process, its limit, its progress, the stop on
SIGINT / SIGTERM), ``runall_batch`` (the prefetch, the notebooks ``jobs`` at a time, the progress bar),
``runall_summary`` (``run.json``, ``summary.md`` / ``.json``, the verdict matrix); the command, ``main``, is here.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from gradkit import config as kconfig
from gradkit.notebooks import site
from gradkit.notebooks.runall_batch import default_jobs, new_run_id, run
from gradkit.notebooks.runall_notebook import STOP
from gradkit.notebooks.runall_params import NOTEBOOKS, REPO, load_params, resolve_notebook
from gradkit.notebooks.runall_summary import summarise
from gradkit.stacks import prefetch as kprefetch

DEFAULT_TIMEOUT_S = 1800.0
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
    """The static site of the executed notebooks (``gradkit.notebooks.site``): its index, or False (said on stderr) when
    it could not be built; the run's own results stand either way."""
    try:
        return site.build(out)
    except Exception as e:  # noqa: BLE001 - a site that fails to render is reported, the run is kept
        print(f"site not built: {type(e).__name__}: {e}", file=sys.stderr)
        return False


if __name__ == "__main__":
    kconfig.run_cli(main)
