"""A training run without DeepSpeed, checked on the path it trains with: the HF Trainer on plain DDP
(``--path trainer``), Accelerate's own loop (``--path accelerate``), FSDP (``--path fsdp2``), each through
``gradkit.commands.check_paths`` with the run's GA, micro-batch and precision in place of the flags.

    args, notes = path_args(run, a)      # the flags a person would have typed, and why each
    result = check(run, a)               # {"verdict", "exit", "precisions": {...}} as a DeepSpeed check's
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import tempfile
from pathlib import Path

from gradkit import config as kconfig
from gradkit.commands import check_paths
from gradkit.judge import oracle
from gradkit.judge import verdict as kverdict

TRAINER_BASED = ("hf-trainer", "trl", "llamafactory", "axolotl")


def path_args(run, a) -> tuple[argparse.Namespace, list[str]]:
    """The path check's flags for ``run`` (a ``gradkit.frameworks.TrainingRun`` with no DeepSpeed) and a line each."""
    b = argparse.Namespace(**vars(a))
    for dest in check_paths.OWN_FLAGS:
        setattr(b, dest, None)
    b.config, b.json, b.model, notes = None, None, None, []
    ga = run.ga if run.ga and run.ga > 1 else None
    if ga is None:
        notes.append(f"GA {run.ga or 1} in your run: nothing is accumulated; judged at GA {a.ga} (--ga), what raising "
                     "it would do")
    b.ga = ga or a.ga
    if run.path == "fsdp":
        dtype = "bf16" if run.precision == "bf16" else "fp32"
        b.path, b.param_dtype, b.reduce_dtype = "fsdp2", dtype, dtype
        b.model = a.model
        notes.append(f"FSDP in {run.precision or 'fp32'}: fully_shard with MixedPrecisionPolicy(param_dtype={dtype}, "
                     f"reduce_dtype={dtype}) (accelerate utils/dataclasses.py set_mixed_precision gives both the "
                     "run's dtype); an FSDP1 run is judged on FSDP2's reduction, not its FlatParameter code")
    elif run.framework in TRAINER_BASED:
        b.path, b.per_device_train_batch_size = "trainer", run.micro_batch
        over = run.trainer_overrides
        for key in ("average_tokens_across_devices", "model_accepts_loss_kwargs"):
            if key in over:
                setattr(b, key, "true" if over[key] else "false")
        notes.append(f"the HF Trainer on {run.world_size or 'several'} DDP ranks: --path trainer with "
                     f"per_device_train_batch_size {run.micro_batch}, GA {b.ga}"
                     + "".join(f", {k} {str(v).lower()}" for k, v in over.items()))
    elif run.framework == "accelerate":
        b.path = "accelerate"
        b.config = run.config_file if run.config_file and Path(run.config_file).suffix in (".yaml", ".yml") else None
        notes.append(f"Accelerate's own loop on DDP: --path accelerate, GA {b.ga}")
    else:
        raise kconfig.ConfigError(f"{run.source}: a {run.framework} run on {run.path}: the kit has no path check for it")
    return b, notes


def check(run, a, say=print) -> dict:
    """Runs the path check for ``run``; its report is said through ``say``."""
    b, notes = path_args(run, a)
    for line in [f"{run.framework}: {n}" for n in run.notes] + notes:
        say(f"  as run: {line}")
    with tempfile.TemporaryDirectory() as tmp:
        b.json = str(Path(tmp) / "path.json")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = check_paths.main(b)
        say(out.getvalue().rstrip())
        doc = json.loads(Path(b.json).read_text()) if Path(b.json).exists() else {}
    summary = doc.get("summary") or {"verdict": oracle.CANNOT_RUN, "exit": code, "loops": []}
    verdict = summary.get("verdict", oracle.CANNOT_RUN)
    return {"source": run.source, "framework": run.framework, "loops": [b.path], "asked": [run.precision or "fp32"],
            "precisions": {run.precision or "fp32": {"summary": summary, "records": doc.get("records", [])}},
            "verdict": verdict, "exit": kverdict.EXIT.get(verdict, code)}


def trainer_side(run, a, result: dict, say=print) -> dict:
    """A run on DeepSpeed whose framework sets its Trainer's loss counting whatever the config says
    (``run.trainer_overrides``: axolotl): the engine's check (``result``) cannot see that, so the Trainer's path check
    runs it too, and the verdict is the worse of the two. Other runs: ``result`` as it is."""
    if run.path != "deepspeed" or not run.trainer_overrides:
        return result
    say(f"{run.source}: {run.framework} sets " + ", ".join(f"{k}={v}" for k, v in run.trainer_overrides.items())
        + " on its Trainer whatever the config says; the engine's check above does not see the loss it makes, the "
          "Trainer's path check does:")
    extra = check(dataclasses.replace(run, path="ddp", notes=[]), a, say)
    words = [result["verdict"], extra["verdict"]]
    verdict = kverdict.worst(words)  # affected first (oracle.WORST_FIRST)
    say(f"verdict over the engine and the Trainer: {words[0]}, {words[1]} -> {verdict} (exit {kverdict.EXIT[verdict]})")
    return {**result, "verdict": verdict, "exit": kverdict.EXIT[verdict], "trainer": extra}
