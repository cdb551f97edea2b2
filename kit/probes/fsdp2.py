"""FSDP2: ``torch.distributed.fsdp.fully_shard`` accumulation -- the same oracle, no DeepSpeed.

Each parameter is sharded over the ranks (a ``DTensor``); a backward with gradient sync on reduce-scatters the
gradient of every FSDP unit into each rank's shard. Accumulation either turns the sync off
(``set_requires_gradient_sync(False)``) until the last micro-batch (FSDP keeps the unsharded gradients, in
``reduce_dtype`` under mixed precision) or reduce-scatters after every micro-batch and sums the shards. The
effective gradient is read from the full parameters after the step (``DTensor.full_tensor()``, plain collectives).

=============  ==========================================================================  ==========
case           loop                                                                        role
=============  ==========================================================================  ==========
sync_last      sync off on the first GA-1 micro-batches, on for the last                    measured
sync_every     a reduce-scatter after every micro-batch                                    measured
sum_not_mean   ``sync_last`` without ``/ GA`` (a loop bug: GA x the gradient)               comparison
sync_kept_off  sync never turned back on (a loop bug: nothing is reduced, nothing steps)    comparison
control        the bare module: local accumulation, one ``all_reduce`` of every grad / W   control
=============  ==========================================================================  ==========

Each FSDP case runs under ``SETTINGS`` (``setting`` in its record): resharding after forward or not, fp32 or
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 | bf16)``, one FSDP unit per layer (the usual wrap) or
the whole model as one unit. A failure FSDP raises itself (e.g. "FSDP reduce-scatter expects uniform gradient
dtype", pytorch/pytorch#196996) is ``cannot-run`` with FSDP's sentence, never a verdict.

What its ranks run is ``gradkit.probes.ranks.fsdp2``.
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit.judge import oracle
from gradkit.probes import ddp_no_sync, runner, shared
from gradkit.probes.ranks.fsdp2 import SETTINGS

BUG = "FSDP2"
LOOPS = {"sync_last": "measured", "sync_every": "measured", "sum_not_mean": "comparison",
         "sync_kept_off": "comparison"}
# which loops run under which settings: the correct loops under every one, the loop bugs under plain fp32
LOOP_SETTINGS = {"sync_last": tuple(SETTINGS), "sync_every": ("fp32", "bf16 / fp32 reduce"),
                 "sum_not_mean": ("fp32",), "sync_kept_off": ("fp32",)}


def setting_name(reshard: bool, param: str, reduce: str, units: str) -> str:
    """The name of a setting: its ``SETTINGS`` key where it has one, else the same words put together."""
    spec = (reshard, param, reduce, units)
    for name, known in SETTINGS.items():
        if known == spec:
            return name
    return (f"{param}" + (f" / {reduce} reduce" if param != "fp32" else "") + ("" if reshard else " no-reshard")
            + (", one unit" if units == "one" else ""))


def plan(ga_values, micro_batch: int = 4, hidden: int = 32, seed: int = 0, models=("mlp",), settings=None,
         loops=None) -> list[dict]:
    """The control and every loop under its settings (``LOOP_SETTINGS``; ``settings`` / ``loops`` narrow them)."""
    out = []
    for model in models:
        for ga in ga_values:
            common = {"ga": ga, "micro_batch": micro_batch, "hidden": hidden, "seed": seed, "model": model}
            out.append({"name": "control", "role": "control", "dtype": "fp32", "setting": "plain torch", **common})
            for loop, role in LOOPS.items():
                if loops is not None and loop not in loops:
                    continue
                for s in LOOP_SETTINGS[loop]:
                    if settings is None or s in settings:
                        out.append({"name": loop, "role": role, "dtype": SETTINGS[s][1], "setting": s,
                                    "fsdp": list(SETTINGS[s]), **common})
    return out


def validate(world_sizes, ga_values, device: str, timeout_s: float, models=("mlp",), settings=None) -> None:
    ddp_no_sync.validate(world_sizes, ga_values, device, timeout_s, models)
    for s in settings or ():
        if s not in SETTINGS:
            raise kconfig.ConfigError(f"unknown FSDP2 setting {s!r}; the kit knows {list(SETTINGS)}")


def run(world_sizes=(2,), ga_values=(1, 4), micro_batch: int = 4, hidden: int = 32, seed: int = 0,
        device: str = "cpu", timeout_s: float = kconfig.DEFAULT_TIMEOUT_S, stacks=({},), models=("mlp",),
        settings=None, loops=None) -> list[dict]:
    """Every loop under its settings at every GA on every model shape, one plain-torch world per world size; each
    judged against the ``control`` of its GA and shape."""
    validate(world_sizes, ga_values, device, timeout_s, models, settings)
    return runner.run(PROBE, plan(ga_values, micro_batch, hidden, seed, models, settings, loops), list(stacks),
                      world_sizes, device, timeout_s, meta={"seed": seed, "micro_batch": micro_batch, "hidden": hidden})


def violations(recs: list[dict]) -> list[str]:
    """What the notebook asserts of FSDP2: the control matches the reference, no rank imported DeepSpeed, the loop
    bugs are seen (``sum_not_mean`` affected with ratio GA where GA > 1; ``sync_kept_off`` affected: nothing
    applied), and a failure is a failure: an FSDP case that raised is ``cannot-run`` with its error."""
    bad = []
    for r in recs:
        where = f"W={r['world_size']} GA={r['ga']} {r['config'].get('model', 'mlp')} {r['case']} [{r['config'].get('setting')}]"
        if r["role"] == "control" and r["verdict"] != oracle.NOT_AFFECTED:
            bad.append(f"{where}: the control is {r['verdict']}: {r['reason']}")
        if r.get("imported_deepspeed"):
            bad.append(f"{where}: a rank imported DeepSpeed")
        if r.get("error") and r["verdict"] != oracle.CANNOT_RUN:
            bad.append(f"{where}: it raised but its verdict is {r['verdict']}")
        if r["case"] == "sum_not_mean" and r["ga"] > 1 and not r.get("error") and (
                r["verdict"] != oracle.AFFECTED or abs(r["metrics"]["norm_ratio"] / r["ga"] - 1) > 1e-3):
            bad.append(f"{where}: the summed loop is {r['verdict']} (ratio {(r['metrics'] or {}).get('norm_ratio')}, "
                       f"GA expected)")
        if r["case"] == "sync_kept_off" and not r.get("error") and r["verdict"] != oracle.AFFECTED:
            bad.append(f"{where}: a loop that never syncs is {r['verdict']}")
    return bad


def annotate(rec: dict) -> dict:
    """Its shape and setting at the top of the record (the notebook's rows), each step named."""
    return shared.annotate(rec, setting=rec["config"].get("setting"))


PROBE = shared.torch_path_probe(
    id=BUG, title="torch FSDP2 (fully_shard), gradient-sync-off accumulation (no DeepSpeed)", module="fsdp2",
    measured_case="sync_last",
    ratio_meaning="effective / reference gradient of the set_requires_gradient_sync(False) step",
    advice="the FSDP2 step is off the reference on this torch: compare its settings in notebook 07 (sync every "
           "micro-batch, fp32 vs bf16, one unit) and report it to PyTorch with those numbers",
    run=run,
    quick_plan=lambda w: dict(world_sizes=(w,), ga_values=(4,), settings=("fp32", "bf16 / fp32 reduce")),
    explorer_kwargs=lambda sel, device, timeout_s: {**shared.explorer_kwargs(sel, device, timeout_s),
                                                    "settings": ("fp32",)},
    packages=("torch",), typical_s=15.0, violations=violations, order=11, annotate_record=annotate)
