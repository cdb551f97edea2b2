"""Get a run's one-off work done up front, in parallel, once: every overlay its stacks need installed and every
DeepSpeed CPU comm op built, before the notebooks start (``gradkit.notebooks.runall`` runs it first).

    python -m gradkit.stacks.prefetch --needs needs.json [--jobs 2] [--no-progress]

``needs.json`` lists what the run's worlds will need, one entry per probe and stack, as each notebook's
``check_notebook`` returns it (``needs_of``): ``{"packages": [...], "init": "deepspeed", "stack": {...}}``.
Installs (network and unpacking) run up to ``INSTALL_JOBS`` at a time; a comm-op build (a compiler, ~40 s of one
core) starts as soon as its release is installed, ``--jobs`` at a time, in a one-rank world like the notebooks'
own. What is already in the cache costs nothing (``gradkit.probes.runner.first_time`` says what is not).

Exit status: 0 everything is ready; 1 something could not be prepared here (said on stderr: the notebooks will
record those stacks as ``cannot-run``); 2 a stack names a release the package index does not have (nothing ran).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from gradkit import config as kconfig
from gradkit import launch
from gradkit.probes import runner
from gradkit.probes.runner import stack_label
from gradkit.stacks import versions as kversions

INSTALL_JOBS = 4  # pip installs wait mostly on the network; the builds are what the cores do
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Need:
    """One stack as one kind of world uses it: what it imports, and whether its ranks start DeepSpeed."""

    stack: tuple  # sorted (package, version) pairs
    packages: tuple
    init: str

    @property
    def label(self) -> str:
        return stack_label(dict(self.stack))

    def as_json(self) -> dict:
        return {"stack": dict(self.stack), "packages": list(self.packages), "init": self.init}


def needs_of(pairs) -> list[Need]:
    """``(probe, stack)`` pairs (what ``check_notebook`` returns) as distinct ``Need`` s, in order."""
    out: list[Need] = []
    for probe, stack in pairs:
        need = Need(tuple(sorted(dict(stack).items())), tuple(probe.packages), probe.init)
        if need not in out:
            out.append(need)
    return out


def _from_json(items: list) -> list[Need]:
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("stack"), dict) for i in items):
        raise kconfig.ConfigError("a needs file is a JSON list of {\"stack\": {...}, \"packages\": [...], \"init\": ...}")
    return [Need(tuple(sorted(i["stack"].items())), tuple(i.get("packages", ["deepspeed"])), i.get("init", "deepspeed"))
            for i in items]


def pending(needs: list[Need]) -> list[tuple[Need, str]]:
    """The needs whose first world would do one-off work, with what that work is in words."""
    out = []
    for need in needs:
        probe = _as_probe(need)
        said = runner.first_time(dict(need.stack), probe)
        if said:
            out.append((need, said))
    return out


def _as_probe(need: Need):
    """What ``gradkit.probes.runner.first_time`` reads of a probe: its packages and how its world starts."""
    from types import SimpleNamespace

    return SimpleNamespace(packages=need.packages, init=need.init)


def install(need: Need):
    """The stack resolved (its overlays installed): ``(launch.World for a one-rank world, versions.Stack)``."""
    return runner.world_for(_as_probe(need), dict(need.stack), 1, "cpu", BUILD_TIMEOUT_S)


def build(world) -> None:
    """Start DeepSpeed once in a one-rank world of the stack: ``init_distributed`` builds the comm op into the
    kit's cache, where every later world of that release finds it."""
    launch.run_world("gradkit.launch.selftest:ping", {}, world)


def prefetch(needs: list[Need], jobs: int = 2, progress: bool = True) -> tuple[list[str], list[str]]:
    """Do the one-off work of ``needs``; returns ``(done, problems)``, one sentence each. Raises
    ``versions.UnknownVersion`` (a ``ConfigError``) when a stack names a release the index does not have."""
    from tqdm import tqdm

    todo = pending(needs)
    done: list[str] = []
    problems: list[str] = []
    unknown: list[str] = []
    if not todo:
        return done, problems
    running: dict[str, str] = {}
    lock = threading.Lock()
    bar = tqdm(total=len(todo), desc="prefetch", unit="stack", file=sys.stderr, disable=not progress,
               bar_format="{desc}: {n}/{total} stacks ready [{elapsed}] {postfix}")

    def show(key: str, what: str | None) -> None:
        with lock:
            if what is None:
                running.pop(key, None)
            else:
                running[key] = what
            bar.set_postfix_str("; ".join(f"{k}: {v}" for k, v in sorted(running.items())), refresh=False)
            bar.refresh()

    def one(need: Need, said: str):
        """Install the stack; returns the one-rank world to build its comm op in, a sentence, or None."""
        key = need.label
        show(key, "installing" if "installing" in said else "resolving")
        try:
            world, _ = install(need)
        except kversions.UnknownVersion as e:
            unknown.append(str(e))
            return None
        except kversions.CannotRun as e:
            problems.append(f"{key}: {e.reason}")
            return None
        finally:
            show(key, None)
        if need.init != "deepspeed" or "deepspeed" not in need.packages:
            return f"{key}: installed"
        return world

    def build_one(need: Need, world) -> str | None:
        key = need.label
        show(key, "building the comm op")
        try:
            build(world)
            return f"{key}: installed, comm op built"
        except launch.LaunchError as e:
            problems.append(f"{key}: DeepSpeed did not start here, so its comm op is not built: "
                            f"{str(e).splitlines()[0][:300]}")
            return None
        finally:
            show(key, None)

    builds_running = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as builds, ThreadPoolExecutor(max_workers=INSTALL_JOBS) as installs:
        firsts = {installs.submit(one, need, said): need for need, said in todo}
        for fut in as_completed(firsts):  # a build starts as soon as its release is installed
            got = fut.result()
            if isinstance(got, launch.World):
                builds_running.append(builds.submit(build_one, firsts[fut], got))
                continue
            if got:
                done.append(got)
            bar.update(1)
        for fut in as_completed(builds_running):
            if fut.result():
                done.append(fut.result())
            bar.update(1)
    bar.close()
    if unknown:
        raise kversions.UnknownVersion(unknown[0])
    return done, problems


def default_jobs() -> int:
    """Builds at a time: one per core (a build is one compiler process)."""
    return max(1, os.cpu_count() or 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--needs", required=True, help="JSON list of the stacks the run's worlds need (gradkit.notebooks.runall writes it)")
    ap.add_argument("--jobs", type=int, default=default_jobs(), help="comm-op builds at the same time")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--result", help="write {done, problems, unknown} here as JSON instead of saying them (gradkit.notebooks.runall)")
    a = ap.parse_args(argv)
    kconfig.check_positive_int("jobs", a.jobs)
    kconfig.check_environment()
    try:
        needs = _from_json(json.loads(open(a.needs).read()))
    except (OSError, ValueError) as e:
        raise kconfig.ConfigError(f"--needs {a.needs} is not a readable JSON list ({e})") from None
    if a.result:
        try:
            done, problems = prefetch(needs, a.jobs, progress=not a.no_progress)
            unknown = ""
        except kconfig.ConfigError as e:
            done, problems, unknown = [], [], str(e)
        with open(a.result, "w") as f:
            json.dump({"done": done, "problems": problems, "unknown": unknown}, f)
        return 2 if unknown else 1 if problems else 0
    done, problems = prefetch(needs, a.jobs, progress=not a.no_progress)
    for line in done:
        print(f"prefetch: {line}", file=sys.stderr)
    for line in problems:
        print(f"prefetch: not ready: {line} (its notebooks will record it as cannot-run)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    kconfig.run_cli(main)
