"""``gradkit.watch``: the names of ``kit.watch`` (``from gradkit.watch import Callback`` works too)."""
from kit.watch import Affected, Criterion, Returned, Tokens, Watch, watch_engine  # noqa: F401


def __getattr__(name):  # Callback and watch_accelerate import transformers / accelerate when first asked for
    import kit.watch

    return getattr(kit.watch, name)
