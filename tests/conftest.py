import os
from pathlib import Path

import pytest

# One cache for the whole suite (overlays, JIT-built ops): worlds after the first start warm.
os.environ.setdefault("GRADKIT_CACHE", str(Path(__file__).resolve().parent.parent / ".gradkit-cache"))


@pytest.fixture(scope="session")
def repo() -> Path:
    return Path(__file__).resolve().parent.parent
