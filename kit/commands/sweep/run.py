"""Running a sweep: every point of one stack inside one world, after one plain-torch control per GA; a point that
crashes or desynchronises the world costs only itself (the world is relaunched and goes on after it); each judged
point appended to ``records.jsonl`` as it comes back (a re-run into the same folder skips those), with a tqdm bar and
its ETA; and, for each unknown group, its standalone reproduction written, run and verified.
The summary of a sweep per stack (``summarise``): its counts, its groups, their reproductions."""
from __future__ import annotations

import json
from pathlib import Path

from gradkit import config as kconfig
from gradkit import launch, shapes
from gradkit.commands import check, repro
from gradkit.commands import issue as upstream
from gradkit.commands.sweep.grouping import describe, groups, separate, when_text
from gradkit.commands.sweep.spec import all_axes, point_case, points, release_of, spec_key, user_config
from gradkit.judge import oracle, records
from gradkit.probes import ds_config, runner


def _key(rec: dict) -> tuple:
    return rec.get("release"), rec.get("spec_key"), rec.get("id")


def _control_key(case: dict) -> tuple:
    return case["ga"], case.get("clip") or 0.0, case.get("steps", 1), case.get("model") or shapes.DEFAULT


def _controls(cases: list[dict]) -> list[dict]:
    return [{"name": f"control GA {n} clip {clip:g} {model}", "role": "control", "loop": "torch", "ga": n,
             "dtype": "fp32", "zero_stage": None, "clip": clip, "steps": steps, "model": model}
            for n, clip, steps, model in sorted({_control_key(c) for c in cases})]


def run_stack(spec: dict, stack: dict, todo: list[dict], sink, bar=None) -> None:
    """Every case of ``todo`` in one world of ``stack`` (relaunched after a case that breaks it); each judged
    record goes to ``sink(record)`` as soon as rank 0 reports it."""
    meta = {"bug": ds_config.CHECK.id, "probe": "sweep", "init": "deepspeed", "world_size": spec["world_size"],
            "device": spec["device"], "stack": dict(stack), "release": release_of(stack), "spec_key": spec_key(spec),
            "step_count": spec.get("steps", ds_config.STEPS)}
    label = runner.stack_label(stack)
    try:
        world, _ = runner.world_for(ds_config.CHECK, stack, spec["world_size"], spec["device"], spec["timeout_s"])
    except Exception as e:  # noqa: BLE001 - CannotRun, or a failed install: every point of the stack is cannot-run
        for rec in records.failed_records(todo, meta, label, getattr(e, "reason", str(e))):
            sink(_finish(rec))
        return
    remaining = list(todo)
    while remaining:
        controls = _controls(remaining)
        cases = controls + remaining
        got = {"n": 0, "controls": {}}  # pieces seen so far, the controls' records by GA

        def take(piece, cases=cases, got=got):
            case = cases[got["n"]]
            got["n"] += 1
            rec = runner.record(meta, case, label, piece)
            if case["role"] == "control":  # judged on its own by the oracle when it is every other point's control
                got["controls"][_control_key(case)] = rec
                return
            control = got["controls"].get(_control_key(case))
            rec["verdict"], rec["reason"] = oracle.verdict(records.judged(rec), records.judged(control) if control else None)
            sink(_finish(rec))
            if bar is not None:
                bar.update(1)

        try:
            launch.run_world(ds_config.CHECK.target, {"cases": cases}, world, on_partial=take)
            return
        except launch.LaunchError as e:
            done = got["n"]
            if done < len(controls):  # the world did not get through its controls: nothing after can be judged
                why = str(e).splitlines()[0][:300]
                for rec in records.failed_records(remaining, meta, label, f"the world failed before its controls: {why}"):
                    sink(_finish(rec))
                    if bar is not None:
                        bar.update(1)
                return
            finished = done - len(controls)
            crashed = remaining[finished]
            rec = records.failed_records([crashed], meta, label,
                                         f"this point broke the world ({str(e).splitlines()[0][:300]}); the sweep "
                                         "relaunched it and went on after this point")[0]
            rec["crashed_world"] = True
            sink(_finish(rec))
            if bar is not None:
                bar.update(1)
            remaining = remaining[finished + 1:]


def _finish(rec: dict) -> dict:
    rec["point"] = rec["config"].get("point")
    rec["id"] = rec["config"].get("id")
    ds_config.CHECK.annotate([rec])
    if rec["verdict"] == oracle.AFFECTED:
        rec["explained_by"], rec["explanation"] = check.explain(rec)
        rec["tied"] = check.tied(rec)
    return rec


JOBS = 2  # worlds at a time: a 2-rank world keeps about one core busy (its ranks wait for each other)


def run(spec: dict, out, progress: bool = True, retry: bool = False, jobs: int = JOBS) -> list[dict]:
    """Every point of ``spec`` under every stack; resumes from ``out/records.jsonl``. Returns this spec's records.

    A record is reused only for the same point, the same spec (``spec_key``) and the same resolved DeepSpeed
    release (an upgrade of the installed one, or another spec, runs everything again). ``retry``: points that
    were ``cannot-run`` run again (the newest record of a point is the one that counts). ``jobs`` worlds run at a
    time, each a share of a stack's points (dealt in turn) with its own controls."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    kconfig.check_positive_int("jobs", jobs)

    out = kconfig.repo_path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    sk = spec_key(spec)
    releases = {json.dumps(st, sort_keys=True): release_of(st) for st in spec["stacks"]}
    have = _newest(records.load(path) if path.exists() else [], spec)  # what is done: no explanation needed
    done = {_key(r) for r in have if not (retry and r["verdict"] == oracle.CANNOT_RUN)}
    (out / "spec.json").write_text(json.dumps(spec, indent=1, default=str))
    every = [point_case(spec, p) for p in points(spec)]
    todo = {k: [c for c in every if (rel, sk, c["id"]) not in done] for k, rel in releases.items()}
    total = sum(len(v) for v in todo.values())
    bar = tqdm(total=total, desc="sweep", unit="config", disable=not progress or not total)
    lock = threading.Lock()
    with open(path, "a") as f:
        def sink(rec):
            with lock:
                f.write(json.dumps(rec, sort_keys=True, default=str) + "\n")
                f.flush()

        shares = [(st, share) for st in spec["stacks"] for share in _deal(todo[json.dumps(st, sort_keys=True)],
                                                                           max(1, jobs // len(spec["stacks"])))]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for done in [pool.submit(run_stack, spec, st, share, sink, bar) for st, share in shares]:
                done.result()
    bar.close()
    return current(records.load(path), spec)


def _deal(cases: list[dict], n: int) -> list[list[dict]]:
    """``cases`` dealt in turn into at most ``n`` non-empty shares (neighbouring points land in different worlds)."""
    return [share for share in (cases[i::n] for i in range(n)) if share]


def current(recs: list[dict], spec: dict) -> list[dict]:
    """The records of this spec on the releases its stacks resolve to now (``_newest``); an affected one explained by
    the bug table as it is now (a verdict is a measurement, its explanation a reading of the table: a table that
    learned a bug's step explains a resumed record too)."""
    newest = _newest(recs, spec)
    for r in newest:
        if r.get("verdict") == oracle.AFFECTED and r.get("config"):
            r["explained_by"], r["explanation"] = check.explain(r)
            r["tied"] = check.tied(r)
    return newest


def _newest(recs: list[dict], spec: dict) -> list[dict]:
    """The records of this spec on the releases its stacks resolve to now, the newest one per point and release."""
    sk = spec_key(spec)
    wanted = {(release_of(st), json.dumps(st, sort_keys=True)) for st in spec["stacks"]}
    newest = {}
    for r in recs:
        if r.get("spec_key") == sk and (r.get("release"), json.dumps(r.get("stack"), sort_keys=True)) in wanted:
            newest[_key(r)] = r
    return list(newest.values())


def reproduce(spec: dict, stack: dict, mine: list[dict], gs: list[dict], out: Path, jobs: int = JOBS) -> None:
    """For each unknown group (not a known bug's, not a tie's): a standalone script next to the results, run to check that it reproduces (``jobs``
    scripts at a time), and its upstream report (``report_<...>.md``, ``gradkit.commands.report``)."""
    from concurrent.futures import ThreadPoolExecutor

    by_id = {r["id"]: r for r in mine}

    def one(k, g):
        tag = runner.stack_label(stack).replace(" ", "_").replace("=", "-")
        path = out / f"repro_{tag}_{k + 1}.py"
        repro.write(by_id[g["example"]], path, f"DeepSpeed gradient accumulation: {describe(g)}")
        rc, text = repro.verify(path, spec["world_size"], stack, spec["device"])
        shape = repro.shape_of(by_id[g["example"]])
        g["repro"] = {"script": path.name, "exit": rc, "shape": shape, "output": text,
                      "reproduced": repro.reproduced(rc, text, shape)}
        rec = by_id[g["example"]]
        config = path.with_name(path.name.replace("repro_", "config_").replace(".py", ".json"))
        config.write_text(json.dumps(user_config(spec, rec["point"]), indent=1, sort_keys=True))
        report = path.with_name(path.name.replace("repro_", "report_").replace(".py", ".md"))
        report.write_text(upstream.render(rec, path.name, path.read_text(), text, rc, when_text(g["when"]), None,
                                          upstream.bisect_command(config, rec)))
        g["config"] = config.name
        g["report"] = report.name  # ready to paste upstream (gradkit report adds a bisect's range to it)

    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each script is a world of its own, as the sweep's are
        for done in [pool.submit(one, k, g) for k, g in enumerate(gs) if not g["known_bug"] and not g.get("tie")]:
            done.result()


def summarise(spec: dict, recs: list[dict], out=None) -> dict:
    """Counts and groups per stack; with ``out``, the unknown groups' reproduction scripts are written there and run."""
    summary = {"stacks": []}
    for st in spec["stacks"]:
        mine = separate([r for r in recs if r["stack"] == st])
        counts = {v: sum(r["verdict"] == v for r in mine) for v in oracle.VERDICTS}
        gs = groups(mine, all_axes(spec))
        if out is not None:
            reproduce(spec, st, mine, gs, Path(out))
        deepspeed = next((r["versions"].get("deepspeed") for r in mine if r.get("versions")), None)
        summary["stacks"].append({"stack": st, "deepspeed": deepspeed, "configs": len(mine), "counts": counts,
                                  "groups": gs, "crashed_worlds": sum(bool(r.get("crashed_world")) for r in mine),
                                  "wall_s": round(sum(r.get("wall_s") or 0 for r in mine), 1)})
    return summary
