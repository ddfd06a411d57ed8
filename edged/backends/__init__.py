"""Sandbox backends: one interface (:class:`edged.backends.base.Backend`), one module per kind
(``container``, ``fncall``, built by name by :mod:`edged.backends.registry`; ``microvm``'s
pieces, not yet registered)."""

from edged.backends.base import (
    Backend,
    ExecEnd,
    ExecHandle,
    ExecSpec,
    Resources,
    SandboxSpec,
)

__all__ = ["Backend", "ExecEnd", "ExecHandle", "ExecSpec", "Resources", "SandboxSpec"]
