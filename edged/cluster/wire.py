"""What crosses Ray between clients and node relays: results and errors as plain data.

A relay never lets an SDK exception cross Ray as such (Ray would wrap it in a task error and
rebuild it with a constructor it cannot call the same way): it answers ``("ok", value)`` or
``("err", {"code", "message", "status", "retry_after", "at"})``, ``at`` being the node's
wall-clock time of the error (a refusal's time, for placement's overlay). The client turns an
error back into the exception of :data:`edged.client.ERRORS_BY_CODE`.
"""

from __future__ import annotations

import time
from typing import Any

from edged.client.errors import ERRORS_BY_CODE, DaemonUnavailableError, SandboxError

Result = tuple[str, Any]
#: what an error's code stands for: the daemon's codes, and the SDK's own for a daemon the
#: relay could not reach
CODES: dict[str, type[SandboxError]] = {**ERRORS_BY_CODE,
                                        DaemonUnavailableError.code: DaemonUnavailableError}


def ok(value: Any) -> Result:
    """A successful answer."""
    return ("ok", value)


def err(e: SandboxError, at: float | None = None) -> Result:
    """The answer for ``e``, stamped with the node's time now (or ``at``)."""
    return ("err", {"code": e.code, "message": e.message, "status": e.status,
                    "retry_after": e.retry_after, "at": time.time() if at is None else at})


def error_of(d: dict[str, Any]) -> SandboxError:
    """The exception an error answer stands for."""
    cls = CODES.get(str(d.get("code")), SandboxError)
    return cls(str(d.get("message", "")), status=int(d.get("status") or 0),
               code=str(d.get("code", "internal")), retry_after=d.get("retry_after"))


def unwrap(r: Result) -> Any:
    """The value of an answer; raises the exception of an error answer."""
    tag, value = r
    if tag == "ok":
        return value
    raise error_of(value)
