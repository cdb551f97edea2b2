"""Sweep the DeepSpeed configuration space with the check's oracle, and group what is affected.

    python -m kit.commands.sweep scripts/sweeps/default.yaml --out runs/sweep      # resumes what is already there
    python -m kit.commands.sweep scripts/sweeps/default.yaml --deepspeed 0.18.6,installed --out runs/sweep

A spec (YAML) names a ``base`` config, ``axes`` (dotted config keys, or ``loop``, ``dtype``, ``ga``, ``model``: a
shape of ``kit.shapes``), ``skip
rules (partial points that make no sense), the ``world_size`` and the ``stacks``. Every point of the
product is one case of ``kit.probes.ds_config``; every point of one stack runs inside one world, after
one plain-torch control per GA. A point that crashes or desynchronises the world costs only itself: the
world is relaunched and goes on after it. Each judged point is appended to ``records.jsonl`` as it comes
back (a re-run into the same folder skips those), with a tqdm bar and its ETA.

The affected points are then grouped by the smallest set of axis conditions (``axis in {values}``) that
holds for all of them and for no point that is not affected (``groups``); each group is named by the known
bug that explains its points (``kit.commands.check.explain``) or marked **unknown**. For an unknown group the sweep
writes a standalone reproduction (plain DeepSpeed + torch, no kit import) and runs it to verify it.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import time
from pathlib import Path

from kit import config as kconfig
from kit import launch
from kit.judge import oracle, records
from kit.probes import runner
from kit.probes import ds_config

SPECIAL_AXES = ("loop", "dtype", "ga", "model")
DTYPES = ("fp32", "bf16", "fp16")


# ---------------------------------------------------------------------------------------------- the spec

def load_spec(path) -> dict:
    import yaml

    p = kconfig.repo_path(path)
    try:
        spec = yaml.safe_load(p.read_text())
    except OSError as e:
        raise kconfig.ConfigError(f"cannot read the sweep spec {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise kconfig.ConfigError(f"the sweep spec {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    return check_spec(spec, str(p))


def check_spec(spec, where: str = "the spec") -> dict:
    if not isinstance(spec, dict) or not isinstance(spec.get("axes"), dict) or not spec["axes"]:
        raise kconfig.ConfigError(f"{where} needs 'axes': a mapping of axis name -> list of values")
    unknown = sorted(set(spec) - {"base", "axes", "skip", "world_size", "stacks", "device", "timeout_s", "steps",
                                  "one_at_a_time"})
    if unknown:
        raise kconfig.ConfigError(f"{where}: unknown key(s) {unknown}")
    _check_one_at_a_time(spec, where)
    for axis, values in spec["axes"].items():
        if not isinstance(values, list) or not values:
            raise kconfig.ConfigError(f"{where}: axis {axis!r} must be a non-empty list, got {values!r}")
        if axis == "loop" and set(values) - set(ds_config.LOOPS):
            raise kconfig.ConfigError(f"{where}: loop values must be among {ds_config.LOOPS}, got {values}")
        if axis == "dtype" and set(values) - set(DTYPES):
            raise kconfig.ConfigError(f"{where}: dtype values must be among {DTYPES}, got {values}")
        if axis == "ga":
            for v in values:
                kconfig.check_ga(v)
        if axis == "model":
            from kit import shapes

            for v in values:
                shapes.get(v)
    for rule in spec.get("skip") or []:
        if not isinstance(rule, dict) or set(rule) - set(all_axes(spec)):
            raise kconfig.ConfigError(f"{where}: a skip rule maps axes of the spec to a value, got {rule!r}")
    spec.setdefault("base", {})
    spec.setdefault("world_size", 2)
    spec.setdefault("stacks", [{}])
    spec.setdefault("device", "cpu")
    spec.setdefault("timeout_s", 1800)
    spec.setdefault("steps", ds_config.STEPS)
    kconfig.check_positive_int("steps", spec["steps"])
    kconfig.check_world_size(spec["world_size"], spec["device"])
    kconfig.check_timeout(spec["timeout_s"])
    if not isinstance(spec["stacks"], list) or not all(isinstance(s, dict) for s in spec["stacks"]):
        raise kconfig.ConfigError(f"{where}: stacks is a list of mappings like {{deepspeed: 0.18.8}}")
    for st in spec["stacks"]:
        for package, version in st.items():
            kconfig.check_version(version)
    for point in points(spec):  # every point resolves, or the spec is refused before anything launches
        try:
            point_case(spec, point)
        except kconfig.ConfigError as e:
            raise kconfig.ConfigError(f"{where}: the point {point} is not a config DeepSpeed accepts: {e}") from None
    return spec


def _matches(point: dict, rule: dict) -> bool:
    """A skip rule holds for a point when every axis it names has its value (a list: any of its values)."""
    return all(point.get(k) in v if isinstance(v, list) else point.get(k) == v for k, v in rule.items())


def _set(cfg: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        cfg = cfg.setdefault(k, {})
    cfg[keys[-1]] = value


DEFAULT = "default"  # a one-at-a-time key's value where a point leaves it as the base config has it


def _check_one_at_a_time(spec: dict, where: str) -> None:
    extra = spec.get("one_at_a_time")
    if extra is None:
        return
    if not isinstance(extra, dict) or set(extra) != {"over", "keys"} or not isinstance(extra["over"], dict) \
            or not isinstance(extra["keys"], dict) or not extra["keys"]:
        raise kconfig.ConfigError(f"{where}: one_at_a_time is {{over: {{axis: [values]}}, keys: {{dotted key: "
                                  f"[values]}}}}, got {extra!r}")
    for axis, values in extra["over"].items():
        if axis not in spec["axes"] or not isinstance(values, list) or set(values) - set(spec["axes"][axis]):
            raise kconfig.ConfigError(f"{where}: one_at_a_time.over.{axis} must list values of the axis {axis}, "
                                      f"got {values!r}")
    for key, values in extra["keys"].items():
        if key in spec["axes"] or key in SPECIAL_AXES or not isinstance(values, list) or not values \
                or DEFAULT in values:
            raise kconfig.ConfigError(f"{where}: one_at_a_time.keys.{key} must be a config key that is not an axis, "
                                      f"with a non-empty list of values, got {values!r}")


def all_axes(spec: dict) -> dict:
    """The axes every point has a value for: the spec's, then each one-at-a-time key (``DEFAULT`` first)."""
    extra = (spec.get("one_at_a_time") or {}).get("keys") or {}
    return {**spec["axes"], **{k: [DEFAULT, *v] for k, v in extra.items()}}


def points(spec: dict) -> list[dict]:
    """Every point that no skip rule removes: ``{axis: value}`` over ``all_axes``. The product of the axes, then
    (``one_at_a_time``) each extra key set to each of its values on its own, over the product of ``over`` (an
    axis ``over`` does not name keeps its first value), every other extra key left at ``DEFAULT``."""
    axes, extra = spec["axes"], spec.get("one_at_a_time") or {}
    keys = extra.get("keys") or {}
    rest = {k: DEFAULT for k in keys}
    candidates = [{**dict(zip(axes, values)), **rest} for values in itertools.product(*axes.values())]
    if keys:
        over = {a: extra["over"].get(a, [v[0]]) for a, v in axes.items()}
        for key, values in keys.items():
            for value in values:
                candidates += [{**dict(zip(over, vs)), **rest, key: value} for vs in itertools.product(*over.values())]
    return [p for p in candidates if not any(_matches(p, rule) for rule in spec.get("skip") or [])]


def is_main(spec: dict, point: dict) -> bool:
    """A point of the axes' product (every one-at-a-time key at ``DEFAULT``): what the heatmaps draw."""
    return all(point.get(k, DEFAULT) == DEFAULT for k in (spec.get("one_at_a_time") or {}).get("keys") or {})


def user_config(spec: dict, point: dict) -> dict:
    """The DeepSpeed config of one point as a user would write it (before the loop style sets anything): what
    ``gradkit check`` or ``gradkit bisect`` takes, with the point's ``loop``."""
    cfg = copy.deepcopy(spec["base"])
    for axis, value in point.items():
        if axis not in SPECIAL_AXES and value != DEFAULT:
            _set(cfg, axis, value)
    cfg["gradient_accumulation_steps"] = point.get("ga", cfg.get("gradient_accumulation_steps", 4))
    dtype = point.get("dtype")
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = {**cfg.get(dtype, {}), "enabled": True}
    return cfg


def point_case(spec: dict, point: dict) -> dict:
    """The ds_config case of one point (its config resolved the way ``gradkit check`` resolves one)."""
    cfg = user_config(spec, point)
    ga = cfg["gradient_accumulation_steps"]
    resolved = ds_config.resolve(cfg, spec["world_size"], ga=ga)
    loop = point.get("loop", "engine")
    model = point.get("model")
    (case,) = [c for c in ds_config.plan(resolved, (loop,), steps=spec.get("steps", ds_config.STEPS),
                                         model=None if model == DEFAULT else model)[0] if c["role"] == "measured"]
    case["point"] = point
    case["id"] = point_id(spec, point)
    case["name"] = case["id"]
    return case


def point_id(spec: dict, point: dict) -> str:
    key = json.dumps({"base": spec["base"], "world_size": spec["world_size"], "point": point,
                      "steps": spec.get("steps", ds_config.STEPS)}, sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def spec_key(spec: dict) -> str:
    """What a point's verdict depends on besides its point and release: a re-run with another spec never reuses it."""
    key = json.dumps({k: v for k, v in spec.items() if k not in ("stacks", "timeout_s")}, sort_keys=True, default=str)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def release_of(stack: dict) -> str:
    """The DeepSpeed release a stack resolves to (never "installed": an upgrade changes it)."""
    from kit.stacks import versions

    return stack.get("deepspeed") or versions.installed_version("deepspeed")


def _key(rec: dict) -> tuple:
    return rec.get("release"), rec.get("spec_key"), rec.get("id")


# ---------------------------------------------------------------------------------------------- running

def _control_key(case: dict) -> tuple:
    from kit import shapes

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
    from kit.commands import check

    rec["point"] = rec["config"].get("point")
    rec["id"] = rec["config"].get("id")
    ds_config.CHECK.annotate([rec])
    if rec["verdict"] == oracle.AFFECTED:
        rec["explained_by"], rec["explanation"] = check.explain(rec)
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
    have = current(records.load(path) if path.exists() else [], spec)
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
    """The records of this spec on the releases its stacks resolve to now, the newest one per point and release."""
    sk = spec_key(spec)
    wanted = {(release_of(st), json.dumps(st, sort_keys=True)) for st in spec["stacks"]}
    newest = {}
    for r in recs:
        if r.get("spec_key") == sk and (r.get("release"), json.dumps(r.get("stack"), sort_keys=True)) in wanted:
            newest[_key(r)] = r
    return list(newest.values())


# ---------------------------------------------------------------------------------------------- grouping

def groups(recs: list[dict], axes: dict, max_keys: int = 5) -> list[dict]:
    """The affected points of one stack, covered by the fewest, smallest conjunctions of ``axis in {values}``.

    Affected points are first split by what explains them (the known bug, else the hypothesis the step
    matches): one group never mixes two explanations. A conjunction is admissible for a label when every point
    it selects that ran (affected or not-affected) is affected with that label. Greedy set cover: at each step
    the admissible conjunction with the fewest conditions that covers the most still uncovered points (a
    search by size, pruned where a conjunction covers nothing new).
    Returns ``[{"when": {axis: [values]}, "count", "ids", "known_bug", ...}]``.
    """
    # Every point is in the universe; only the ones that ran (affected / not-affected) can make a condition
    # admissible, so a cannot-run or inconclusive point never widens one: a condition that selects it is refused.
    ran = [r for r in recs if r.get("point")]
    if not any(r["verdict"] == oracle.AFFECTED for r in ran):
        return []
    names = [a for a in axes if len({r["point"].get(a) for r in ran}) > 1]  # an axis with one value selects nothing
    literals = []  # per axis: [(values, bitset of the ran points it selects)]
    for axis in names:
        values = [v for v in axes[axis] if any(r["point"].get(axis) == v for r in ran)]
        lits = []
        for k in range(1, len(values)):
            for subset in itertools.combinations(values, k):
                lits.append((subset, sum(1 << i for i, r in enumerate(ran) if r["point"].get(axis) in subset)))
        literals.append(lits)
    out = []
    for label in sorted({_label(r) for r in ran if r["verdict"] == oracle.AFFECTED}):
        target = sum(1 << i for i, r in enumerate(ran) if r["verdict"] == oracle.AFFECTED and _label(r) == label)
        out += _cover(ran, names, literals, target, max_keys)
    return sorted(out, key=lambda g: -g["count"])


def _label(rec: dict) -> str:
    """What one group may hold: one known bug, or -- unexplained -- one shape of step (its fitted weights in
    words), never a catch-all."""
    return rec.get("explained_by") or f"unknown: {rec.get('shape') or rec.get('matches')}"


def _cover(ran: list[dict], names: list[str], literals: list, affected: int, max_keys: int) -> list[dict]:
    uncovered, out = affected, []
    while uncovered:
        best, level = None, [((), (1 << len(ran)) - 1, -1)]
        for size in range(max_keys + 1):
            following = []
            for combo, mask, last in level:
                new = mask & uncovered
                if not new:
                    continue
                if not mask & ~affected:  # admissible: every point it selects is affected
                    score = bin(new).count("1")
                    if best is None or score > best[0]:
                        best = (score, combo, mask)
                    continue
                if size < max_keys:
                    following += [(combo + ((names[a], values),), mask & m, a)
                                  for a in range(last + 1, len(names)) for values, m in literals[a] if mask & m & uncovered]
            if best is not None or not following:
                break
            level = _beam(following, uncovered, affected)
        if best is None:  # what no conjunction of max_keys conditions isolates: one group per point
            for i, r in enumerate(ran):
                if uncovered >> i & 1:
                    out.append(_group(ran, 1 << i, {a: [r["point"][a]] for a in names}))
            break
        _, combo, mask = best
        out.append(_group(ran, mask & uncovered, {axis: list(values) for axis, values in combo}))  # a partition
        uncovered &= ~mask
    return out


BEAM = 1000  # conjunctions kept from one size to the next (the search grows as values ** conditions)


def _beam(level: list, uncovered: int, affected: int) -> list:
    """One size's conjunctions, each selection once (the first, i.e. the one in axis order), and at most ``BEAM``:
    those that cover the most uncovered points per point they wrongly select (one that is not affected with this
    label). The search stays exact wherever a size has fewer distinct selections than that."""
    seen, out = set(), []
    for combo in level:
        if combo[1] not in seen:
            seen.add(combo[1])
            out.append(combo)
    if len(out) > BEAM:
        out.sort(key=lambda c: -bin(c[1] & uncovered).count("1") / (1 + bin(c[1] & ~affected).count("1")))
        out = out[:BEAM]
    return out


def _group(ran: list[dict], mask: int, when: dict) -> dict:
    members = [r for i, r in enumerate(ran) if mask >> i & 1]
    bugs = {r.get("explained_by") for r in members}
    ratios = [r["metrics"]["norm_ratio"] for r in members if r.get("metrics")]
    return {"when": when, "count": len(members), "ids": [r["id"] for r in members],
            "known_bug": bugs.pop() if len(bugs) == 1 and None not in bugs else None,
            "explained_by": sorted(str(b) for b in {r.get("explained_by") for r in members}),
            "matches": sorted({str(r.get("matches")) for r in members}),
            "shapes": sorted({str(r.get("shape")) for r in members}),
            "worst_steps": sorted({r.get("worst_step", 0) + 1 for r in members}),
            "ratio_range": [min(ratios), max(ratios)] if ratios else None, "example": members[0]["id"]}


def when_text(when: dict, short=lambda axis: axis) -> str:
    """A group's conditions in words; the one-at-a-time keys a condition holds at ``DEFAULT`` are said once, as
    "no other key set" (they are many, and mean: a point of the axes' product)."""
    defaults = [a for a, v in when.items() if v == [DEFAULT]]
    parts = [f"{short(axis)} = {values[0]}" if len(values) == 1 else
             f"{short(axis)} in {{{', '.join(map(str, values))}}}" for axis, values in when.items() if axis not in defaults]
    if defaults:
        parts.append("no other key set" if len(defaults) > 2 else " x ".join(f"{short(a)} = {DEFAULT}" for a in defaults))
    return " x ".join(parts) or "every point"


def describe(group: dict) -> str:
    name = group["known_bug"] or "UNKNOWN"
    lo, hi = group["ratio_range"] or (None, None)
    ratio = f"; ratio {lo:.3f}-{hi:.3f}" if lo is not None else ""
    step = ", ".join(group["matches"]) if group["known_bug"] else "; ".join(group.get("shapes") or group["matches"])
    return f"[{name}] {when_text(group['when'])}: {group['count']} configs{ratio}; the step is {step}"


def reproduce(spec: dict, stack: dict, mine: list[dict], gs: list[dict], out: Path, jobs: int = JOBS) -> None:
    """For each unknown group: a standalone script next to the results, run to check that it reproduces (``jobs``
    scripts at a time), and its upstream report (``report_<...>.md``, ``kit.commands.report``)."""
    from concurrent.futures import ThreadPoolExecutor

    from kit.commands import repro, report as upstream

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
        for done in [pool.submit(one, k, g) for k, g in enumerate(gs) if not g["known_bug"]]:
            done.result()


def separate(recs: list[dict]) -> list[dict]:
    """A point whose step ties between named hypotheses (at GA 2 "last / N" is "all but the first") names no bug
    by itself; the same config at a GA >= 3 (same stack, every other axis equal) separates them: where that
    point is affected, explained, and is one of the tied names, this point is explained by the same bug, said so.
    A tie with no such point stays a tie (its own group)."""
    from kit.commands import check

    def key(r):
        return json.dumps([r.get("stack"), {k: v for k, v in (r.get("point") or {}).items() if k != "ga"}],
                          sort_keys=True)

    by: dict = {}
    for r in recs:
        if r["verdict"] == oracle.AFFECTED and r.get("explained_by") and r["ga"] >= check.SEPARATING_GA - 1:
            by.setdefault(key(r), []).append(r)
    for r in recs:
        names = r.get("ties") or []
        if r["verdict"] != oracle.AFFECTED or not names or r.get("explained_by"):
            continue
        sib = next((s for s in sorted(by.get(key(r), []), key=lambda s: s["ga"]) if s["matches"] in names), None)
        if sib:
            r["explained_by"], r["separated_by"] = sib["explained_by"], sib["id"]
            r["explanation"] = (f"{sib['explanation']} (at GA {r['ga']} the step is {r['matches']}; the same config "
                                f"at GA {sib['ga']} separates them: '{sib['matches']}')")
    return recs


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


def violations(spec: dict, recs: list[dict], summary: dict) -> list[str]:
    """What notebook 06 asserts (empty: all hold).

    1. every point of the spec has one record per stack, and no record is ``inconclusive`` because of its control
       (every control of every world matched the reference; a point whose own detection floor is above one
       micro-batch's weight is inconclusive, said so, and not a violation);
    2. the upstream table's own prediction holds: wherever it says B3 hits (the report's configuration: fp32,
       the manual loop, ZeRO-1/2's ``DeepSpeedZeroOptimizer``, N > 1, no offload, on a release it pins as
       affected) the point is affected;
    3. every group of known-bug points is explained by that bug at every point, and every unknown group's
       standalone reproduction reproduced, with its upstream report and config written beside it;
    4. the kit's own findings hold where the table pins them: every ``no_grad_step`` point on ZeRO-3 is B6 (its
       head is stepped at step 3 with no gradient), every ``conditional`` point of DeepSpeed's own loop with
       optimizer offload on ZeRO-2/3 is B7 (the experts the last micro-batch skips get nothing), wherever they ran.
    """
    from kit.judge import expectations

    bad = []
    if recs and all(r["verdict"] == oracle.CANNOT_RUN for r in recs):
        bad.append(f"every one of the {len(recs)} points is cannot-run: the sweep measured nothing "
                   f"(first reason: {recs[0]['reason'][:200]})")
    want = {(json.dumps(st, sort_keys=True), point_id(spec, p)) for st in spec["stacks"] for p in points(spec)}
    have = [(json.dumps(r["stack"], sort_keys=True), r["id"]) for r in recs]
    if sorted(set(have)) != sorted(want) or len(have) != len(set(have)):
        bad.append(f"{len(want)} points x stacks in the spec, {len(set(have))} distinct records ({len(have)} in all)")
    # inconclusive because a control was off is the harness's fault; because the measurement's own floor is above
    # one micro-batch's weight (bf16 weights read where the masters misreport), it is the honest answer
    bad += [f"{r['id']} {r['point']}: inconclusive: {r['reason'][:200]}" for r in recs
            if r["verdict"] == oracle.INCONCLUSIVE and not r.get("below_floor")]
    for r in recs:
        p = r.get("point") or {}
        offload = p.get("zero_optimization.offload_optimizer.device", "none")
        if (p.get("loop") == "manual" and r.get("optimizer") == "DeepSpeedZeroOptimizer" and r["ga"] > 1
                and offload == "none" and r["dtype"] == "fp32" and r["verdict"] != oracle.CANNOT_RUN
                and expectations.expected("B3", r.get("versions") or {}, "manual", r.get("zero_stage")) == oracle.AFFECTED
                and r["verdict"] != oracle.AFFECTED):
            bad.append(f"{r['id']} {p}: the upstream table says B3 hits here, measured {r['verdict']}")
    for r in recs:
        p, ran = r.get("point") or {}, r["verdict"] in (oracle.AFFECTED, oracle.NOT_AFFECTED)
        offload = p.get("zero_optimization.offload_optimizer.device", "none")
        for bug, hit in (("B6", r.get("zero_stage") == 3 and p.get("model") == "no_grad_step"),
                         ("B7", r.get("zero_stage") in (2, 3) and offload == "cpu" and p.get("loop") == "engine"
                          and p.get("model") == "conditional")):
            if hit and ran and expectations.expected(bug, r.get("versions") or {}) == oracle.AFFECTED \
                    and r.get("explained_by") != bug:
                bad.append(f"{r['id']} {p}: the table pins {bug} here, measured {r['verdict']} "
                           f"({r.get('explained_by') or r.get('matches')})")
    for s in summary["stacks"]:
        for g in s["groups"]:
            if g["known_bug"] and g["explained_by"] != [g["known_bug"]]:
                bad.append(f"{describe(g)}: not every point is explained by {g['known_bug']}")
            if not g["known_bug"] and not (g.get("repro") or {}).get("reproduced"):
                bad.append(f"{describe(g)}: its standalone reproduction did not reproduce: {g.get('repro')}")
            if g.get("repro") and not (g.get("report") and g.get("config")):
                bad.append(f"{describe(g)}: no upstream report or config was written beside its reproduction")
    return bad


NOTEBOOK_PARAMETERS = ("SPEC", "SWEEP_DIR", "STACKS", "RESULTS_DIR", "INTERACTIVE")


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 06, by its name there (what the notebook and ``kit.notebooks.runall`` call first);
    returns the ``(probe, stack)`` pairs its worlds will run (``kit.stacks.prefetch``)."""
    if not isinstance(p["SWEEP_DIR"], str):
        raise kconfig.ConfigError(f"SWEEP_DIR must be a folder name or \"\", got {p['SWEEP_DIR']!r}")
    if not isinstance(p["STACKS"], list) or not all(isinstance(s, dict) for s in p["STACKS"]):
        raise kconfig.ConfigError(f"STACKS must be a list of mappings like {{\"deepspeed\": \"0.18.8\"}} (empty: the "
                                  f"spec's), got {p['STACKS']!r}")
    return [(ds_config.CHECK, stack) for stack in notebook_spec(p)["stacks"]]


def notebook_spec(p: dict) -> dict:
    """The spec notebook 06 runs: ``SPEC``'s file, its stacks replaced by ``STACKS`` when given."""
    spec = load_spec(p["SPEC"])
    if p["STACKS"]:
        spec = check_spec({**spec, "stacks": p["STACKS"]}, str(p["SPEC"]))
    return spec


def steps_text(rec: dict) -> str:
    """A point's steps in one line: each step's ratio (``*``: off), and which one is the worst."""
    from kit.judge.tables import per_step

    if not rec.get("steps"):
        return "no step judged"
    return f"ratio per step {per_step(rec)} (* off); worst: step {rec.get('worst_step', 0) + 1}"


def one_at_a_time_table(spec: dict, recs: list[dict]) -> str:
    """Per one-at-a-time key and value, per stack: how many points of each verdict, and DeepSpeed's reason for
    the first that could not run (markdown)."""
    from kit.judge.tables import markdown_table

    keys = (spec.get("one_at_a_time") or {}).get("keys") or {}
    rows = []
    for key, values in keys.items():
        for value in values:
            for st in spec["stacks"]:
                mine = [r for r in recs if r["stack"] == st and (r.get("point") or {}).get(key) == value]
                if not mine:
                    continue
                counts = {v: sum(r["verdict"] == v for r in mine) for v in oracle.VERDICTS}
                refused = next((r for r in mine if r["verdict"] == oracle.CANNOT_RUN), None)
                rows.append({"key = value": f"`{key}` = {json.dumps(value)}", "DeepSpeed": release_of(st),
                             **{v: counts[v] for v in oracle.VERDICTS},
                             "why a point could not run": (refused["reason"].replace("|", "/")[:160] if refused else "")})
    return markdown_table(rows, list(rows[0])) if rows else "no one-at-a-time keys in this spec"


def model_table(spec: dict, recs: list[dict]) -> str:
    """Per model shape other than the MLP, ZeRO stage, loop and optimizer offload: each precision's verdict per
    release, as the known bug that explains it (``B6``), ``ok`` (not affected), ``?`` (affected, unexplained),
    ``x`` (cannot run), ``~`` (inconclusive). Markdown; what a reader scans for the parts some micro-batches miss."""
    from kit.judge.tables import markdown_table

    def cell(r):
        if r is None:
            return "-"
        return {oracle.NOT_AFFECTED: "ok", oracle.CANNOT_RUN: "x", oracle.INCONCLUSIVE: "~"}.get(
            r["verdict"], r.get("explained_by") or "?")

    shaped = [r for r in recs if (r.get("point") or {}).get("model") not in (None, DEFAULT, "mlp")]
    keys = sorted({(r["point"]["model"], r["zero_stage"], r["point"].get("loop", "engine"),
                    str(r["point"].get("zero_optimization.offload_optimizer.device", "none"))) for r in shaped},
                  key=lambda k: (list(spec["axes"].get("model", [])).index(k[0]) if k[0] in spec["axes"].get("model", [])
                                 else 99, k[1:]))
    dtypes = sorted({r["dtype"] for r in shaped})
    rows = []
    for model, stage, loop, offload in keys:
        row = {"model": model, "ZeRO": stage, "loop": loop, "offload": offload}
        for st in spec["stacks"]:
            mine = {r["dtype"]: r for r in shaped if r["stack"] == st and (r["point"]["model"], r["zero_stage"],
                    r["point"].get("loop", "engine"), str(r["point"].get("zero_optimization.offload_optimizer.device",
                                                                           "none"))) == (model, stage, loop, offload)}
            row[f"DeepSpeed {release_of(st)}"] = " / ".join(cell(mine.get(d)) for d in dtypes)
        rows.append(row)
    if not rows:
        return "no model shape other than the MLP in this spec"
    return f"cells: {' / '.join(dtypes)}\n\n" + markdown_table(rows, list(rows[0]))


def table(summary: dict, command: str) -> str:
    """The README's sweep table: per stack, its counts; per known bug one row (its largest group's conditions, how
    many more groups it has: notebook 06 lists each); then every unknown group, one row each."""
    from kit.judge.tables import markdown_table

    def short(a):
        return a.split(".")[-1] if not a.endswith("device") else "offload"

    rows = []
    for s in summary["stacks"]:
        counts = ", ".join(f"{n} {v}" for v, n in s["counts"].items() if n)
        rows.append({"DeepSpeed": s["deepspeed"], "group (smallest key set)": f"*{s['configs']} configs: {counts}*",
                     "configs": "", "ratio": "", "the step is": "", "explained by": ""})
        for bug in sorted({g["known_bug"] for g in s["groups"] if g["known_bug"]}):
            mine = [g for g in s["groups"] if g["known_bug"] == bug]  # largest first (``groups`` sorts them)
            ratios = [x for g in mine for x in (g["ratio_range"] or [])]
            more = f" (+ {len(mine) - 1} smaller group{'s' if len(mine) > 2 else ''})" if len(mine) > 1 else ""
            rows.append({"DeepSpeed": s["deepspeed"],
                         "group (smallest key set)": when_text(mine[0]["when"], short).replace(" x ", " × ") + more,
                         "configs": sum(g["count"] for g in mine),
                         "ratio": f"{min(ratios):.3f}–{max(ratios):.3f}" if ratios else "",
                         "the step is": ", ".join(sorted({m for g in mine for m in g["matches"]})), "explained by": bug})
        for g in s["groups"]:
            if g["known_bug"]:
                continue
            lo, hi = g["ratio_range"] or (0, 0)
            repro = g.get("repro")
            rows.append({"DeepSpeed": s["deepspeed"], "group (smallest key set)": when_text(g["when"], short).replace(
                " x ", " × "), "configs": g["count"], "ratio": f"{lo:.3g}–{hi:.3g}",
                "the step is": "; ".join(g.get("shapes") or g["matches"]),
                "explained by": f"**unknown**: `{repro['script']}` "
                                f"{'reproduces' if repro['reproduced'] else 'does not reproduce'}" if repro else "**unknown**"})
    return (f"<sub>generated by `{command}` ({summary.get('wall_s', '?')} s)</sub>\n\n"
            + markdown_table(rows, list(rows[0])) + "\n")


def main(argv=None) -> int:
    p = kconfig.Parser(prog="python -m kit.commands.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("spec")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--deepspeed", help="comma list of DeepSpeed releases to sweep instead of the spec's stacks "
                                       "(installed = the installed one), e.g. 0.18.6,installed")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--retry-cannot-run", action="store_true", help="run the points that were cannot-run again")
    p.add_argument("--jobs", type=int, default=JOBS, help=f"worlds at a time (default {JOBS})")
    p.add_argument("--readme", help="replace this file's <!-- gradkit:table SWEEP --> block with the groups")
    a = p.parse_args(argv)
    spec = load_spec(a.spec)
    if a.deepspeed:
        spec = check_spec({**spec, "stacks": runner.stacks_of([v.strip() for v in a.deepspeed.split(",") if v.strip()])},
                          a.spec)
    t0 = time.time()
    recs = run(spec, a.out, progress=not a.no_progress, retry=a.retry_cannot_run, jobs=a.jobs)
    out = kconfig.repo_path(a.out)
    summary = summarise(spec, recs, out)
    summary["wall_s"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for s in summary["stacks"]:
        print(f"stack {runner.stack_label(s['stack'])} (DeepSpeed {s['deepspeed']}): {s['configs']} configs, "
              + ", ".join(f"{n} {v}" for v, n in s["counts"].items() if n))
        for g in s["groups"]:
            print("  " + describe(g))
            if g.get("repro"):
                print(f"    {g['repro']['script']}: {'reproduces' if g['repro']['reproduced'] else 'does NOT reproduce'} "
                      f"(exit {g['repro']['exit']}): {g['repro']['output'].splitlines()[0][:200]}")
    print(f"{len(recs)} records in {out / 'records.jsonl'}; {summary['wall_s']} s")
    if a.readme:
        from kit.notebooks import readme_tables as tables

        command = "python -m kit.commands.sweep " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
        path = kconfig.repo_path(a.readme)
        text, done = tables.fill(path.read_text(), {"SWEEP": table(summary, command)})
        path.write_text(text)
        print(f"{path}: {'replaced the sweep table' if done else 'has no <!-- gradkit:table SWEEP --> block'}")
    return 0


if __name__ == "__main__":
    kconfig.run_cli(main)
