"""``gradkit <command>`` / ``python -m gradkit <command>``.

    gradkit --version
    gradkit check train.yaml | ds_config.json | launch.sh | DIR [--loop all] [--deepspeed 0.18.9,installed] [--json out.json]
    gradkit bisect ds_config.json --loop manual [--from 0.14.0] [--to installed] [--json out.json]
    gradkit report check.json [--bisect bisect.json]  |  gradkit report runs/sweep --group repro_0.18.6_18
"""
from __future__ import annotations

import importlib
import platform
import sys
from importlib import metadata

import gradkit
from gradkit import config as kconfig

COMMANDS = {"check": "gradkit.commands.check", "bisect": "gradkit.commands.bisect", "report": "gradkit.commands.report"}


def version() -> str:
    """``gradkit --version``: the kit's release and the stack it would judge here (what a bug report needs)."""
    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    stack = ", ".join(f"{n} {installed(n)}" for n in ("torch", "deepspeed", "transformers", "accelerate", "peft"))
    return f"gradkit {gradkit.__version__} ({stack}; Python {platform.python_version()})"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--version"]:
        print(version())
        return 0
    if not argv or argv[0] not in COMMANDS:
        raise kconfig.ConfigError(f"usage: gradkit {{{','.join(COMMANDS)}}} ... | gradkit --version; got {' '.join(argv) or 'nothing'}")
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


def cli() -> None:
    """The ``gradkit`` console script."""
    kconfig.run_cli(main)


if __name__ == "__main__":
    cli()
