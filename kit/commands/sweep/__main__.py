"""``python -m kit.commands.sweep SPEC [--out DIR] ...``: ``kit.commands.sweep.main``."""
from kit import config as kconfig
from kit.commands.sweep import main

kconfig.run_cli(main)
