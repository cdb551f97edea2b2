"""``python -m gradkit.commands.sweep SPEC [--out DIR] ...``: ``gradkit.commands.sweep.main``."""
from gradkit import config as kconfig
from gradkit.commands.sweep import main

kconfig.run_cli(main)
