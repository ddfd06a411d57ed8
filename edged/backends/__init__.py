"""Sandbox backends: one interface (:class:`edged.backends.base.Backend`), one module per kind
(``container`` now; ``fncall``, ``microvm``, ``fullvm`` later)."""

from edged.backends.base import (
    Backend,
    ExecEnd,
    ExecHandle,
    ExecSpec,
    Resources,
    SandboxSpec,
)

__all__ = ["Backend", "ExecEnd", "ExecHandle", "ExecSpec", "Resources", "SandboxSpec"]
