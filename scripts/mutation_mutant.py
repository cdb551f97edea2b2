"""One mutant, written into its module in a checkout and run against its two stages of tests, each in a pytest forked
from this process (``scripts/mutation_run.py`` runs them one after another, ``scripts/mutation_workers.py`` on
several checkouts at once)."""
from __future__ import annotations

import contextlib
import difflib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cosmic_ray.mutating import use_mutation
from cosmic_ray.plugins import get_operator
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

REPO = Path(__file__).resolve().parents[1]
FAST_TIMEOUT_S = 120.0  # per mutant of the fast stage (its tests take seconds: a mutant that loops forever is killed)
TIMEOUT_S = 600.0  # per mutant of the world stage; a world test that hangs is stopped by the kit's own timeouts before,
# so a world stage past it is not counted (its selection is too long to judge one mutant: pending, said)
NOT_RUN = "not run"  # pytest could not run the selection (a test the map names is gone): the mutant stays pending


def run_tests(args: list[str], timeout_s: float, root: Path = REPO) -> tuple[str, str]:
    """pytest on ``args`` (stop at the first failure) in ``root`` (a checkout), in a child forked from this process,
    which has imported torch and pytest but never the kit (so the child imports the mutant, and the ranks it starts do
    too): ``(outcome, output's tail)``; a hang is a kill, the child's whole process group with it."""
    with tempfile.TemporaryFile("w+") as log:
        pid = os.fork()
        if pid == 0:  # the child: a fresh session, output to the log, pytest as `python -m pytest` runs it
            code = 3
            try:
                os.setsid()
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.chdir(root)
                sys.path.insert(0, str(root))
                code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *args]))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    return TestOutcome.KILLED, f"timed out after {timeout_s:.0f} s"
                time.sleep(0.05)
        except BaseException:  # a stop (SIGTERM, Ctrl-C) while the child runs: it goes too, with its worlds
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise
        with contextlib.suppress(ProcessLookupError):  # ranks or servers the tests left behind
            os.killpg(pid, signal.SIGKILL)
        log.seek(0)
        out = log.read()
    if os.WIFSIGNALED(status):  # the mutant crashed the test process
        return TestOutcome.KILLED, f"pytest died of signal {os.WTERMSIG(status)}: " + out[-1500:]
    code = os.WEXITSTATUS(status)
    # 2-4: interrupted, internal or usage error; one of them is the mutant's (a module that no longer imports, a
    # collection it breaks) unless pytest did not find a test the map names (renamed since the map was built)
    stale = "ERROR: not found:" in out or "no match in any of" in out
    outcome = {0: TestOutcome.SURVIVED, 1: TestOutcome.KILLED, 5: TestOutcome.SURVIVED}.get(
        code, NOT_RUN if stale else TestOutcome.KILLED)
    return outcome, f"pytest exit {code}: " + out[-1500:]


def mutate_and_test(module: str, mutation, args: tuple[list[str], list[str]], fast_only: bool,
                    root: Path = REPO) -> WorkResult | None:
    """One mutant against its stages, in the checkout ``root`` (None: pytest could not run a stage; the mutant stays
    pending). ``fast_only``: no world stage (``--fast``, or a survivor ``equivalent.yaml`` lists, whose reason says no
    output changes)."""
    operator = get_operator(mutation.operator_name)()
    with use_mutation(root / module, operator, mutation.occurrence) as (original, mutated):
        if mutated is None:
            return WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
        diff = "".join(difflib.unified_diff(original.splitlines(True), mutated.splitlines(True), module, module))
        said = []
        outcome = TestOutcome.SURVIVED
        for stage, a, limit in (("fast", args[0], FAST_TIMEOUT_S), ("world", args[1], TIMEOUT_S)):
            if not a or (stage == "world" and fast_only):
                continue
            outcome, output = run_tests(a, limit, root)
            if stage == "world" and output.startswith("timed out"):  # a world hangs at its own timeout before this:
                outcome = NOT_RUN  # a selection this long is the map's coarseness (whole files), not the mutant's hang
            if outcome == NOT_RUN:
                print(f"  {module} {mutation.operator_name}[{mutation.occurrence}]: pytest could not run its {stage} "
                      f"selection ({output[:300]}); build the map again (bash scripts/test.sh --map)", flush=True)
                return None
            said.append(f"{stage}: {output}")
            if outcome == TestOutcome.KILLED:
                break
        if not any(args):
            said.append("no test reaches it")
    return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome, output="\n".join(said), diff=diff)


def restore(module: str, root: Path = REPO) -> None:
    """A run stopped mid-mutant leaves the mutant on disk: the module is put back from git (the script refuses to
    start with uncommitted changes in kit/, so git holds the truth)."""
    if subprocess.run(["git", "--no-optional-locks", "diff", "--quiet", "--", module], cwd=root).returncode:
        subprocess.run(["git", "checkout", "--", module], cwd=root, check=True)
