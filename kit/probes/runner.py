"""The one way a probe runs: stacks x world sizes -> launch -> verdict against the control -> annotate.

    recs = runner.run(PROBE, cases, stacks=[{}, {"deepspeed": "0.18.9"}], world_sizes=(2,), meta={...})

For every stack (``{package: version}``, ``{}`` = what is installed) and world size, the cases run in
one world (or one per ``probe.world_key`` value, so that a case that breaks an engine cannot take the
others down: the groups are jobs of one warm world, ``gradkit.launch.warm_worlds``, whose ranks a failed job
takes down and the next group starts afresh). Each record is judged against the ``control`` case of the same world with the same
``probe.control_key``; then ``probe.annotate`` adds what only the probe knows (hypotheses, worst
stage, per-configuration verdicts). A stack that cannot be installed, or a world that fails, gives
``cannot-run`` records: never ``not-affected``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from gradkit import config as kconfig
from gradkit import launch
from gradkit.judge import naming, oracle, records
from gradkit.probes.probe import Probe
from gradkit.stacks import versions as kversions

_LISTENERS: list = []
PROGRESS_ENV = "GRADKIT_PROGRESS"  # a file the runner appends its events to, one JSON line each (gradkit.notebooks.runall reads it)


@contextlib.contextmanager
def listen(callback):
    """While the block runs, ``callback(event)`` hears every world the runner starts and every case its rank 0
    finishes, from the ranks themselves (an explorer's progress bar, a notebook's status line).

    Events: ``{"kind": "world", "probe", "label", "world_size", "planned", "first_time"}`` before a world
    (``first_time`` names the one-off work that makes a first launch slow, or is ""), then ``{"kind": "case",
    "done", "planned", "case"}`` as each case comes back. With ``GRADKIT_PROGRESS`` set (``gradkit.notebooks.runall`` sets it
    for each notebook's kernel) the same events are appended to that file.
    """
    _LISTENERS.append(callback)
    try:
        yield
    finally:
        _LISTENERS.remove(callback)


def _listening() -> bool:
    return bool(_LISTENERS) or bool(os.environ.get(PROGRESS_ENV))


def _emit(**event) -> None:
    for callback in list(_LISTENERS):
        callback(event)
    path = os.environ.get(PROGRESS_ENV)
    if path:
        try:
            with open(path, "a") as f:
                f.write(json.dumps(event, default=str) + "\n")
        except OSError:
            pass  # progress is for the eye: a run never fails for it


@contextlib.contextmanager
def case_bar(desc: str = "cases", widget: bool = False):
    """A tqdm bar of the cases the ranks finish, while the block runs: its total grows as each world announces
    its planned cases, its label names the probe and stack of the running world, and a first launch says what
    makes it slow. ``widget``: the notebook widget (JupyterLab) rather than text on stdout (papermill, a log)."""
    if widget:
        from tqdm.auto import tqdm
        bar = tqdm(total=0, desc=desc, unit="case")
    else:
        from tqdm import tqdm
        bar = tqdm(total=0, desc=desc, unit="case", file=sys.stdout, mininterval=2.0, ascii=True)

    def hear(event):
        if event["kind"] == "world":
            bar.total += event["planned"]
            bar.set_description(f"{desc}: {event.get('probe', '')} on {event['label']}, {event['world_size']} ranks")
            bar.set_postfix_str(f"first launch: {event['first_time']}" if event["first_time"] else "", refresh=False)
            bar.refresh()
        elif event["kind"] == "case":
            bar.update(1)

    try:
        with listen(hear):
            yield bar
    finally:
        bar.close()


def first_time(stack: dict, probe: Probe) -> str:
    """What makes the first launch of this stack slow, in words ("" when everything is cached)."""
    said = []
    for package, wanted in sorted(stack.items()):
        if package in probe.packages and wanted not in (kconfig.INSTALLED, kversions.installed_version(package)) \
                and not (kversions.overlay_root() / f"{package}-{wanted}" / ".complete").exists():
            said.append(f"installing {dict(deepspeed='DeepSpeed').get(package, package)} {wanted} into the kit's cache, "
                        "once per release (~30 s)")
    if "deepspeed" not in probe.packages:
        return "; ".join(said)
    version = stack.get("deepspeed") or kversions.installed_version("deepspeed")
    if probe.init == "deepspeed":
        built = kconfig.cache_dir() / "torch_extensions" / kversions.Stack({"deepspeed": version}).extensions_key
        if not any(built.rglob("*.so")) if built.exists() else True:
            said.append(f"building DeepSpeed {version}'s CPU comm op, once per release (~40 s)")
    return "; ".join(said)


def stack_label(stack: dict) -> str:
    """The short name of a requested stack: "installed", "0.18.9" (DeepSpeed alone), or "pkg=ver pkg=ver"."""
    if not stack:
        return "installed"
    if set(stack) == {"deepspeed"}:
        return stack["deepspeed"]
    return " ".join(f"{k}={v}" for k, v in sorted(stack.items()))


def stacks_of(versions) -> list[dict]:
    """A notebook's ``VERSIONS`` (DeepSpeed releases, "installed") as stacks."""
    return [{} if v == kconfig.INSTALLED else {"deepspeed": v} for v in versions]


def probe_stacks(probe: Probe, versions) -> list[dict]:
    """The stacks ``probe`` runs on for these DeepSpeed ``versions``: one each when its stack names DeepSpeed,
    else only the installed stack (the overview's rows, the notebooks' prefetch)."""
    return stacks_of(versions) if "deepspeed" in probe.packages else [{}]


def stacks_in(kwargs: dict) -> list[dict]:
    """The stacks a probe's ``run(**kwargs)`` launches: its ``stacks``, else its ``versions`` as stacks."""
    if kwargs.get("stacks") is not None:
        return [dict(s) for s in kwargs["stacks"]]
    return stacks_of(kwargs.get("versions") or [kconfig.INSTALLED])


def versions_of(stacks) -> list[str]:
    """The DeepSpeed release each stack asks for ("installed" where it names none)."""
    return [s.get("deepspeed", kconfig.INSTALLED) for s in stacks]


def run(probe: Probe, cases: list[dict], stacks=({},), world_sizes=(2,), device: str = "cpu",
        timeout_s: float = 600, meta: dict | None = None, predicted=None, label=stack_label) -> list[dict]:
    """Every case under every (stack, world size); one verdicted, annotated record per case and world.

    ``meta`` goes into every record (with ``bug``, ``probe``, ``world_size``, ``device``, ``stack``);
    ``predicted(case, world_size)``, if given, is stored as ``predicted_misplaced_weight``.
    """
    # The groups of one (stack, world size) share their ranks while they stay well. In a Jupyter kernel the worlds
    # also stay warm for the next cell (a notebook pays its imports and DeepSpeed's first initialize once per
    # stack, not once per cell; 2-5 s a call on 2 cores); elsewhere (a script, a test) the run leaves nothing.
    with launch.warm_worlds(keep=kconfig.in_kernel()):
        return _run(probe, cases, stacks, world_sizes, device, timeout_s, meta, predicted, label)


def _run(probe, cases, stacks, world_sizes, device, timeout_s, meta, predicted, label) -> list[dict]:
    out = []
    for stack in stacks:
        for w in world_sizes:
            base = {"bug": probe.id, "probe": probe.module, "init": probe.init, "world_size": w, "device": device,
                    "stack": dict(stack), **(meta or {})}
            groups: dict = {}
            for case in cases:
                groups.setdefault(probe.world_key(case) if probe.world_key else None, []).append(case)
            recs = []
            for group in groups.values():
                recs += world_records(probe, group, dict(stack), label(stack), base, w, device, timeout_s,
                                      None if predicted is None else (lambda case, w=w: predicted(case, w)))
            out += [naming.annotate_norms(r) for r in probe.annotate(recs)]  # the logged norm, every probe alike
    return out


def world_records(probe: Probe, cases: list[dict], stack: dict, version: str, meta: dict, world_size: int,
                  device: str, timeout_s: float, predicted=None) -> list[dict]:
    """Resolve ``stack``, run all ``cases`` in one world, return one verdicted record per case."""
    if _listening():
        _emit(kind="world", probe=probe.id, label=version, world_size=world_size, planned=len(cases), first_time=first_time(stack, probe))
    try:
        world, resolved = world_for(probe, stack, world_size, device, timeout_s)
    except kversions.CannotRun as e:
        return records.failed_records(cases, meta, version, e.reason)
    done = {"n": 0}

    def arrived(piece):
        done["n"] += 1
        _emit(kind="case", done=done["n"], planned=len(cases), case=piece.get("case"))

    try:
        rank0 = launch.run_world(probe.target, {"cases": cases}, world, on_partial=arrived if _listening() else None)[0]
    except launch.WorldStopped:
        raise  # the user's Stop: no record of a failed world, and no world after it
    except launch.LaunchError as e:
        # the cases rank 0 finished before the world failed keep their results; the rest could not run
        rank0 = e.partial.get(0, [])[:len(cases)]
        why = str(e).splitlines()[0][:300] + " (see the rank's traceback)"
        if not rank0:
            return records.failed_records(cases, meta, version, why, resolved.versions)
        rank0 += [{"error": f"not run: the world stopped after case {len(rank0)} of {len(cases)}: {why}",
                   "versions": rank0[0].get("versions", {})} for _ in cases[len(rank0):]]
    out = []
    for case, res in zip(cases, rank0):
        rec = record(meta, case, version, res)
        if predicted is not None:
            rec["predicted_misplaced_weight"] = predicted(case)
        out.append(rec)
    return judge(out, probe.control_key)


def world_for(probe: Probe, stack: dict, world_size: int, device: str, timeout_s: float):
    """``(launch.World, versions.Stack)`` for running ``probe`` on ``stack`` (installs an overlay if needed;
    ``CannotRun`` if it does not install)."""
    resolved = kversions.resolve_stack(stack, probe.packages)
    world = launch.World(world_size=world_size, device=device, timeout_s=timeout_s, pythonpath=resolved.pythonpath,
                         extensions_key=resolved.extensions_key, expect=resolved.expect, init=probe.init)
    return world, resolved


def record(meta: dict, case: dict, version: str, result: dict) -> dict:
    """One case's record, before its verdict: what ran (``meta``, the case) and what rank 0 measured."""
    rec = {**records.base(meta, case, version), **{k: v for k, v in result.items() if k not in ("case", "ga")}}
    rec.setdefault("metrics", None)
    return rec


def judge(recs: list[dict], control_key=lambda rec: rec["ga"]) -> list[dict]:
    """Each record's verdict against the control of its world with the same ``control_key``."""
    controls = {control_key(r): r for r in recs if r["role"] == "control"}
    for rec in recs:
        if rec["role"] == "symptom":  # a trajectory is evidence for the eye, not a gradient to judge
            rec["verdict"], rec["reason"] = (oracle.CANNOT_RUN, f"could not run: {rec['error']}") if rec.get("error") \
                else ("n/a", "trajectory of losses and grad norms; judged by the gradient cases")
            continue
        control = controls.get(control_key(rec))
        rec["verdict"], rec["reason"] = oracle.verdict(records.judged(rec), records.judged(control) if control else None)
    return recs
