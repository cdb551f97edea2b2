"""The one import name ``gradkit`` is the folder ``kit/``: ``gradkit.X.Y`` is ``kit/X/Y.py`` (docs/layout.md).
Everything else about the distribution is in pyproject.toml; this file only maps the name onto the folder."""
from setuptools import find_packages, setup

setup(package_dir={"gradkit": "kit"},
      packages=["gradkit", *(f"gradkit.{name}" for name in find_packages("kit"))])
