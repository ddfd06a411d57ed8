"""Request bodies → typed requests (:mod:`edged.node.requests`). Every field is checked here,
against the ranges ``openapi.json`` documents: finite numbers, integers where integers,
names and paths of the right shape; anything else is a :class:`BadRequest` naming the field
(never an overflow further down: C structs hold u64 milliseconds and bytes).
"""

from __future__ import annotations

import math
import re
import signal as signal_mod
from typing import Any

from edged.backends.base import QOS_CLASSES
from edged.errors import BadRequest
from edged.images.registry import check_digest
from edged.node.requests import CreateRequest, ExecRequest, SignalRequest, TimeoutRequest
from edged.node.sandbox import LABEL_KEY_RE, check_id

MAX_SECONDS = 31_536_000.0  # one year: timeouts, TTLs
MAX_BYTES = 1 << 50
#: resources: (kind, minimum, maximum). The minimums are what a sandbox needs to start and run
#: one exec (sbx-init, its spare exec child and the exec: a few pids, a few MiB).
_RESOURCE_FIELDS: dict[str, tuple[type, float, float]] = {
    "cpus": (float, 0.01, 1024.0),
    "memory_bytes": (int, 16 << 20, MAX_BYTES),
    "swap_bytes": (int, 0, MAX_BYTES),
    "pids": (int, 8, 4_194_304),
    "disk_bytes": (int, 1 << 20, MAX_BYTES),
    "memory_request_bytes": (int, 0, MAX_BYTES),
}
_CREATE_FIELDS = {
    "id", "backend", "image", "layers", "resources", "env", "ttl_s", "idle_timeout_s",
    "labels", "network", "hostname", "task_profile", "seccomp_profile", "qos",
    "auto_pause_after_s",
}
_EXEC_FIELDS = {"argv", "cmd", "env", "cwd", "uid", "gid", "timeout_s", "output_limit", "pty",
                "stdin", "encoding", "rows", "cols", "trusted", "kill_leftovers"}
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}\Z")
#: Bounds of a sandbox's labels and of an env (openapi.json states the same).
MAX_LABELS = 64
MAX_LABEL_CHARS = 16 << 10
MAX_ENV = 4096
MAX_ENV_BYTES = 512 << 10


def _object(body: object, fields: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    unknown = set(body) - fields
    if unknown:
        raise BadRequest(f"body: unknown field {sorted(unknown)[0]!r}")
    return body


def fields(body: object, allowed: set[str]) -> dict[str, Any]:
    """``body`` as a JSON object of ``allowed`` fields only (:class:`BadRequest`
    otherwise)."""
    return _object(body, allowed)


def _profile_name(v: object, what: str, default: str | None) -> str | None:
    """A profile name from a request: a bare name (never a path, so a client cannot make the
    daemon read a file of its choosing), loaded and validated now so a bad profile is a 400
    before anything is created."""
    if v is None:
        return default
    if not isinstance(v, str) or not _NAME.match(v):
        raise BadRequest(f"{what}: must be a profile name matching [a-z0-9][a-z0-9_.-]{{0,62}}")
    from edged.security import seccomp, tasks

    if what == "task_profile":
        seccomp.load(tasks.load(v).seccomp)
    else:
        seccomp.load(v)
    return v


def _str_map(v: object, what: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()
    ):
        raise BadRequest(f"{what}: must be an object of string to string")
    return dict(v)


def flag(v: object, what: str) -> bool:
    """A JSON boolean."""
    if not isinstance(v, bool):
        raise BadRequest(f"{what}: must be true or false")
    return v


def number(v: object, what: str, *, minimum: float = 0.0, maximum: float = MAX_SECONDS) -> float:
    """A finite number in [minimum, maximum] (JSON has no NaN or Infinity; Python's parser
    accepts them, and 1e400 parses as inf)."""
    if (isinstance(v, bool) or not isinstance(v, int | float)
            or not math.isfinite(v) or not minimum <= v <= maximum):
        raise BadRequest(f"{what}: must be a number in [{minimum:g}, {maximum:g}]")
    return float(v)


def integer(v: object, what: str, *, minimum: int, maximum: int) -> int:
    """A JSON integer in [minimum, maximum]."""
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise BadRequest(f"{what}: must be an integer in [{minimum}, {maximum}]")
    return v


def env(v: object, what: str) -> dict[str, str]:
    """Environment variables: names non-empty without '=' or NUL, values without NUL; at
    most :data:`MAX_ENV` of them and :data:`MAX_ENV_BYTES` in all (so that an exec can
    still carry them to sbx-init with its argv: 8,192 strings, 1 MiB a request)."""
    out = _str_map(v, what)
    if len(out) > MAX_ENV:
        raise BadRequest(f"{what}: {len(out)} variables, at most {MAX_ENV}")
    total = 0
    for k, x in out.items():
        if not k or "=" in k or "\0" in k:
            raise BadRequest(f"{what}: bad variable name {k!r}")
        if "\0" in x:
            raise BadRequest(f"{what}.{k}: NUL in the value")
        total += len(k.encode("utf-8", "surrogateescape")) + len(
            x.encode("utf-8", "surrogateescape")) + 2
    if total > MAX_ENV_BYTES:
        raise BadRequest(f"{what}: {total} bytes of variables, at most {MAX_ENV_BYTES}")
    return out


def resources(v: object) -> dict[str, int | float]:
    """``{"cpus", "memory_bytes", "swap_bytes", "pids", "disk_bytes"}``, each optional: the
    fields given, checked."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequest("resources: must be an object")
    vals: dict[str, int | float] = {}
    for k, x in v.items():
        spec = _RESOURCE_FIELDS.get(k)
        if spec is None:
            raise BadRequest(f"resources.{k}: unknown field")
        kind, lo, hi = spec
        if kind is int:
            vals[k] = integer(x, f"resources.{k}", minimum=int(lo), maximum=int(hi))
        else:
            vals[k] = number(x, f"resources.{k}", minimum=lo, maximum=hi)
    return vals


def labels(v: object, *, bounded: bool = True) -> dict[str, str]:
    """Labels: string → string, keys ``[A-Za-z0-9][A-Za-z0-9_./-]{0,62}``, values ≤ 256
    characters; with ``bounded`` (a sandbox's labels, not a listing's selector) at most
    :data:`MAX_LABELS` of them, keys and values together at most :data:`MAX_LABEL_CHARS`
    characters (every record and every listing carries them)."""
    out = _str_map(v, "labels")
    if bounded and len(out) > MAX_LABELS:
        raise BadRequest(f"labels: {len(out)} labels, at most {MAX_LABELS}")
    total = 0
    for k, x in out.items():
        if not LABEL_KEY_RE.fullmatch(k):
            raise BadRequest(f"labels: key {k!r} must match [A-Za-z0-9][A-Za-z0-9_./-]{{0,62}}")
        if len(x) > 256:
            raise BadRequest(f"labels.{k}: value longer than 256 characters")
        total += len(k) + len(x)
    if bounded and total > MAX_LABEL_CHARS:
        raise BadRequest(f"labels: {total} characters of keys and values, at most "
                         f"{MAX_LABEL_CHARS}")
    return out


#: One RFC 1123 label: letters, digits and inner hyphens, 1 to 63 characters.
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")


def hostname(v: object) -> str:
    """A sandbox's hostname: RFC 1123 labels joined by dots, at most 63 characters (no
    control characters, spaces, underscores or empty labels: what resolvers and the tools
    that read ``/etc/hostname`` expect)."""
    if (not isinstance(v, str) or not 1 <= len(v) <= 63
            or not all(_HOST_LABEL.match(label) for label in v.split("."))):
        raise BadRequest("hostname: must be RFC 1123 labels (letters, digits, inner hyphens) "
                         "joined by dots, 1 to 63 characters")
    return v


def network_value(v: object) -> str | dict[str, Any]:
    """A ``network`` value's shape: ``"none"`` or ``{"allow": [RULE, ...]}`` (the rules are
    checked against the node's network profile by the manager, :mod:`edged.net.policy`)."""
    if v == "none":
        return "none"
    if not isinstance(v, dict) or set(v) != {"allow"} or not isinstance(v["allow"], list):
        raise BadRequest('network: must be "none" or {"allow": [RULE, ...]}')
    return v


def parse_network(body: object) -> str | dict[str, Any]:
    """A ``PUT /v1/sandboxes/{id}/network`` body: the network value, bare or as
    ``{"network": VALUE}``."""
    if isinstance(body, dict) and set(body) == {"network"}:
        body = body["network"]
    return network_value(body)


def parse_create(body: object) -> CreateRequest:
    """A ``POST /v1/sandboxes`` body. :class:`BadRequest` names the first bad field."""
    b = _object(body, _CREATE_FIELDS)
    # (a field given as null is a bad value, not an absent one)
    backend = b.get("backend")
    if "backend" in b and (not isinstance(backend, str) or not _NAME.match(backend)):
        raise BadRequest("backend: must be a backend name")
    sid = b.get("id")
    if sid is not None:
        check_id(sid)
    image, layers_v = b.get("image"), b.get("layers")
    if (image is None) == (layers_v is None):
        raise BadRequest("body: give exactly one of image or layers")
    if image is not None and not isinstance(image, str):
        raise BadRequest("image: must be a name:tag string")
    layers = None
    if layers_v is not None:
        if not isinstance(layers_v, list) or not 1 <= len(layers_v) <= 64:
            raise BadRequest("layers: must be a list of 1 to 64 digests, bottom first")
        layers = tuple(check_digest(d) for d in layers_v)
    network = network_value(b.get("network", "none"))
    host = hostname(b["hostname"]) if "hostname" in b else None
    task_profile = _profile_name(b.get("task_profile"), "task_profile", "default")
    seccomp_profile = _profile_name(b.get("seccomp_profile"), "seccomp_profile", None)
    qos = b.get("qos", "best_effort")
    if qos not in QOS_CLASSES:
        raise BadRequest(f"qos: must be one of {', '.join(QOS_CLASSES)}")
    return CreateRequest(
        id=sid, backend=backend, image=image, layers=layers,
        resources=resources(b.get("resources")), env=env(b.get("env"), "env"),
        labels=labels(b.get("labels")), network=network, hostname=host,
        task_profile=task_profile or "default", seccomp_profile=seccomp_profile,
        ttl_s=number(b["ttl_s"], "ttl_s") if "ttl_s" in b else None,
        idle_timeout_s=(number(b["idle_timeout_s"], "idle_timeout_s")
                        if "idle_timeout_s" in b else None),
        qos=qos,
        auto_pause_after_s=(number(b["auto_pause_after_s"], "auto_pause_after_s")
                            if "auto_pause_after_s" in b else None),
    )


def parse_exec(body: object, *, stdin_default: bool | None = None) -> ExecRequest:
    """An exec body: ``argv`` (list of strings) or ``cmd`` (a string run by ``/bin/sh -c``),
    ``env``, ``cwd``, ``uid``, ``gid``, ``timeout_s``, ``output_limit``, ``pty``, ``stdin``
    (bool: kept open, WebSocket; text: fed then closed; ``stdin_default`` when absent),
    ``encoding``, ``rows``, ``cols``, ``trusted``, ``kill_leftovers``."""
    b = _object(body, _EXEC_FIELDS)
    argv_v, cmd = b.get("argv"), b.get("cmd")
    if (argv_v is None) == (cmd is None):
        raise BadRequest("body: give exactly one of argv or cmd")
    if cmd is not None:
        if not isinstance(cmd, str) or not cmd:
            raise BadRequest("cmd: must be a non-empty string")
        argv: tuple[str, ...] = ("/bin/sh", "-c", cmd)
    else:
        if (not isinstance(argv_v, list) or not argv_v
                or not all(isinstance(a, str) and "\0" not in a for a in argv_v)):
            raise BadRequest("argv: must be a non-empty list of strings without NUL")
        argv = tuple(argv_v)
    trusted = flag(b.get("trusted", False), "trusted")
    exec_env = env(b.get("env"), "env")
    cwd = b.get("cwd", "/")
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise BadRequest("cwd: must be an absolute path")
    ids = {}
    for k in ("uid", "gid"):
        x = b.get(k, 0)
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 65536:
            raise BadRequest(f"{k}: must be an integer in [0, 65536)")
        ids[k] = x
    timeout = b.get("timeout_s")
    limit = b.get("output_limit")
    if limit is not None:
        integer(limit, "output_limit", minimum=1, maximum=MAX_BYTES)
    pty = flag(b.get("pty", False), "pty")
    size: dict[str, int] = {}
    for k in ("rows", "cols"):  # the PTY's size, refused before anything starts
        if k in b:
            size[k] = integer(b[k], k, minimum=1, maximum=65535)
    stdin = b.get("stdin", stdin_default)
    if stdin is not None and not isinstance(stdin, str | bool):
        raise BadRequest("stdin: must be a string (fed, then closed) or a boolean")
    encoding = b.get("encoding", "text")
    if encoding not in ("text", "base64"):
        raise BadRequest(f"encoding: {encoding!r} is not 'text' or 'base64'")
    return ExecRequest(
        argv=argv, env=exec_env, cwd=cwd, uid=ids["uid"], gid=ids["gid"],
        timeout_s=None if timeout is None else number(timeout, "timeout_s", minimum=0.001),
        output_limit=limit, pty=pty, stdin=stdin, encoding=encoding,
        rows=size.get("rows"), cols=size.get("cols"), trusted=trusted,
        kill_leftovers=flag(b.get("kill_leftovers", False), "kill_leftovers"),
    )


def parse_signal(body: object) -> SignalRequest:
    """``{"signal": int | "SIGTERM" | "TERM", "exec_id": optional int, "all": optional bool}``
    (default SIGTERM); ``all`` only with SIGKILL and no ``exec_id``."""
    b = _object(body, {"signal", "exec_id", "all"})
    sig_v = b.get("signal", "SIGTERM")
    try:
        if isinstance(sig_v, str):
            sig = int(signal_mod.Signals[sig_v if sig_v.startswith("SIG") else "SIG" + sig_v])
        elif isinstance(sig_v, int) and not isinstance(sig_v, bool):
            sig = int(signal_mod.Signals(sig_v))
        else:
            raise ValueError(sig_v)
    except (KeyError, ValueError) as e:
        raise BadRequest(f"signal: {sig_v!r} is not a signal") from e
    eid = b.get("exec_id")
    every = flag(b.get("all", False), "all")
    if every and (sig != signal_mod.SIGKILL or eid is not None):
        raise BadRequest("all: only with signal 9 (SIGKILL) and without exec_id")
    if eid is not None and (isinstance(eid, bool) or not isinstance(eid, int)):
        raise BadRequest(f"exec_id: {eid!r} is not an integer")
    return SignalRequest(signal=sig, exec_id=eid, all=every)


def parse_timeout(body: object) -> TimeoutRequest:
    """``{"ttl_s": s}`` (from now; 0 clears) and/or ``{"idle_timeout_s": s}``."""
    if not isinstance(body, dict) or not body or set(body) - {"ttl_s", "idle_timeout_s"}:
        raise BadRequest("body: give ttl_s and/or idle_timeout_s")
    return TimeoutRequest(
        ttl_s=number(body["ttl_s"], "ttl_s") if "ttl_s" in body else None,
        idle_timeout_s=(number(body["idle_timeout_s"], "idle_timeout_s")
                        if "idle_timeout_s" in body else None))


__all__ = ["MAX_BYTES", "MAX_SECONDS", "env", "fields", "flag", "integer", "labels", "number",
           "parse_create", "parse_exec", "parse_signal", "parse_timeout", "resources"]
