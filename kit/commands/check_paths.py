"""``gradkit check --path fsdp2|accelerate|trainer``: the check's question for the paths without DeepSpeed.

    gradkit check --path fsdp2 [--sync last|every] [--param-dtype bf16] [--reduce-dtype fp32] [--no-reshard]
                               [--units layers|one] [--ga 4] [--model conditional]
    gradkit check accelerate_config.yaml --path accelerate [--sync-each-batch] [--dataloader-length 10]
                               [--accelerate 0.30.1]
    gradkit check --path trainer [--average-tokens-across-devices false] [--per-device-train-batch-size 2]
                               [--transformers 4.46.3]

Each runs the user's settings through the path's probe (``gradkit.probes.fsdp2``, ``accelerate_ga``, ``trainer_ddp``)
in one world of W ranks beside its plain torch.distributed control, and prints the verdict, the
effective/reference ratio, the cosine, the misplaced weight and what the fitted weights say the step was; for an
affected (or raising) configuration, the mechanism and upstream reference the kit knows (``gradkit.notebooks.without_ds``) and
the fix, re-run in the same world where it is a setting. The exit status is the check's: 0 not affected, 1
affected, 2 bad input (nothing launched), 3 inconclusive or cannot run.
"""
from __future__ import annotations

import json
from pathlib import Path

from gradkit import config as kconfig
from gradkit import shapes
from gradkit.judge import oracle
from gradkit.judge import verdict as kverdict
from gradkit.notebooks import without_ds
from gradkit.probes import accelerate_ga, fsdp2, runner, trainer_ddp, trainer_ga
from gradkit.stacks.versions import version_key

PATHS = {"fsdp2": "FSDP2", "accelerate": "ACC", "trainer": "HFT"}
# the flags that belong to one path only (argparse dest -> path); given with another path they are refused
OWN_FLAGS = {"sync": "fsdp2", "param_dtype": "fsdp2", "reduce_dtype": "fsdp2", "no_reshard": "fsdp2", "units": "fsdp2",
             "sync_each_batch": "accelerate", "dataloader_length": "accelerate", "accelerate": "accelerate",
             "average_tokens_across_devices": "trainer", "model_accepts_loss_kwargs": "trainer",
             "per_device_train_batch_size": "trainer",
             "transformers": "trainer"}


def add_arguments(p) -> None:
    """The path flags on ``gradkit check``'s parser (defaults None: a flag given to another path is refused)."""
    p.add_argument("--path", default="deepspeed", choices=["deepspeed", *PATHS],
                   help="the accumulation path to check (default: a DeepSpeed config)")
    g = p.add_argument_group("--path fsdp2")
    g.add_argument("--sync", choices=["last", "every"], default=None,
                   help="set_requires_gradient_sync(False) until the last micro-batch (default), or sync every one")
    g.add_argument("--param-dtype", choices=["fp32", "bf16"], default=None, help="MixedPrecisionPolicy.param_dtype")
    g.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default=None,
                   help="MixedPrecisionPolicy.reduce_dtype (default: fp32)")
    g.add_argument("--no-reshard", action="store_true", default=None, help="reshard_after_forward=False")
    g.add_argument("--units", choices=["layers", "one"], default=None,
                   help="fully_shard every layer then the root (default), or the root alone")
    g = p.add_argument_group("--path accelerate (the positional argument: an `accelerate config` YAML file, optional)")
    g.add_argument("--sync-each-batch", action="store_true", default=None,
                   help="GradientAccumulationPlugin(sync_each_batch=True)")
    g.add_argument("--dataloader-length", type=int, default=None,
                   help="micro-batches per epoch: where GA does not divide it, the last window is checked too")
    g.add_argument("--accelerate", default=None, help="an accelerate release (default: the installed one)")
    g = p.add_argument_group("--path trainer (TrainingArguments as flags)")
    g.add_argument("--average-tokens-across-devices", choices=["true", "false"], default=None,
                   help="TrainingArguments.average_tokens_across_devices (default: the release's own default)")
    g.add_argument("--model-accepts-loss-kwargs", choices=["true", "false"], default=None,
                   help="Trainer.model_accepts_loss_kwargs as the framework leaves it (default: the Trainer's own, true "
                        "for a model whose forward takes **kwargs; axolotl 0.19 sets false)")
    g.add_argument("--per-device-train-batch-size", type=int, default=None, help="rows per micro-batch (default 2)")
    g.add_argument("--transformers", default=None, help="a transformers release (default: the installed one)")


def accelerate_settings(path: str | None) -> dict:
    """What the kit reads from an ``accelerate config`` YAML: ``{"ga", "world_size", "fsdp2", "notes"}`` (None where
    it does not say). A mixed precision other than "no" or a DeepSpeed config is refused: say which check to use."""
    if path is None:
        return {"ga": None, "world_size": None, "fsdp2": False, "notes": []}
    import yaml

    f = Path(path)
    if not f.is_file():
        raise kconfig.ConfigError(f"{path}: no such Accelerate config file")
    try:
        cfg = yaml.safe_load(f.read_text()) or {}
    except yaml.YAMLError as e:
        raise kconfig.ConfigError(f"{path} is not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise kconfig.ConfigError(f"{path}: an Accelerate config is a mapping of keys, got {type(cfg).__name__}")
    kind = str(cfg.get("distributed_type", "MULTI_GPU")).upper()
    if kind == "DEEPSPEED":
        raise kconfig.ConfigError(f"{path} runs DeepSpeed: check its DeepSpeed config with `gradkit check ds_config.json`")
    precision = cfg.get("mixed_precision", "no")
    if precision is False or precision is None:  # an unquoted `no` is YAML's false
        precision = "no"
    if str(precision).lower() not in ("no", "fp32"):
        raise kconfig.ConfigError(f"{path}: mixed_precision {cfg['mixed_precision']!r}: this check judges Accelerate's "
                                  "accumulation in fp32 (set mixed_precision: no to check the accumulation itself)")
    fsdp = cfg.get("fsdp_config") or {}
    fsdp2 = kind == "FSDP"
    if fsdp2 and str(fsdp.get("fsdp_version", 1)) != "2":
        raise kconfig.ConfigError(f"{path}: FSDP version {fsdp.get('fsdp_version', 1)}: the kit checks FSDP2 only")
    ga = cfg.get("gradient_accumulation_steps")
    return {"ga": int(ga) if ga is not None else None, "world_size": cfg.get("num_processes"), "fsdp2": fsdp2,
            "notes": [f"from {path}: distributed_type {kind}" + (f", gradient_accumulation_steps {ga}" if ga else "")]}


def refuse_path_flags(a) -> None:
    """A DeepSpeed check given a flag of another path: refused (exit 2), naming the flag and its path."""
    _refuse_foreign_flags(a)


DEFAULT_GA = 4


def settle(a) -> None:
    """``gradkit check``'s parsed flags as a path check reads them: one config file or none, ``--ga`` 4 and
    ``--world-size`` 2 unless given (a DeepSpeed check keeps its list of configs and finds its world per run)."""
    if a.path == "deepspeed":
        return
    if isinstance(a.config, list):
        if len(a.config) > 1:
            raise kconfig.ConfigError(f"--path {a.path} checks one setting at a time (at most one config file)")
        a.config = a.config[0] if a.config else None
    if a.ga is None:
        a.ga = DEFAULT_GA
    if a.world_size is None:  # a path's settings are flags: its world is --world-size, 2 unless given
        a.world_size = 2


def _refuse_foreign_flags(a) -> None:
    settle(a)
    for dest, owner in OWN_FLAGS.items():
        if getattr(a, dest, None) is not None and owner != a.path:
            flag = "--" + dest.replace("_", "-")
            raise kconfig.ConfigError(f"{flag} belongs to --path {owner}, not --path {a.path}")
    if a.path not in ("accelerate", "deepspeed") and a.config is not None:
        raise kconfig.ConfigError(f"--path {a.path} takes no config file (got {a.config}); its settings are flags")


def plan(a) -> tuple[object, list[dict], list[dict], list[str]]:
    """``(probe, cases, stacks, notes)`` for ``a`` (parsed flags); every refusal happens here, before any launch."""
    settle(a)
    _refuse_foreign_flags(a)
    notes = []
    model = a.model or shapes.DEFAULT
    if a.path != "trainer":
        if model not in shapes.registry():
            raise kconfig.ConfigError(f"--model {model!r}: --path {a.path} takes a model shape ({', '.join(shapes.registry())})")
    elif a.model is not None:
        raise kconfig.ConfigError("--path trainer checks the Trainer on the kit's tiny Llama; --model is not taken")
    common = {"micro_batch": 4, "hidden": 32, "seed": 0, "model": model}
    if a.path == "fsdp2":
        param = a.param_dtype or "fp32"
        reduce = a.reduce_dtype or "fp32"
        if param == "fp32" and reduce == "bf16":
            raise kconfig.ConfigError("--reduce-dtype bf16 with fp32 parameters is not a setting the kit checks; use "
                                      "--param-dtype bf16")
        spec = [not a.no_reshard, param, reduce, a.units or "layers"]
        loop = "sync_every" if a.sync == "every" else "sync_last"
        cases = [{"name": "control", "role": "control", "dtype": "fp32", "setting": "plain torch", "ga": a.ga, **common},
                 {"name": loop, "role": "measured", "dtype": param, "setting": fsdp2.setting_name(*spec), "fsdp": spec,
                  "ga": a.ga, **common}]
        if param == "bf16" and reduce == "fp32":  # the workaround of pytorch#194058 / #196996, in the same world
            fix = [spec[0], "bf16", "bf16", spec[3]]
            cases.append({**cases[1], "role": "fix", "setting": fsdp2.setting_name(*fix), "fsdp": fix,
                          "fix": "reduce_dtype=bf16", "fixes": loop})
        return fsdp2.PROBE, cases, [{}], notes
    if a.path == "accelerate":
        got = accelerate_settings(a.config)
        notes += got["notes"]
        ga = got["ga"] or a.ga
        kconfig.check_ga(ga)
        stack = {} if a.accelerate in (None, kconfig.INSTALLED) else {"accelerate": a.accelerate}
        if a.accelerate:
            kconfig.check_version(a.accelerate)
        name = "accumulate_fsdp2" if got["fsdp2"] else "sync_each_batch" if a.sync_each_batch else "accumulate"
        cases = [{"name": "control", "role": "control", "dtype": "fp32", "ga": ga, **common},
                 {"name": name, "role": "measured", "dtype": "fp32", "ga": ga, **common}]
        if a.dataloader_length is not None:
            kconfig.check_positive_int("--dataloader-length", a.dataloader_length)
            rest = a.dataloader_length % ga
            if rest:
                notes.append(f"a dataloader of {a.dataloader_length} micro-batches ends in a window of {rest} of {ga}")
                last = {"dtype": "fp32", "ga": rest, "accumulation_steps": ga, **common}
                cases += [{"name": "control", "role": "control", **last},
                          {"name": "last_window", "role": "measured", **last},
                          {"name": "last_window_fixed", "role": "fix", "fix": "scale the last window's loss by "
                           f"{ga} / {rest}", "fixes": "last_window", **last}]
        accelerate_ga.validate((a.world_size,), [ga], a.device, a.timeout, (model,), [stack])
        return accelerate_ga.PROBE, cases, [stack], notes
    mb = a.per_device_train_batch_size or 2
    kconfig.check_positive_int("--per-device-train-batch-size", mb)
    stack = {}
    if a.transformers not in (None, kconfig.INSTALLED):
        kconfig.check_version(a.transformers)
        stack = {"transformers": a.transformers}
        if version_key(a.transformers) < (5,):  # 4.x imports on torch 2.13 with accelerate 1.0.1 beside it
            stack["accelerate"] = "1.0.1"
    if a.ga == 1:
        raise kconfig.ConfigError("--path trainer needs --ga > 1 (nothing is accumulated at 1)")
    cases = trainer_ddp.plan((a.ga,), ("trainer", "avg_tokens_on"), mb * a.ga)
    accepts_off = a.model_accepts_loss_kwargs == "false"
    for c in cases:
        if c["name"] == "trainer" and a.average_tokens_across_devices is not None:
            c["trainer_args"] = {"average_tokens_across_devices": a.average_tokens_across_devices == "true"}
        if c["name"] == "trainer" and accepts_off:
            c["trainer_attrs"] = {"model_accepts_loss_kwargs": False}
        if c["name"] == "avg_tokens_on":  # the fix: one token count over every rank (and the model given it)
            c.update(role="fix", fixes="trainer", fix="average_tokens_across_devices=True" + (
                " and model_accepts_loss_kwargs=True (axolotl: examples/recipes/axolotl/gradkit_axolotl_fix.py)"
                if accepts_off else ""))
    if a.average_tokens_across_devices == "true" and not accepts_off:
        cases = [c for c in cases if c["name"] != "avg_tokens_on"]
    notes.append(f"TrainingArguments: per_device_train_batch_size {mb}, gradient_accumulation_steps {a.ga}"
                 + (f", average_tokens_across_devices {a.average_tokens_across_devices}"
                    if a.average_tokens_across_devices else " (average_tokens_across_devices: the release's default)")
                 + (", model_accepts_loss_kwargs false" if accepts_off else ""))
    trainer_ddp.validate([stack], (a.ga,), ("trainer",), (a.world_size,), mb * a.ga, a.device, a.timeout)
    return trainer_ddp.PROBE, cases, [stack], notes


def explanation(rec: dict) -> str | None:
    """The mechanism the kit knows for an affected or raising record (``gradkit.notebooks.without_ds.MECHANISMS``), else
    the upstream table's note for its case, else None."""
    for path, case, explains, *_, sentence in without_ds.MECHANISMS:
        if rec["bug"] == path and rec["case"] == case and explains(rec):
            return sentence
    return None


def summarise(recs: list[dict]) -> dict:
    rows = []
    for r in recs:
        if r["role"] != "measured":
            continue
        m, a = r.get("metrics") or {}, r.get("attribution") or {}
        fix = next((f for f in recs if f["role"] == "fix" and f["config"].get("fixes") == r["case"]
                    and f["ga"] == r["ga"]), None)
        rows.append({"loop": r["case"], "setting": r.get("setting"), "ga": r["ga"], "verdict": r["verdict"],
                     "ratio": m.get("norm_ratio"), "cosine": m.get("cosine"), "misplaced_weight": a.get("misplaced_weight"),
                     "shape": r.get("shape"), "reason": r["reason"], "explanation": explanation(r)
                     if r["verdict"] != oracle.NOT_AFFECTED else None,
                     "fix": None if fix is None or r["verdict"] == oracle.NOT_AFFECTED else
                     {"what": fix["config"].get("fix") or fix["case"], "verdict": fix["verdict"],
                      "ratio": (fix.get("metrics") or {}).get("norm_ratio")}})
    worst = kverdict.worst([r["verdict"] for r in rows])
    controls = [r for r in recs if r["role"] == "control"]
    return {"verdict": worst, "exit": kverdict.EXIT[worst], "loops": rows,
            "control": {"verdict": kverdict.worst([c["verdict"] for c in controls]),
                        "reason": "; ".join(sorted({c["reason"] for c in controls}))} if controls else None}


def report(recs: list[dict], summary: dict, a, notes: list[str]) -> str:
    v = next((r.get("versions") for r in recs if r.get("versions")), {}) or {}
    lines = [f"gradkit check --path {a.path}: " + ", ".join(f"{k} {v[k]}" for k in ("torch", "accelerate", "transformers")
                                                           if k in v)
             + f"; {recs[0].get('world_size') or a.world_size} ranks ({a.device}), "
             f"{recs[0].get('config', {}).get('model') or 'Llama (tiny)'}"]
    lines += [f"  as run: {n}" for n in notes]
    lines.append(f"  {'case':<18} {'GA':>3} {'verdict':<13} {'ratio':>7} {'cosine':>8} {'misplaced':>9}  setting")
    for row in summary["loops"]:
        lines.append(f"  {row['loop']:<18} {row['ga']:>3} {row['verdict']:<13} {kverdict.num(row['ratio'], '7.4f')} "
                     f"{kverdict.num(row['cosine'], '8.5f')} {kverdict.num(row['misplaced_weight'], '9.4f')}  {row['setting'] or ''}")
        if row["verdict"] == oracle.AFFECTED and row.get("shape"):
            lines.append(f"      the step is: {row['shape']}")
        if row["verdict"] != oracle.NOT_AFFECTED:
            lines.append(f"      {row['reason'][:300]}")
            lines.append(f"      known: {row['explanation']}" if row["explanation"] else
                         "      not explained by any mechanism the kit knows")
        if row["fix"]:
            f = row["fix"]
            lines.append(f"      fix: {f['what']}; re-run with the fix: {f['verdict']}"
                         + (f" (ratio {f['ratio']:.4f})" if f.get("ratio") else ""))
    c = summary["control"]
    lines.append(f"  control (plain torch.distributed, not the library under test): {c['verdict'] if c else 'absent'}")
    lines.append(f"verdict: {summary['verdict']} (exit {summary['exit']})")
    return "\n".join(lines)


def main(a) -> int:
    """``gradkit check --path ...`` with the parsed flags ``a``; the exit status."""
    settle(a)
    if a.json and not Path(a.json).parent.exists():
        raise kconfig.ConfigError(f"--json {a.json}: the folder {Path(a.json).parent} does not exist")
    kconfig.check_device(a.device)
    kconfig.check_timeout(a.timeout)
    kconfig.check_ga(a.ga)
    if a.world_size == 1 and not a.allow_one_rank:
        raise kconfig.ConfigError("--world-size 1 hides every bug that lives between ranks; use 2 or more, or add "
                                  "--allow-one-rank to check one rank anyway")
    kconfig.check_world_size(a.world_size, a.device)

    probe, cases, stacks, notes = plan(a)
    try:
        recs = runner.run(probe, [{**c, "steps": a.steps} for c in cases], stacks, (a.world_size,), a.device,
                          a.timeout, meta={"seed": 0}, label=trainer_ga.stack_label)
        summary = summarise(recs)
        print(report(recs, summary, a, notes))
    except Exception as e:  # noqa: BLE001 - the kit's own failure is never a verdict on the user's settings
        import traceback
        traceback.print_exc()
        print(f"internal error while checking --path {a.path}: {type(e).__name__}: {e} (nothing was measured: exit 3)")
        recs, summary = [], {"verdict": oracle.CANNOT_RUN, "exit": kverdict.EXIT[oracle.CANNOT_RUN], "loops": [],
                             "control": None, "error": f"{type(e).__name__}: {e}"}
    if a.json:
        Path(a.json).write_text(json.dumps({"path": a.path, "summary": summary, "records": recs}, indent=1, default=str))
    return summary["exit"]
