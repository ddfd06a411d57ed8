"""Exceptions of the edged SDK, one per API error code (:data:`ERRORS_BY_CODE`).

Base :class:`SandboxError` (``code``, ``status``, ``message``, ``retry_after``); each
subclass also inherits the matching builtin (``except KeyError`` catches
:class:`NotFoundError`), and a more specific code subclasses the general one
(``except BadRequestError`` catches :class:`BadProfileError`)."""

from __future__ import annotations

from typing import Any


class SandboxError(Exception):
    """Any error reported by edged or met while talking to it."""

    code = "internal"

    def __init__(self, message: str, *, status: int = 0, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        if code is not None:
            self.code = code
        self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message


class NotFoundError(SandboxError, KeyError):
    """``not_found`` (404): no such sandbox, image, layer or file."""

    code = "not_found"


class InvalidStateError(SandboxError, RuntimeError):
    """``invalid_state`` (409): the sandbox's state does not allow the operation."""

    code = "invalid_state"


class ConflictError(InvalidStateError):
    """``conflict`` (409): e.g. the chosen sandbox id is in use."""

    code = "conflict"


class PidsExhaustedError(InvalidStateError):
    """``pids_exhausted`` (409): the sandbox is at its pids limit, so no new process can
    start until some exit (``Sandbox.kill_processes()`` ends every leftover)."""

    code = "pids_exhausted"


class CapacityExhaustedError(SandboxError, RuntimeError):
    """``capacity_exhausted`` (503): the node is full (CPU, memory, sandboxes, or the
    daemon's file descriptors); retry after ``retry_after`` s."""

    code = "capacity_exhausted"


class LayersUnavailableError(SandboxError, RuntimeError):
    """``layers_unavailable`` (503): the node's layer service cannot serve layers now (it
    is being restarted); retry after ``retry_after`` s."""

    code = "layers_unavailable"


class BadRequestError(SandboxError, ValueError):
    """``bad_request`` (400): invalid input; the message names the field."""

    code = "bad_request"


class BadProfileError(BadRequestError):
    """``bad_profile`` (400): the task or seccomp profile named does not exist or is
    malformed."""

    code = "bad_profile"


class PayloadTooLargeError(BadRequestError):
    """``payload_too_large`` (413): a request body over the daemon's limit (4 MiB of
    JSON)."""

    code = "payload_too_large"


class MethodNotAllowedError(BadRequestError):
    """``method_not_allowed`` (405): the route exists, not with this HTTP method (an SDK
    and daemon of different versions)."""

    code = "method_not_allowed"


class BackendError(SandboxError, OSError):
    """``backend_error`` (500): the node failed to carry out a valid request."""

    code = "backend_error"


class InternalError(SandboxError):
    """``internal`` (500): an unexpected error in the daemon (logged there)."""

    code = "internal"


class CommandExitError(SandboxError, RuntimeError):
    """A command that did not exit with status 0 where the caller asked it to
    (``ExecResult.check()``, ``sbx.commands.run``, as E2B's ``CommandExitException``).
    ``result``: its :class:`~edged.client.ExecResult`; ``exit_code``, ``stdout``,
    ``stderr`` from it."""

    code = "command_exit"

    def __init__(self, result: Any) -> None:
        how = (f"exit status {result.exit_code}" if result.reason == "exited"
               else result.reason)
        super().__init__(f"command failed ({how}): {result.stderr.strip()[-300:]}")
        self.result = result
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr


class DaemonUnavailableError(SandboxError, ConnectionError):
    """The daemon's socket cannot be reached (not running, wrong path, no permission). Never
    sent by the daemon: raised by the SDK itself."""

    code = "unavailable"


#: Every error code the daemon sends (``components.schemas.Error`` in ``openapi.json``) →
#: the exception the SDK raises for it (sync and async clients alike). A code missing here
#: (a newer daemon) raises the plain :class:`SandboxError`, with ``code`` set.
ERRORS_BY_CODE: dict[str, type[SandboxError]] = {
    c.code: c
    for c in (NotFoundError, InvalidStateError, ConflictError, PidsExhaustedError,
              CapacityExhaustedError, LayersUnavailableError, BadRequestError,
              BadProfileError, PayloadTooLargeError, MethodNotAllowedError, BackendError,
              InternalError)
}


def from_body(status: int, body: object, retry_after: str | None = None) -> SandboxError:
    """The exception for an error response (``{"error": {"code", "message"}}``), from
    :data:`ERRORS_BY_CODE`."""
    code, message = "internal", f"HTTP {status}"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = str(body["error"].get("code", code))
        message = str(body["error"].get("message", message))
    cls = ERRORS_BY_CODE.get(code, SandboxError)
    ra = None
    if retry_after:
        try:
            ra = float(retry_after)
        except ValueError:
            ra = None
    return cls(message, status=status, code=code, retry_after=ra)
