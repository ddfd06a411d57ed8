"""The backends of one daemon: built from config by name, side by side, and looked up per
sandbox by the name its record carries (``"backend"`` of a create request; the default when
it names none).

A backend package (``edged.backends.<name>``) offers ``from_config(config, sink) ->
Backend``; it is imported only when the config names it (the container backend needs the C
helpers, a microVM backend QEMU). :func:`register` adds a factory under a name of its own
(a backend outside this tree; a test's fake). Nothing else in the daemon names a backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from edged.backends.base import Backend, EventSink
from edged.config import Config
from edged.errors import BackendError, BadRequest

Factory = Callable[[Config, EventSink | None], Backend]

#: Backends of this tree: name -> the package whose ``from_config`` builds it.
BUILTIN: dict[str, str] = {"container": "edged.backends.container",
                           "fncall": "edged.backends.fncall",
                           "microvm": "edged.backends.microvm"}
_factories: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Make ``name`` buildable by :meth:`Backends.from_config` (replaces an earlier one)."""
    _factories[name] = factory


def unregister(name: str) -> None:
    """Forget a factory given to :func:`register` (tests)."""
    _factories.pop(name, None)


def build(name: str, config: Config, sink: EventSink | None) -> Backend:
    """The backend ``name`` built from ``config``. Raises BackendError if it is unknown or
    cannot be built here (its package fails to import, e.g. without its C helpers)."""
    factory = _factories.get(name)
    if factory is None:
        module = BUILTIN.get(name)
        if module is None:
            have = ", ".join(sorted({*BUILTIN, *_factories}))
            raise BackendError(f"backend {name!r}: unknown (have: {have})")
        try:
            factory = importlib.import_module(module).from_config
        except ImportError as e:
            raise BackendError(f"backend {name}: not available: {e}") from e
    return factory(config, sink)


class Backends:
    """The backends of one daemon by name, and the ``default`` for requests naming none.
    Every backend gets ``sink`` as its :attr:`~edged.backends.base.Backend.on_event` unless
    it has one already."""

    def __init__(self, backends: Mapping[str, Backend], default: str,
                 sink: EventSink | None = None) -> None:
        if default not in backends:
            raise BackendError(f"default backend {default!r} is not among "
                               f"{sorted(backends)}")
        self._by_name = dict(backends)
        self.default = default
        self.set_sink(sink)

    @classmethod
    def from_config(cls, config: Config, sink: EventSink | None = None) -> Backends:
        """``config.backends`` (comma-separated names; empty: ``config.backend`` alone), the
        default ``config.backend`` among them, and ``fncall`` (with ``container``, whose
        sandboxes are its pool) when FnCall's image or layers are configured. Raises
        BackendError (unknown, unavailable)."""
        names = [n.strip() for n in config.backends.split(",") if n.strip()]
        if config.backend not in names:
            names.insert(0, config.backend)
        if (config.fncall_image or config.fncall_layers) and "fncall" not in names:
            names.append("fncall")  # its pool is container sandboxes: container runs too
        if "fncall" in names and "container" not in names:
            names.append("container")
        return cls({n: build(n, config, sink) for n in dict.fromkeys(names)},
                   config.backend, sink)

    @classmethod
    def single(cls, backend: Backend, sink: EventSink | None = None) -> Backends:
        """A registry of one (a daemon given its backend, as tests do)."""
        return cls({backend.name: backend}, backend.name, sink)

    def set_sink(self, sink: EventSink | None) -> None:
        """Send the events of every backend that has no sink yet to ``sink``."""
        for b in self._by_name.values():
            if b.on_event is None:
                b.on_event = sink

    def get(self, name: str | None = None) -> Backend:
        """The backend ``name`` (the default for None). Raises BadRequest naming the ones
        there are."""
        b = self._by_name.get(self.default if name is None else name)
        if b is None:
            raise BadRequest(f"backend: {name!r} is not available (have "
                             f"{', '.join(repr(n) for n in sorted(self._by_name))})")
        return b

    def names(self) -> list[str]:
        """Every name, the default first."""
        return [self.default, *sorted(n for n in self._by_name if n != self.default)]

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.get(n) for n in self.names())

    def __len__(self) -> int:
        return len(self._by_name)

    async def probe(self) -> dict[str, Any]:
        """Every backend's probed features, by name."""
        return {n: await self._by_name[n].probe() for n in self.names()}

    async def warm(self) -> None:
        for b in self:
            await b.warm()

    async def close(self) -> None:
        for b in self:
            await b.close()


__all__ = ["BUILTIN", "Backends", "Factory", "build", "register", "unregister"]
