"""HF Trainer resolution: TrainingArguments values (as a framework hands them over) plus the launch -> a
``TrainingRun``. Every framework here ends in the HF Trainer (TRL, LLaMA-Factory, axolotl), so they all end here.

Rules from transformers 5.23.0 (src/transformers/training_args.py TrainingArguments fields and __post_init__,
_process_fsdp_args, _apply_legacy_fsdp_to_config; src/transformers/trainer.py Trainer._run_epoch,
create_accelerator_and_postprocess; src/transformers/integrations/deepspeed.py) and accelerate 1.15.0
(src/accelerate/state.py AcceleratorState.__init__, src/accelerate/utils/dataclasses.py DeepSpeedPlugin).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from gradkit.config import ConfigError
import gradkit.frameworks.ds_rules as ds_rules
from gradkit.frameworks.run import (
    Launch,
    TrainingRun,
    find_file,
    load_ds_json,
    number,
    plain_path,
    positive_int,
    shown,
    str_to_bool,
    unique,
    world_note,
    zero_stage_of,
)

# TrainingArguments field defaults (training_args.py, the dataclass fields)
DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0,
            "bf16": False, "fp16": False}
LOOP_NOTE = ("loop: boundary (the Trainer runs GA micro-batches per optimizer step and marks the last: transformers "
             "trainer.py Trainer._run_epoch; under DeepSpeed accelerate utils/deepspeed.py DeepSpeedEngineWrapper."
             "backward calls engine.set_gradient_accumulation_boundary)")
# accelerate utils/constants.py FSDP_SHARDING_STRATEGY, lower case, and the other legacy fsdp options
FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
MP_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class Case:
    """One way the precision flags can come out (a machine without bf16, an older TRL ...)."""

    label: str
    bf16: bool
    fp16: bool
    pure: str | None = None  # weights kept in this dtype with no autocast (LLaMA-Factory pure_bf16, axolotl bfloat16)


def _value(given, key, convert, notes, via, said, default_why="TrainingArguments default"):
    if key in given and given[key] is not None:
        v = convert(given[key], key)
        if key not in said:
            notes.append(f"{key}: {shown(given[key])} -> {shown(v)} ({via.format(key=key)})")
        return v
    v = DEFAULTS[key]
    if key not in said:
        notes.append(f"{key}: absent -> {shown(v)} ({default_why})")
    return v


def flag_cases(given: dict, notes: list, via: str, said=()) -> list[Case]:
    """The bf16 / fp16 flags as given (HfArgumentParser reads "true"/"false"/1/0 as string_to_bool does)."""
    bf16 = str_to_bool(given["bf16"], "bf16") if given.get("bf16") is not None else False
    fp16 = str_to_bool(given["fp16"], "fp16") if given.get("fp16") is not None else False
    if bf16 and fp16:
        raise ConfigError("bf16 and fp16 are both true, which TrainingArguments refuses (transformers training_args.py "
                          "TrainingArguments.__post_init__: 'At most one of fp16 and bf16')")
    for key, on in (("bf16", bf16), ("fp16", fp16)):
        if key in said:
            continue
        if key in given and given[key] is not None:
            notes.append(f"{key}: {shown(given[key])} -> {key if on else 'off'} ({via.format(key=key)})")
        else:
            notes.append(f"{key}: absent -> off (TrainingArguments default False)")
    return [Case("", bf16, fp16)]


def fsdp_settings(given: dict, notes: list, base_dir, cwd) -> dict | None:
    """TrainingArguments.fsdp as _process_fsdp_args reads it: True, or the legacy "full_shard auto_wrap" string /
    list (_apply_legacy_fsdp_to_config), with fsdp_config (a dict, a JSON string or a JSON file). None: no FSDP."""
    fsdp = given.get("fsdp")
    if fsdp in (None, False, "", []) or (isinstance(fsdp, str) and fsdp.lower() in ("false", "no", "0")):
        return None
    cfg = given.get("fsdp_config") or {}
    if isinstance(cfg, str):
        if cfg.lstrip().startswith("{"):
            try:
                cfg = json.loads(cfg)
            except ValueError as e:
                raise ConfigError(f"fsdp_config is not valid JSON: {e}") from None
        else:
            try:
                cfg = json.loads(find_file(cfg, "fsdp_config", base_dir, cwd).read_text())
            except ValueError as e:
                raise ConfigError(f"fsdp_config {given['fsdp_config']} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"fsdp_config must be a mapping or a JSON file, got {cfg!r}")
    cfg = {(k.removeprefix("fsdp_")): v for k, v in cfg.items()}
    try:
        version = int(cfg.get("version", 2))
    except (TypeError, ValueError):
        raise ConfigError(f"fsdp_config version must be 1 or 2, got {cfg.get('version')!r}") from None
    items = fsdp.split() if isinstance(fsdp, str) and fsdp.lower() not in ("true", "1", "yes") else \
        list(fsdp) if isinstance(fsdp, list) else []
    if not all(isinstance(i, str) for i in items) or not isinstance(fsdp, (str, list, bool)):
        raise ConfigError(f"fsdp must be true, or options like \"full_shard auto_wrap\", got {fsdp!r}")
    reshard = None
    for item in items:
        if item.lower() in FSDP_STRATEGIES:
            if version == 2 and item.lower() not in ("full_shard", "shard_grad_op"):
                raise ConfigError(f"fsdp {item} is FSDP1-only, and fsdp_config version is 2 (transformers "
                                  "training_args.py TrainingArguments._apply_legacy_fsdp_to_config)")
            reshard = item.lower()
        elif item.lower() not in ("offload", "auto_wrap"):
            raise ConfigError(f"unknown fsdp option {item!r}: use full_shard, shard_grad_op, hybrid_shard, offload or "
                              "auto_wrap (transformers training_args.py TrainingArguments._apply_legacy_fsdp_to_config)")
    how = f", {reshard}" if reshard else ""
    notes.append(f"fsdp: {shown(fsdp)} -> FSDP{version}{how} (transformers training_args.py "
                 "TrainingArguments._process_fsdp_args; fsdp_config version defaults to 2)")
    return {"version": version, "config": cfg}


def _ds_source(given, launch, notes, base_dir, cwd):
    """(raw config, file, order, label): TrainingArguments.deepspeed first, else the DeepSpeed accelerate launch set up."""
    if given.get("deepspeed") not in (None, "", False):
        raw, file = load_ds_json(given["deepspeed"], "deepspeed", base_dir, cwd)
        where = f"{file}" if file else "an inline config"
        notes.append(f"deepspeed: {given['deepspeed'] if file else '{...}'} -> DeepSpeed from {where} "
                     f"(TrainingArguments.deepspeed; {ds_rules.TRAINER} fills its \"auto\" values)")
        if launch.deepspeed:
            ds_rules.check_file_fields(launch.ds_fields_from_config)
        return raw, file, "trainer", "deepspeed"
    if launch.deepspeed:
        if launch.ds_file_config is not None:
            ds_rules.check_file_fields(launch.ds_fields_from_config)
            notes.append(f"deepspeed: from accelerate's deepspeed_config_file {launch.ds_file} ({ds_rules.PLUGIN})")
            return copy.deepcopy(launch.ds_file_config), launch.ds_file, "plugin-file", launch.ds_file
        built = ds_rules.plugin_build(launch.ds_fields)
        notes.append(f"deepspeed: built by accelerate from its deepspeed_config fields "
                     f"{json.dumps(launch.ds_fields, sort_keys=True) if launch.ds_fields else '(none: defaults)'} "
                     f"({ds_rules.PLUGIN})")
        return built, None, "plugin-built", "accelerate's DeepSpeed config"
    return None, None, None, None


def _simulate(raw, order, args, mp, world, launch, source):
    ds_rules.check_shape(raw, source)
    cfg, mism = copy.deepcopy(raw), []
    if order == "trainer":
        ds_rules.trainer_config_process(cfg, args, world, mism)
        ds_rules.plugin_with_file(cfg, launch.ds_fields if launch.deepspeed else {}, source)
        ds_rules.set_mixed_precision(cfg, mp)
    else:
        if order == "plugin-file":
            ds_rules.plugin_with_file(cfg, launch.ds_fields, source)
        ds_rules.set_mixed_precision(cfg, mp)
        ds_rules.trainer_config_process(cfg, args, world, mism)
    ds_rules.refuse_mismatches(mism, source)
    ds_rules.batch_assertion(cfg, world, source)
    return cfg


def resolve_trainer(framework: str, source: str, given: dict, notes: list, *, via: str, launch: Launch | None = None,
                    base_dir=None, cwd=None, cases: list[Case] | None = None, said=(), adapter: str | None = None,
                    config_file: str | None = None) -> TrainingRun:
    """``given``: TrainingArguments values the framework passes (only those it sets); ``via``: how, as a note says it
    ("LLaMA-Factory passes it to TrainingArguments.{key}"); ``said``: keys whose resolution the caller already noted;
    ``cases``: precision alternatives the caller resolved (default: the bf16 / fp16 flags in ``given``)."""
    launch = launch or Launch()
    world = launch.world_size
    ga = _value(given, "gradient_accumulation_steps", positive_int, notes, via, said)
    mb = _value(given, "per_device_train_batch_size", positive_int, notes, via, said)
    clip = _value(given, "max_grad_norm", number, notes, via, said)
    if cases is None:
        cases = flag_cases(given, notes, via, said)
    args = {"per_device_train_batch_size": mb, "gradient_accumulation_steps": ga, "max_grad_norm": clip,
            "bf16_full_eval": bool(given.get("bf16_full_eval") and str_to_bool(given["bf16_full_eval"], "bf16_full_eval")),
            "fp16_full_eval": bool(given.get("fp16_full_eval") and str_to_bool(given["fp16_full_eval"], "fp16_full_eval"))}
    raw, file, order, ds_name = _ds_source(given, launch, notes, base_dir, cwd)
    fsdp = fsdp_settings(given, notes, base_dir, cwd)
    if raw is not None:
        path = "deepspeed"
        if fsdp or launch.fsdp:
            notes.append("fsdp: ignored, DeepSpeed takes precedence (accelerate state.py AcceleratorState.__init__ "
                         "checks DeepSpeed first)")
        notes.append("path: deepspeed")
    elif fsdp or launch.fsdp:
        path = "fsdp"
        if not fsdp:
            version = (launch.fsdp_config or {}).get("fsdp_version", 1)
            notes.append(f"path: fsdp (accelerate launch FSDP, fsdp_version {version}: accelerate utils/dataclasses.py "
                         "FullyShardedDataParallelPlugin.__post_init__)")
        else:
            notes.append("path: fsdp")
    else:
        path, said_path = plain_path(world)
        notes.append(said_path)
    precisions, trainer_dtypes, finals, refused, kept = [], [], [], [], []
    mp_from_launch = launch.mixed_precision not in (None, "no")
    if mp_from_launch and any(not c.fp16 and not c.bf16 for c in cases):
        notes.append(f"mixed precision: {launch.mixed_precision} from accelerate launch (ACCELERATE_MIXED_PRECISION; "
                     "TrainingArguments.__post_init__ keeps it while bf16 / fp16 are false)")
    for case in cases:
        label = f" on {case.label}" if case.label else ""
        case_notes = []
        try:
            precision, final = _case(case, label, raw, order, args, ga, world, launch, ds_name, case_notes,
                                     first=not precisions)
        except ConfigError as e:
            if len(cases) == 1:
                raise
            refused.append((label, e))
            continue
        notes.extend(case_notes)
        kept.append(case)
        precisions.append(precision)
        trainer_dtypes.append("bf16" if case.bf16 else "fp16" if case.fp16 else "fp32")
        if final is not None:
            finals.append(final)
    if not precisions:
        raise refused[0][1]
    for label, e in refused:
        notes.append(f"refused{label}: {e}")
    final = finals[0] if finals else None
    if final is not None:
        clip_ds = final.get("gradient_clipping")
        if clip_ds is None:
            notes.append(f"gradient_clipping: absent from the DeepSpeed config -> no clipping: max_grad_norm {clip:g} "
                         "does not act (the Trainer leaves clipping to DeepSpeed: accelerate accelerator.py "
                         "Accelerator.clip_grad_norm_)")
            clip = 0.0
        elif isinstance(clip_ds, (int, float)) and not isinstance(clip_ds, bool):
            clip = float(clip_ds)
    ds_out = None
    if raw is not None:
        ds_out = copy.deepcopy(raw)
        if order == "plugin-built" and len(set(trainer_dtypes)) == 1:
            c = kept[0]
            ds_rules.set_mixed_precision(ds_out, "fp16" if c.fp16 else "bf16" if c.bf16 else launch.mixed_precision or "no")
    notes.append(world_note(world))
    notes.append(LOOP_NOTE)
    ps = unique(precisions)
    tds = unique(trainer_dtypes)
    return TrainingRun(framework=framework, source=source, loops=("boundary",),
                       precision=ps[0] if len(ps) == 1 else None, precisions=ps, ga=ga, micro_batch=mb,
                       world_size=world, path=path, ds_config=ds_out, ds_config_file=file, max_grad_norm=float(clip),
                       adapter=adapter, notes=notes, trainer_dtype=tds[0] if len(tds) == 1 else None,
                       zero_stage=zero_stage_of(final if final is not None else ds_out), launcher=launch.launcher,
                       config_file=config_file)


def _case(case: Case, label: str, raw, order, args, ga, world, launch, ds_name, notes: list, first: bool):
    """(precision, the DeepSpeed config as initialize gets it or None) for one precision case."""
    # TrainingArguments.__post_init__ (step 5): ACCELERATE_MIXED_PRECISION, overridden by fp16 / bf16
    mp = "fp16" if case.fp16 else "bf16" if case.bf16 else (launch.mixed_precision or "no")
    final = None
    if raw is not None:
        final = _simulate(raw, order, {**args, "bf16": case.bf16, "fp16": case.fp16}, mp, world, launch, ds_name)
        why = _why(raw, ga)
        if first:
            ds_rules.describe(raw, final, why, notes, "", ds_rules.WATCHED[:4])
        ds_rules.describe(raw, final, why, notes, label, ds_rules.WATCHED[4:])
        precision = ds_rules.engine_precision(final, ds_name)
    elif mp == "fp8":
        raise ConfigError("mixed precision fp8 without DeepSpeed: the kit measures fp32, bf16 and fp16 runs only")
    else:
        precision = MP_PRECISION.get(mp)
        if precision is None:
            raise ConfigError(f"mixed precision {mp!r}: accelerate knows no, fp16, bf16 and fp8")
    if case.pure:
        notes.append(f"precision{label}: {case.pure} weights and gradients without autocast (engine / Trainer "
                     f"precision {precision})")
        precision = case.pure
    elif raw is None or label:
        notes.append(f"precision{label}: {precision}")
    else:
        notes.append(f"precision: {precision} (the DeepSpeed engine's)")
    return precision, final


def _why(raw: dict, ga: int) -> dict:
    out = {"train_micro_batch_size_per_gpu": f"from per_device_train_batch_size: {ds_rules.TRAINER}",
           "gradient_accumulation_steps": f"from gradient_accumulation_steps: {ds_rules.TRAINER}",
           "train_batch_size": f"world size x per_device_train_batch_size x gradient_accumulation_steps: "
                               f"{ds_rules.TRAINER}",
           "gradient_clipping": f"from max_grad_norm: {ds_rules.TRAINER}",
           "bf16.enabled": f"from TrainingArguments.bf16: {ds_rules.TRAINER}",
           "fp16.enabled": f"from TrainingArguments.fp16: {ds_rules.TRAINER}"}
    if "gradient_accumulation_steps" not in raw:
        out["gradient_accumulation_steps"] = (f"{ds_rules.PLUGIN} sets 1 where the config has none; the Trainer still "
                                              f"takes {ga} micro-batches per optimizer step and sets the boundary itself")
    return out
