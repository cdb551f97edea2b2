"""``gradkit <command>`` / ``python -m kit <command>``.

    gradkit check train.yaml | ds_config.json | launch.sh | DIR [--loop all] [--deepspeed 0.18.9,installed] [--json out.json]
    gradkit bisect ds_config.json --loop manual [--from 0.14.0] [--to installed] [--json out.json]
    gradkit report check.json [--bisect bisect.json]  |  gradkit report runs/sweep --group repro_0.18.6_18
"""
from __future__ import annotations

import importlib
import sys

from kit import config as kconfig

COMMANDS = {"check": "kit.commands.check", "bisect": "kit.commands.bisect", "report": "kit.commands.report"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        raise kconfig.ConfigError(f"usage: gradkit {{{','.join(COMMANDS)}}} ...; got {' '.join(argv) or 'nothing'}")
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


def cli() -> None:
    """The ``gradkit`` console script."""
    kconfig.run_cli(main)


if __name__ == "__main__":
    cli()
