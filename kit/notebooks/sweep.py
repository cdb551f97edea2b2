"""Notebook 06: its parameters (``check_notebook``, ``notebook_spec``), what it runs and tabulates (the sweep's own
functions, ``gradkit.commands.sweep``, imported here so that the notebook calls this one module) and what it asserts
about a sweep (``violations``: every group named or reproduced, every known bug's points where
``kit/judge/expectations.py`` puts them)."""
from __future__ import annotations

import json

from gradkit import config as kconfig
from gradkit.commands.check import known as check_known
from gradkit.commands.sweep.grouping import describe
from gradkit.commands.sweep.run import run, summarise  # noqa: F401 - what notebook 06 runs
from gradkit.commands.sweep.spec import check_spec, is_main, load_spec, point_id, points  # noqa: F401 - is_main: 06's
from gradkit.commands.sweep.tables import model_table, one_at_a_time_table, steps_text  # noqa: F401 - 06's tables
from gradkit.judge import expectations, oracle
from gradkit.probes import ds_config


def violations(spec: dict, recs: list[dict], summary: dict) -> list[str]:
    """What notebook 06 asserts (empty: all hold).

    1. every point of the spec has one record per stack, and no record is ``inconclusive`` because of its control
       (every control of every world matched the reference; a point whose own detection floor is above one
       micro-batch's weight is inconclusive, said so, and not a violation);
    2. the upstream table's own prediction holds: wherever it says B3 hits (the report's configuration: fp32,
       the manual loop, ZeRO-1/2's ``DeepSpeedZeroOptimizer``, N > 1, no offload, on a release it pins as
       affected) the point is affected;
    3. every group of known-bug points is explained by that bug at every point, and every unknown group's (not a
       tie's) standalone reproduction reproduced, with its upstream report and config written beside it;
    4. the kit's own findings hold where the table pins them: every ``no_grad_step`` point on ZeRO-3 is B6 (its
       head is stepped at step 3 with no gradient), every ``conditional`` point of DeepSpeed's own loop with
       optimizer offload on ZeRO-2/3 is B7 (the experts the last micro-batch skips get nothing), wherever they ran.
    """
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
        # the pinned bug; or another one expected here whose own step is another (fp16: B10's half, the worse); or
        # a tie with it (with offload B7 is expected at ZeRO-3 too and leaves B6's step: said, check_known.tied)
        for bug, hit in (("B6", r.get("zero_stage") == 3 and p.get("model") == "no_grad_step"),
                         ("B7", r.get("zero_stage") in (2, 3) and offload == "cpu" and p.get("loop") == "engine"
                          and p.get("model") == "conditional")):
            if hit and ran and expectations.expected(bug, r.get("versions") or {}) == oracle.AFFECTED \
                    and r.get("explained_by") != bug and bug not in _tied(r) and not (
                        r.get("explained_by") in _expected(r)
                        and expectations.KNOWN[r["explained_by"]].explains[1] != expectations.KNOWN[bug].explains[1]):
                bad.append(f"{r['id']} {p}: the table pins {bug} here, measured {r['verdict']} "
                           f"({r.get('explained_by') or r.get('matches')})")
    for s in summary["stacks"]:
        for g in s["groups"]:
            if g["known_bug"] and g["explained_by"] != [g["known_bug"]]:
                bad.append(f"{describe(g)}: not every point is explained by {g['known_bug']}")
            # a tie of known bugs (or of named steps) is no new finding: it needs no reproduction of its own
            if not g["known_bug"] and not g.get("tie") and not (g.get("repro") or {}).get("reproduced"):
                bad.append(f"{describe(g)}: its standalone reproduction did not reproduce: {g.get('repro')}")
            if g.get("repro") and not (g.get("report") and g.get("config")):
                bad.append(f"{describe(g)}: no upstream report or config was written beside its reproduction")
    return bad


def _expected(rec: dict) -> list[str]:
    """The known bugs the check expects on this record's config, release and model (none for a record without one)."""
    return check_known.candidates(rec) if rec.get("config") else []


def _tied(rec: dict) -> list[str]:
    return check_known.tied(rec) if rec.get("config") else []


NOTEBOOK_PARAMETERS = ("SPEC", "SWEEP_DIR", "STACKS", "RESULTS_DIR", "INTERACTIVE")


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 06, by its name there (what the notebook and ``gradkit.notebooks.runall`` call
    first); returns the ``(probe, stack)`` pairs its worlds will run (``gradkit.stacks.prefetch``)."""
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
