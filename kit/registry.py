"""One registry type for what the kit finds by being there: the probes (``gradkit.probes``) and the model shapes
(``gradkit.shapes``). Every module of the package that defines the attribute (``PROBE``, ``SHAPE``) as an instance of
the type is registered under its key; the other modules of the package (the type's own module, shared helpers) define
none and are passed over. Adding one edits no list; ``register`` adds one from elsewhere (a plugin, a test)."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

from gradkit import config as kconfig

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, package: str, attribute: str, kind: type, key: Callable[[T], str], noun: str):
        self.package, self.attribute, self.kind, self.key, self.noun = package, attribute, kind, key, noun
        self._found: dict[str, T] | None = None
        self._extra: dict[str, T] = {}

    def _discover(self) -> dict[str, T]:
        found: dict[str, T] = {}
        package = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_"):
                continue
            item = getattr(importlib.import_module(f"{self.package}.{info.name}"), self.attribute, None)
            if isinstance(item, self.kind):
                key = self.key(item)
                if key in found:
                    raise RuntimeError(f"two {self.noun}s are named {key!r}: in {self.package}.{info.name} and before")
                found[key] = item
        return found

    def all(self) -> dict[str, T]:
        """Every one, ``{key: item}``, sorted by (``order``, key)."""
        if self._found is None:
            self._found = self._discover()
        every = {**self._found, **self._extra}
        return {self.key(x): x for x in sorted(every.values(), key=lambda x: (x.order, self.key(x)))}

    def get(self, key: str) -> T:
        every = self.all()
        if key not in every:
            raise kconfig.ConfigError(f"unknown {self.noun} {key!r}; the kit knows {list(every)}")
        return every[key]

    def register(self, item: T) -> T:
        self._extra[self.key(item)] = item
        return item

    def unregister(self, key: str) -> None:
        self._extra.pop(key, None)
