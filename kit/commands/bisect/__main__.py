"""``python -m kit.commands.bisect``: the same as ``gradkit bisect``."""
from kit import config as kconfig
from kit.commands.bisect import main

kconfig.run_cli(main)
