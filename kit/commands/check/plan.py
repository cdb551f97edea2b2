"""What one check runs, decided before anything launches: the precisions of a config (``precisions``), which of
them this machine can run (``not_here``), which the user asked for (``asked``), the loops (``loops_of``) and the
model (``model_of``). A training config's own resolutions come from ``gradkit.frameworks``.
"""
from __future__ import annotations

from gradkit import config as kconfig
from gradkit import shapes
from gradkit.probes import ds_config
from gradkit.shapes import hf

PRECISIONS = ("fp32", "bf16", "fp16")
FRAMEWORK_LOOPS = ("engine", "boundary")  # who drives a bare DeepSpeed config is unknown: both loops that frameworks run


def precisions(user: dict, trainer_dtype: str | None) -> list[str]:
    """The precisions to check: ``--precision`` where given; else every one an ``"auto"`` in ``bf16.enabled`` /
    ``fp16.enabled`` could resolve to (fp32 and each auto one: the Trainer's --bf16 / --fp16 decide at run time)."""
    if trainer_dtype is not None:
        return [trainer_dtype]
    out = ["fp32"]
    for name in ("bf16", "fp16"):
        section = user.get(name) if isinstance(user, dict) else None
        if isinstance(section, dict) and section.get("enabled") == "auto":
            out.append(name)
    return out


def asked(user: dict, run_precision: str | None, flag: str | None) -> set[str]:
    """The precisions the user asked for: ``--precision``, the training config's resolved one, or the one a
    bare config enables itself (``"enabled": true``); an ``"auto"`` asks for none of those it could resolve to."""
    if flag is not None:
        return {flag}
    if run_precision is not None:
        return {run_precision}
    on = {name for name in ("bf16", "fp16") if isinstance(user, dict) and isinstance(user.get(name), dict)
          and user[name].get("enabled") is True}
    auto = any(isinstance(user, dict) and isinstance(user.get(n), dict) and user[n].get("enabled") == "auto"
               for n in ("bf16", "fp16"))
    return on or (set() if auto else {"fp32"})


def not_here(dtype: str, device: str) -> str | None:
    """Why this machine cannot run ``dtype`` (and what would), or None. fp16 runs on CPU too (DeepSpeed's CPU
    accelerator is told it is supported: ``gradkit.probes.ranks.ds_config.allow_fp16_on_cpu``); fp8 needs the GPU
    kernels of Transformer Engine or torchao on a GPU with fp8 (Hopper or newer) and has no reference the kit built."""
    if dtype == "fp8":
        return ("fp8 cannot run here: its matmuls need a GPU with fp8 (Hopper or newer) and Transformer Engine or "
                "torchao, and the kit has no fp8 tolerance measured; check the same config in bf16 (--precision bf16) "
                "for everything but the fp8 matmuls")
    if dtype not in PRECISIONS:
        return f"{dtype} is no precision the kit judges ({', '.join(PRECISIONS)})"
    return None


def loops_of(flag: str | None, framework_loops) -> tuple:
    """``--loop`` (``all`` or a comma list) where given, else the loops the user's framework runs."""
    if flag is None:
        return tuple(framework_loops or FRAMEWORK_LOOPS)
    if flag == "all":
        return ds_config.LOOPS
    return tuple(x.strip() for x in flag.split(",") if x.strip())


def model_of(where: str | None, adapter: str | None) -> tuple[object, list[str]]:
    """``--model`` / ``--adapter`` as ``ds_config.plan``'s ``model`` and the lines that say what was built: a
    registered shape by name, else the user's architecture from its Hugging Face config at toy size."""
    if where is None or where in shapes.registry():
        if adapter:
            raise kconfig.ConfigError("--adapter needs --model naming a Hugging Face config (the adapter goes on it)")
        return where or shapes.DEFAULT, []
    return hf.user_model(where, adapter)
