"""Sandbox backends: one interface (:class:`edged.backends.base.Backend`), one module per kind
(``container``, ``fncall``, ``microvm``, built by name by :mod:`edged.backends.registry`)."""

from edged.backends.base import (
    Backend,
    ExecEnd,
    ExecHandle,
    ExecSpec,
    Resources,
    SandboxSpec,
)

__all__ = ["Backend", "ExecEnd", "ExecHandle", "ExecSpec", "Resources", "SandboxSpec"]
