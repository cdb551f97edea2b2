"""``python -m gradkit.commands.bisect``: the same as ``gradkit bisect``."""
from gradkit import config as kconfig
from gradkit.commands.bisect import main

kconfig.run_cli(main)
