"""Which known bug explains a checked loop: the bugs a record's configuration, release and model could show
(``candidates``), the one whose hypothesis its step matches (``explain``), and, for a loop style the check did not
run, what the bug table expects there (``if_run``), said without measuring it.

Every rule reads the bug table (``gradkit.judge.expectations``); nothing here launches anything.
"""
from __future__ import annotations

from gradkit import shapes
from gradkit.judge import expectations, naming, oracle
from gradkit.probes.ds_resolve import dynamic_scale
from gradkit.stacks.versions import version_key

# the loop styles a user's own training loop would be: what they do, in one phrase each
OWN_LOOPS = {"manual": "your own loop calls backward() several times per step() with GA 1 in the config",
             "unmanaged": "your own loop does that with \"managed_gradient_accumulation\": false"}


# the bugs that remake whatever step another bug made: (the suffix of the step they leave on top of another, their own
# step alone, what they do in words)
ON_TOP = ((naming.GROWN, naming.SCALE_GREW, "the loss scale grew before the unscale: x old / new"),
          (naming.LOCAL, naming.OWN_PARTITION, "no all-reduce: each rank's partition from its own micro-batches"))


def expected_here(bug: str, versions: dict, **config) -> bool:
    """Upstream's table expects ``bug`` on this release: it pins it affected, or the release is newer than the
    table and no release fixes the bug (a bug with no fix stays expected)."""
    want = expectations.expected(bug, versions, **config)
    if want is not None:
        return want == oracle.AFFECTED
    k = expectations.KNOWN[bug]
    v = (versions or {}).get(k.package)
    return bool(v) and k.fixed_in is None and \
        version_key(v) > version_key(k.newest_pinned)


def reaches_unevenly(rec: dict) -> bool:
    """The record's model has a parameter that some micro-batch or step does not reach (a routed expert, a head
    used every other step, the user's own architecture, whose routing the kit does not know): only such a model
    can show B6 and B7. The MLP and the tied model reach every parameter from every micro-batch."""
    cfg = rec.get("config") or {}
    if cfg.get("model_config"):
        return True
    name = cfg.get("model") or shapes.DEFAULT
    return name in shapes.registry() and shapes.get(name).unused_parameters


def ruled_out(rec: dict) -> dict:
    """``{bug: why}``: the bugs a key of the config that ran rules out (that bug's own fix is in the config)."""
    ds = (rec.get("config") or {}).get("ds_config") or {}
    version = (rec.get("versions") or {}).get("deepspeed")
    out = {}
    if ds.get("managed_gradient_accumulation") is False and version and \
            version_key(version) >= version_key(expectations.UNMANAGED_SINCE):
        out["B3"] = f"\"managed_gradient_accumulation\": false (honoured from {expectations.UNMANAGED_SINCE})"
    if (ds.get("bf16") or {}).get("immediate_grad_update"):
        out["B4"] = "\"bf16.immediate_grad_update\": true"
    return out


def candidates(rec: dict) -> list[str]:
    """The known bugs whose configuration, release and model this record has (before looking at its step)."""
    versions = rec.get("versions") or {}
    stage, loop = rec.get("zero_stage"), rec["config"]["loop"]
    uneven = reaches_unevenly(rec)
    out = []
    if loop in ("manual", "unmanaged") and stage in (1, 2) and rec.get("optimizer") == "DeepSpeedZeroOptimizer" \
            and expected_here("B3", versions, case="manual", zero_stage=stage):
        out.append("B3")
    if rec.get("optimizer") == "BF16_Optimizer" and expected_here("B4", versions):
        out.append("B4")
    if rec.get("optimizer") == "FP16_UnfusedOptimizer" and expected_here("B9", versions):
        out.append("B9")
    if dynamic_scale(rec["config"].get("ds_config") or {}) and expected_here("B10", versions):
        out.append("B10")
    zero = (rec["config"].get("ds_config") or {}).get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device") == "cpu" or zero.get("cpu_offload") is True
    if (stage in (1, 2) and offload and rec["ga"] > 2 and loop in ("engine", "boundary")
            and expected_here("B5", versions)):
        out.append("B5")
    if stage == 3 and uneven and expected_here("B6", versions):
        out.append("B6")
    # B7 shows where the boundary micro-batch misses a part: on a model some micro-batches do not reach
    if offload and stage in (1, 2, 3) and uneven and expected_here("B7", versions):
        out.append("B7")
    # B11: ZeRO-1/2's manual loop with offload, where every backward() is a boundary and the CPU accumulator is never
    # reset (0.19.8, the MLP: the first micro-batch lost, the previous step's update again; ZeRO-3's manual loop exact)
    if offload and stage in (1, 2) and loop == "manual" and expected_here("B11", versions):
        out.append("B11")
    if stage == 2 and not offload and rec["ga"] > 1 and loop in ("engine", "boundary") \
            and expected_here("B12", versions):
        out.append("B12")
    # B8: the CPU accelerator's fallback reduce; offload forces contiguous gradients on, so it never runs there
    if stage in (1, 2) and zero.get("contiguous_gradients") is False and rec.get("device", "cpu") == "cpu" \
            and not offload and expected_here("B8", versions):
        out.append("B8")
    # B13: ZeRO-1 accumulating in another dtype than the parameters' (``param.grad_accum``) reduces a copy of it
    accum = ((rec["config"].get("ds_config") or {}).get("data_types") or {}).get("grad_accum_dtype")
    if stage == 1 and rec.get("optimizer") == "DeepSpeedZeroOptimizer" and accum and accum != rec.get("dtype") \
            and expected_here("B13", versions):
        out.append("B13")
    return [b for b in out if b not in ruled_out(rec)]


def leaves(bug: str, step) -> bool:
    """``bug`` leaves the named step ``step`` (its hypothesis, or one of them)."""
    hyp = expectations.KNOWN[bug].explains[1]
    return step == hyp or isinstance(hyp, tuple) and step in hyp


def tied(rec: dict) -> list[str]:
    """The known bugs expected here that each leave the record's very step, where there are two or more (a tie the
    measurement cannot settle: ``explain`` names none of them); [] otherwise."""
    found = [b for b in candidates(rec) if leaves(b, rec.get("matches"))]
    return found if len(found) > 1 else []


def explain(rec: dict) -> tuple[str | None, str]:
    """``(bug id, sentence)`` for an affected loop: the known bug whose configuration, release and hypothesis
    all match, or ``(None, "not explained by any known bug")``. A step two hypotheses explain equally
    ("ambiguous between ...") names no bug: the measurement cannot tell them apart."""
    matches, shape = rec.get("matches"), rec.get("shape")
    found = candidates(rec)
    said = f" (the step is: {shape})" if shape else ""
    direct = [b for b in found if leaves(b, matches)]
    if len(direct) > 1:  # two bugs expected here leave this very step: the measurement cannot tell which
        return None, (f"not explained by one known bug: {' and '.join(direct)} are expected here and each leaves "
                      f"this step ('{matches}'){said}")
    if direct:
        k = expectations.KNOWN[direct[0]]
        return direct[0], f"{direct[0]} ({k.report}): {k.explains[0]}; the step is '{matches}'"
    # another bug's step, then a bug that remakes any step on top of it (B10: the scale grew, x old / new; B8: no
    # all-reduce, each rank's partition its own): named by the bug under it, the one on top said beside it
    for suffix, own_step, how in ON_TOP:
        base = naming.grown_base(matches, suffix)
        tops = [b for b in found if expectations.KNOWN[b].explains[1] == own_step]
        under = [b for b in found if base and b not in tops and leaves(b, base)]
        if tops and len(under) == 1:  # several bugs on top that each remake it so: said, none picked
            k = expectations.KNOWN[under[0]]
            return under[0], (f"{under[0]} ({k.report}): {k.explains[0]}; and {' or '.join(tops)} on this step "
                              f"({how}{'; each expected here' if len(tops) > 1 else ''}); the step is '{matches}'")
    if found:
        return None, (f"not explained by any known bug: {', '.join(found)} is expected here, but the step is "
                      f"'{matches}', not what {found[0]} leaves{said}")
    return None, "not explained by any known bug" + (f" (the step is '{matches}'{'; ' + shape if shape else ''})"
                                                    if matches not in (None, "none") else said or
                                                    " (no named hypothesis matches the step)")


def if_run(rec: dict, loop: str) -> str:
    """One sentence on a loop style the check did not run (``manual`` / ``unmanaged``), from the bug table and a
    measured record of the same config (its release, stage, optimizer, model): what it would give, unmeasured."""
    what = {**rec, "config": {**(rec.get("config") or {}), "loop": loop,
                              "ds_config": {**((rec.get("config") or {}).get("ds_config") or {}),
                                            **({"managed_gradient_accumulation": False} if loop == "unmanaged"
                                               else {})}}}
    version = (rec.get("versions") or {}).get("deepspeed", "?")
    bugs = [b for b in candidates(what) if b == "B3"]
    head = f"if {OWN_LOOPS[loop]}: "
    if bugs:
        k = expectations.KNOWN["B3"]
        return head + f"B3 is expected on DeepSpeed {version} ({k.report}); fix: {k.explains[2]}"
    why = ruled_out(what).get("B3")
    return head + (f"B3 is ruled out by {why}" if why else f"no known bug is expected on DeepSpeed {version}")
