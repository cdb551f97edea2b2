"""``python -m kit.launch --dry-run``: print the command lines a world would be started with (``spec.main``)."""
from kit import config as kconfig
from kit.launch.spec import main

if __name__ == "__main__":
    kconfig.run_cli(main)
