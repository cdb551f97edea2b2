"""The features of shipped DeepSpeed configs that the check runs differently or cannot judge, each with its
sentence (``apply``, called by ``gradkit.probes.ds_resolve.resolve``).

Each feature is one of three kinds, said in the check's ``as run:`` lines:

- *kept*: it runs as the user's config asks;
- *replaced*: the kit runs something that accumulates the same way, and says what and why (a ``compile`` block,
  NVMe offload, ``fp16.auto_cast`` where fp16 is off);
- *refused*: the kit cannot judge it; the sentence says why and what would make it judgeable (an optimizer that
  communicates its own compressed update, ZenFlow, AutoTP groups the world size does not hold).

AutoTP (``tensor_parallel.autotp_size``) is judged: on a model with a tensor-parallel policy (the user's ``--model``,
else a tiny Llama: ``gradkit.commands.check.one.prepare``), the ranks of a group feeding the same micro-batches.

A refused config launches nothing and is ``cannot-run``: never ``not-affected``.
"""
from __future__ import annotations

# DeepSpeed optimizers that bring their own communication (deepspeed/runtime/config.py: ONEBIT_ADAM_OPTIMIZER,
# ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER), lower case without "_"
OWN_COMMUNICATION = ("onebitadam", "onebitlamb", "zerooneadam")


def optimizer_refusal(cfg: dict) -> str | None:
    opt = (cfg.get("optimizer") or {}).get("type") if isinstance(cfg.get("optimizer"), dict) else None
    if isinstance(opt, str) and opt.lower().replace("_", "") in OWN_COMMUNICATION:
        return (f'the optimizer "{opt}" communicates its own compressed update (error feedback, a frozen variance '
                "stage): the update it applies is not the averaged gradient, and an SGD stand-in would judge another "
                "code path, so the kit cannot judge this config; replace it with Adam / AdamW to judge the rest")
    return None


def _zenflow(zero: dict) -> str | None:
    if zero.get("zenflow") in (None, False, {}):
        return None
    return ("zero_optimization.zenflow: ZenFlow applies the less important part of each gradient later, on the CPU "
            "(by design), so no step is the averaged gradient of its own micro-batches: remove the zenflow block "
            "to judge the rest of this config")


def autotp_size(cfg: dict) -> int:
    """``tensor_parallel.autotp_size`` (1 without AutoTP)."""
    tp = cfg.get("tensor_parallel") or {}
    size = tp.get("autotp_size", tp.get("tp_size", 1)) if isinstance(tp, dict) else 1
    return size if isinstance(size, int) and size > 1 else 1


def _autotp(cfg: dict, world_size: int) -> str | None:
    size = autotp_size(cfg)
    if size <= 1 or world_size % size == 0:
        return None
    return (f"tensor_parallel.autotp_size {size} splits each linear layer across {size} ranks, and {world_size} "
            f"ranks make no whole number of such groups: run the check with --world-size {size} (or a multiple)")


def apply(cfg: dict, notes: list, fp16: bool, world_size: int = 2) -> str | None:
    """Runs every feature rule but the optimizer's (``optimizer_refusal``, read before the kit drops the user's
    optimizer) on ``cfg`` (changed in place, each change added to ``notes``); returns why the kit cannot judge the
    config, or None."""
    zero = cfg.get("zero_optimization") or {}
    refused = _zenflow(zero) or _autotp(cfg, world_size)
    comp = cfg.get("compile")
    if isinstance(comp, dict) and comp.get("deepcompile"):
        refused = refused or ("compile.deepcompile: DeepCompile replaces ZeRO's gradient hooks with compiled graph "
                              "passes that the kit has not validated against its reference; remove "
                              "compile.deepcompile to judge the eager ZeRO path your config otherwise runs")
    elif comp is not None:
        cfg.pop("compile")
        notes.append("compile removed: torch.compile changes how the forward and backward are computed, not what "
                     "DeepSpeed accumulates and reduces; the check judges the same engine eagerly")
    section = cfg.get("fp16")
    if isinstance(section, dict) and section.get("auto_cast") and not fp16:
        cfg["fp16"] = {k: v for k, v in section.items() if k != "auto_cast"}
        notes.append("fp16.auto_cast removed (fp16 is off here): DeepSpeed casts every floating input to half "
                     "whenever it is set, which the kit's float inputs would feel and a language model's integer "
                     "token ids do not")
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if isinstance(off, dict) and off.get("device") == "nvme":
            zero[key] = {k: v for k, v in off.items() if k not in ("nvme_path", "buffer_count", "buffer_size",
                                                                    "pipeline_read", "pipeline_write", "fast_init")}
            zero[key]["device"] = "cpu"
            notes.append(f"zero_optimization.{key}.device nvme -> cpu (the check runs in memory: the same partitions "
                         "are accumulated and stepped, kept in CPU memory instead of swapped to NVMe)")
    if "curriculum_learning" in cfg:
        cfg.pop("curriculum_learning")
        notes.append("curriculum_learning removed: it schedules the data's sequence lengths, not how micro-batches are "
                     "accumulated (recent DeepSpeed releases refuse this legacy top-level key: if yours does, your run "
                     "stops in deepspeed.initialize; data_efficiency.data_sampling.curriculum_learning replaces it)")
    cfg.pop("aio", None)
    if "pipeline" in cfg or "pipe_parallel_size" in cfg:
        notes.append("pipeline keys ignored: the check runs data parallelism (notebook 02 judges the pipeline)")
    return refused
