"""The edged SDK: create sandboxes on the local node and run commands in them.

>>> from edged.client import Sandbox
>>> with Sandbox.create(image="py:3.11") as sbx:          # doctest: +SKIP
...     r = sbx.exec("python3 -c 'print(1+1)'", timeout=10)
...     r.exit_code, r.stdout
(0, '2\\n')

Talks HTTP to the daemon's Unix socket (``$EDGED_SOCKET`` or ``/run/edged/edged.sock``) and
imports neither the daemon's internals nor layerfs, so a trainer imports it cheaply.
"""

from edged.client._common import ExecResult, RetryPolicy
from edged.client.async_sandbox import AsyncSandbox, AsyncSession
from edged.client.errors import (
    ERRORS_BY_CODE,
    BackendError,
    BadProfileError,
    BadRequestError,
    CapacityExhaustedError,
    CommandExitError,
    ConflictError,
    DaemonUnavailableError,
    InternalError,
    InvalidStateError,
    LayersUnavailableError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    PidsExhaustedError,
    SandboxError,
)
from edged.client.process import ProcessHandle
from edged.client.sandbox import Sandbox
from edged.client.session import Session

__all__ = [
    "ERRORS_BY_CODE",
    "AsyncSandbox",
    "AsyncSession",
    "BackendError",
    "BadProfileError",
    "BadRequestError",
    "CapacityExhaustedError",
    "CommandExitError",
    "ConflictError",
    "DaemonUnavailableError",
    "ExecResult",
    "InternalError",
    "InvalidStateError",
    "LayersUnavailableError",
    "MethodNotAllowedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PidsExhaustedError",
    "ProcessHandle",
    "RetryPolicy",
    "Sandbox",
    "SandboxError",
    "Session",
]
