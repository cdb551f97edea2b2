"""The kit's public name in a user's own job: ``import gradkit`` then ``gradkit.watch.Callback()``,
``gradkit.watch.watch_engine(engine)`` ... (``kit.watch``, through ``gradkit/watch.py``). The kit itself is the
package ``kit``."""
from gradkit import watch

__all__ = ["watch"]
