"""The exception hierarchy of edged.

One base, :class:`EdgedError`; each subclass carries the API error ``code`` (the string in
``{"error": {"code": ..., "message": ...}}``) and the HTTP ``status`` the API answers with, and
also inherits the matching builtin so callers can catch either way (``except KeyError`` catches
:class:`NotFound`). Backends raise these; the API layer turns them into responses in one place.
"""

from __future__ import annotations


class EdgedError(Exception):
    """Base of every error raised by edged (daemon, backends). ``code``: API error code;
    ``status``: HTTP status; ``retry_after``: seconds a client should wait, or None."""

    code: str = "internal"
    status: int = 500

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __str__(self) -> str:  # KeyError quotes its argument; a message reads better
        return self.message


class NotFound(EdgedError, KeyError):
    """A sandbox, image, layer or file that does not exist (HTTP 404)."""

    code = "not_found"
    status = 404


class InvalidState(EdgedError, RuntimeError):
    """An operation that the object's current state does not allow, e.g. exec in a paused
    sandbox (HTTP 409)."""

    code = "invalid_state"
    status = 409


class Conflict(InvalidState):
    """A resource that already exists, e.g. a client-chosen sandbox id in use (HTTP 409,
    code ``conflict``)."""

    code = "conflict"


class PidsExhausted(InvalidState):
    """The sandbox is at its pids limit (or sbx-init at its limit of running execs), so a
    new process cannot start: fork failed with EAGAIN (HTTP 409, code ``pids_exhausted``).
    Kill leftovers (``{"signal": 9, "all": true}``) and retry."""

    code = "pids_exhausted"


class CapacityExhausted(EdgedError, RuntimeError):
    """The node cannot admit the request within capacity × overcommit (HTTP 503, with
    ``Retry-After``)."""

    code = "capacity_exhausted"
    status = 503


class LayersUnavailable(EdgedError, RuntimeError):
    """The node's layer service cannot serve layers now (its lazy server is down and being
    restarted): a create would make a sandbox whose reads fail (HTTP 503, with
    ``Retry-After``)."""

    code = "layers_unavailable"
    status = 503


class BadRequest(EdgedError, ValueError):
    """Malformed or invalid input: a bad field, an id out of pattern, a path that escapes the
    sandbox root (HTTP 400). The message names the offending field or entry."""

    code = "bad_request"
    status = 400


class PayloadTooLarge(BadRequest):
    """A request body over the documented limit (HTTP 413, code ``payload_too_large``)."""

    code = "payload_too_large"
    status = 413


class BackendError(EdgedError, OSError):
    """The backend failed to carry out a valid request (spawn, mount, cgroup...) (HTTP 500)."""

    code = "backend_error"
    status = 500


#: API code → exception class, for the SDK-independent daemon side (e.g. tests, re-raising).
ERRORS_BY_CODE: dict[str, type[EdgedError]] = {
    cls.code: cls
    for cls in (NotFound, InvalidState, Conflict, PidsExhausted, CapacityExhausted,
                LayersUnavailable, BadRequest, PayloadTooLarge, BackendError)
}
