"""``python -m gradkit.launch --dry-run``: print the command lines a world would be started with (``spec.main``)."""
from gradkit import config as kconfig
from gradkit.launch.spec import main

if __name__ == "__main__":
    kconfig.run_cli(main)
