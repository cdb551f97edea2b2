"""Packages some of the kit's example jobs need and the kit itself does not, kept out of the kit's environment:
each set one overlay folder (``pip --no-deps --target``, every package pinned), installed on first use and put on
the path of those jobs' ranks only.

Why not in the kit's environment: TRL needs ``datasets``, and a ``datasets`` that is installed is imported by every
transformers release the kit overlays (``is_datasets_available``); the current one needs a newer huggingface-hub
than an older transformers' companion overlays carry, so every older-transformers stack would fail to import.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from gradkit import config as kconfig
from gradkit.stacks import versions

# what pip resolves for TRL on top of the kit's own pins (pyproject.toml), each pinned
EXTRAS = {
    "trl": ("trl==1.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "xxhash==4.1.0",
            "pyarrow==26.0.1", "pandas==3.1.1"),
    # LLaMA-Factory 0.9.5 (the newest release): its own pins are datasets <= 4.0.0 and trl 0.x (its PPO imports
    # AutoModelForCausalLMWithValueHead, gone from trl 1.x); OmegaConf reads its YAML and key=value overrides
    "llamafactory": ("llamafactory==0.9.5", "trl==0.24.0", "datasets==4.0.0", "dill==0.4.1", "multiprocess==0.70.19",
                     "xxhash==4.1.0", "pyarrow==26.0.1", "pandas==3.1.1", "omegaconf==2.3.0",
                     "antlr4-python3-runtime==4.9.3"),
    # axolotl 0.19.0 (the newest release) with --no-deps: its own pins (an older transformers, accelerate, peft) are
    # not checked at run time, so the kit's releases run it; numba (its multipack sampler), bitsandbytes (its adapter
    # loader), triton (its kernels, defined at import, none run on a CPU) and wandb are imported when it starts
    "axolotl": ("axolotl==0.19.0", "axolotl-contribs-lgpl==0.0.7", "axolotl-contribs-mit==0.0.6", "datasets==4.8.4",
                "trl==1.9.0", "pyarrow==26.0.1", "pandas==3.1.1", "dill==0.4.1", "multiprocess==0.70.19",
                "xxhash==4.1.0", "addict==2.4.0", "fire==0.7.1", "termcolor==3.3.0", "colorama==0.4.6",
                "evaluate==0.4.1", "fastcore==2.2.41", "posthog==6.7.11", "backoff==2.2.1", "distro==1.9.0",
                "numba==0.68.1", "llvmlite==0.50.0", "bitsandbytes==0.50.2", "triton==3.9.0", "kernels==0.16.0",
                "wandb==0.31.0", "protobuf==7.36.2", "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2",
                "opentelemetry-semantic-conventions==0.66b2"),
}


def ensure(name: str) -> Path:
    """The overlay folder of the set ``name`` (``EXTRAS``), installed once and verified by its manifest."""
    if name not in EXTRAS:
        raise kconfig.ConfigError(f"extra package sets are {', '.join(EXTRAS)}, not {name!r}")
    requirements = list(EXTRAS[name])
    key = hashlib.sha256(" ".join(requirements).encode()).hexdigest()[:10]
    # dill (datasets' fingerprints) pickles a module by reference only where its path says site-packages (else it
    # copies the module's globals, and pyarrow's cannot be): the folder is named so
    target = versions.overlay_root() / f"extras-{name}-{key}" / "site-packages"
    target.parent.mkdir(parents=True, exist_ok=True)
    return versions.ensure_folder(target, requirements, versions.overlay_root() / f".extras-{name}-{key}.lock")
