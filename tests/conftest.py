import os
from pathlib import Path

import pytest

# One cache for the whole suite (overlays, JIT-built ops): worlds after the first start warm.
os.environ.setdefault("GRADKIT_CACHE", str(Path(__file__).resolve().parent.parent / ".gradkit-cache"))


@pytest.fixture(scope="session")
def repo() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def warm_module():
    """The module's probe runs share warm worlds, as a notebook's cells do in a kernel (``kit.runner.run``): a
    stack's imports and DeepSpeed's first ``initialize`` are paid once per module, not once per run. The worlds
    are still real 2-rank worlds; ``test_warm_worlds`` shows a warm world's records equal a fresh world's."""
    from kit import launch

    with launch.warm_worlds():
        yield
    launch.stop_warm_worlds()
