"""Stateless calls over HTTP: the native ``POST /v1/fncalls`` of the Unix socket API, and
SandboxFusion's ``POST /run_code`` (what verl and the ``sandbox-fusion`` client send) for
the TCP listener (:func:`fusion_app`, API keys required). Both parse their bodies into one
:class:`~edged.backends.base.CallRequest` and answer from the node's
:class:`~edged.backends.base.CallBackend` (the FnCall backend).

Native request (every field optional but one of ``language`` + ``source``, ``argv`` or
``artifact``): ``language``, ``source`` (text), ``argv`` (a program of the image, e.g.
``["/bin/true"]``), ``artifact`` (a kept compile result's id), ``stdin`` (text; or
``cases``: ``[{"stdin", "args", "files"}]``, each run with its own verdict), ``files``
(``{path: base64}``, relative paths), ``fetch`` (paths read back after each run), ``env``,
``limits`` and ``compile_limits`` (``{"cpu_s", "wall_s", "memory_bytes", "output_bytes",
"file_bytes"}``), ``keep`` (keep the compile result; ``keep_s`` seconds), ``image`` (the
pool: a registered ``name:tag``; default the configured one), ``encoding`` of outputs
(``"text"``: UTF-8, invalid bytes replaced; ``"base64"``). Answer: ``{"compile": result |
null, "results": [result], "artifact": {"id", "ttl_s"} | null}``, a result being ``{"status",
"exit_code", "signal", "cpu_s", "wall_s", "memory_bytes", "stdout", "stderr",
"stdout_truncated", "stderr_truncated", "files": {path: base64}, "error"}``.

SandboxFusion's ``/run_code`` (its ``RunCodeRequest``/``RunCodeResponse``, read from its
public API and source, facts only): request ``{"code", "language", "stdin",
"compile_timeout", "run_timeout", "memory_limit_MB", "files": {path: base64 | null},
"fetch_files": [path]}``; answer ``{"status": "Success" | "Failed" | "SandboxError",
"message", "compile_result", "run_result", "executor_pod_name", "files"}`` with each result
``{"status": "Finished" | "Error" | "TimeLimitExceeded", "execution_time", "return_code",
"stdout", "stderr"}``. As there: the run is skipped when the compile fails; a time limit is
``TimeLimitExceeded`` with no return code; a signalled program's return code is minus the
signal (as Python's subprocess reports it); status ``SandboxError`` (with the message) for
an ``Error``, ``Failed`` for a time limit or a non-zero return code, else ``Success``. The
time limits are wall seconds (CPU time is held to the same figure); outputs are cut at 1 MiB
each, as SandboxFusion reads them.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
from typing import Any

from aiohttp import web

from edged.backends.base import (
    CallBackend,
    CallCase,
    CallFile,
    CallLimits,
    CallRequest,
    CallResponse,
    CallResult,
)
from edged.errors import BadRequest, EdgedError, NotFound
from edged.security.apikeys import ApiKeys, presented_key

log = logging.getLogger("edged.api.fncalls")

MAX_CASES = 1000
MAX_LIMIT_S = 3600.0
MAX_OUTPUT = 64 << 20
MAX_FILE = 1 << 30
_FIELDS = {"language", "source", "argv", "artifact", "stdin", "cases", "files", "fetch", "env",
           "limits", "compile_limits", "keep", "keep_s", "image", "encoding"}
_LIMIT_FIELDS = {"cpu_s", "wall_s", "memory_bytes", "output_bytes", "file_bytes"}
_CASE_FIELDS = {"stdin", "args", "files"}


def _text(v: object, what: str, *, limit: int = 64 << 20) -> str:
    if not isinstance(v, str):
        raise BadRequest(f"{what}: must be a string")
    if len(v) > limit:
        raise BadRequest(f"{what}: longer than {limit} characters")
    return v


def _strings(v: object, what: str, *, most: int = 4096) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) and "\0" not in x for x in v):
        raise BadRequest(f"{what}: must be a list of strings (no NUL)")
    if len(v) > most:
        raise BadRequest(f"{what}: more than {most} entries")
    return tuple(v)


def _seconds(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or not 0 < v <= MAX_LIMIT_S:
        raise BadRequest(f"{what}: must be a number of seconds in (0, {MAX_LIMIT_S:.0f}]")
    return float(v)


def _bytes(v: object, what: str, most: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most:
        raise BadRequest(f"{what}: must be an integer of bytes in [1, {most}]")
    return v


def _files(v: object, what: str) -> tuple[CallFile, ...]:
    """``{path: base64}`` (a null value: skipped, as SandboxFusion does)."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise BadRequest(f"{what}: must be an object of path to base64")
    out = []
    for path, data in v.items():
        if data is None:
            continue
        if not isinstance(data, str):
            raise BadRequest(f"{what}[{path[:80]!r}]: must be base64 text")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRequest(f"{what}[{path[:80]!r}]: not base64: {e}") from e
        out.append(CallFile(path.lstrip("./") if path.startswith("./") else path, raw,
                            0o755 if path.endswith((".sh", ".py")) else 0o644))
    return tuple(out)


def _limits(v: object, what: str, default: CallLimits) -> CallLimits:
    if v is None:
        return default
    if not isinstance(v, dict):
        raise BadRequest(f"{what}: must be an object")
    unknown = set(v) - _LIMIT_FIELDS
    if unknown:
        raise BadRequest(f"{what}: unknown field {sorted(unknown)[0]!r}")
    cpu = _seconds(v["cpu_s"], f"{what}.cpu_s") if "cpu_s" in v else default.cpu_s
    wall = (_seconds(v["wall_s"], f"{what}.wall_s") if "wall_s" in v
            else max(default.wall_s, 2 * cpu + 1) if "cpu_s" in v else default.wall_s)
    mem = default.memory_bytes
    if v.get("memory_bytes") is not None:
        mem = _bytes(v["memory_bytes"], f"{what}.memory_bytes", 1 << 40)
    out = (_bytes(v["output_bytes"], f"{what}.output_bytes", MAX_OUTPUT)
           if "output_bytes" in v else default.output_bytes)
    fsz = (_bytes(v["file_bytes"], f"{what}.file_bytes", MAX_FILE)
           if "file_bytes" in v else default.file_bytes)
    return CallLimits(cpu_s=cpu, wall_s=wall, memory_bytes=mem, output_bytes=out,
                      file_bytes=fsz)


def parse_call(body: object) -> tuple[CallRequest, str]:
    """A native request body -> (CallRequest, output encoding). Raises BadRequest naming
    the field."""
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    unknown = set(body) - _FIELDS
    if unknown:
        raise BadRequest(f"body: unknown field {sorted(unknown)[0]!r}")
    kinds = [k for k in ("source", "argv", "artifact") if body.get(k) is not None]
    if len(kinds) != 1:
        raise BadRequest("body: give exactly one of source (with language), argv, artifact")
    language = body.get("language")
    if language is not None:
        language = _text(language, "language", limit=64)
    if "source" in kinds and language is None:
        raise BadRequest("language: needed with source")
    source = _text(body["source"], "source").encode() if "source" in kinds else None
    argv = _strings(body["argv"], "argv") if "argv" in kinds else None
    if argv is not None and (not argv or not argv[0]):
        raise BadRequest("argv: must name a program")
    artifact = _text(body["artifact"], "artifact", limit=64) if "artifact" in kinds else None
    cases: list[CallCase] = []
    if body.get("cases") is not None:
        if body.get("stdin") is not None:
            raise BadRequest("body: give stdin or cases, not both")
        if not isinstance(body["cases"], list) or not 1 <= len(body["cases"]) <= MAX_CASES:
            raise BadRequest(f"cases: must be a list of 1 to {MAX_CASES} objects")
        for i, c in enumerate(body["cases"]):
            if not isinstance(c, dict) or set(c) - _CASE_FIELDS:
                raise BadRequest(f"cases[{i}]: must be an object of stdin, args, files")
            cases.append(CallCase(
                stdin=None if c.get("stdin") is None
                else _text(c["stdin"], f"cases[{i}].stdin").encode(),
                args=_strings(c.get("args", []), f"cases[{i}].args"),
                files=_files(c.get("files"), f"cases[{i}].files")))
    else:
        stdin = body.get("stdin")
        cases.append(CallCase(stdin=None if stdin is None else _text(stdin, "stdin").encode()))
    env = body.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(x, str)
                                            and k and "=" not in k and "\0" not in k + x
                                            for k, x in env.items()):
        raise BadRequest("env: must be an object of names to strings")
    keep = body.get("keep", False)
    if not isinstance(keep, bool):
        raise BadRequest("keep: must be true or false")
    keep_s = None if body.get("keep_s") is None else _seconds(body["keep_s"], "keep_s")
    image = body.get("image")
    if image is not None:
        image = _text(image, "image", limit=256)
    encoding = body.get("encoding", "text")
    if encoding not in ("text", "base64"):
        raise BadRequest("encoding: must be 'text' or 'base64'")
    defaults = CallRequest()
    req = CallRequest(
        language=language, source=source, argv=argv, artifact=artifact, cases=tuple(cases),
        files=_files(body.get("files"), "files"),
        fetch=_strings(body.get("fetch", []), "fetch", most=256), env=dict(env),
        limits=_limits(body.get("limits"), "limits", defaults.limits),
        compile_limits=_limits(body.get("compile_limits"), "compile_limits",
                               defaults.compile_limits),
        keep=keep, keep_s=keep_s, pool=image)
    return req, encoding


def _out(data: bytes, encoding: str) -> str:
    if encoding == "base64":
        return base64.b64encode(data).decode()
    return data.decode("utf-8", "replace")


def result_json(r: CallResult, encoding: str = "text") -> dict[str, Any]:
    """One run's result as the native API answers it."""
    return {"status": r.status, "exit_code": r.exit_code, "signal": r.signal,
            "cpu_s": round(r.cpu_s, 6), "wall_s": round(r.wall_s, 6),
            "memory_bytes": r.memory_bytes, "stdout": _out(r.stdout, encoding),
            "stderr": _out(r.stderr, encoding), "stdout_truncated": r.stdout_truncated,
            "stderr_truncated": r.stderr_truncated,
            "files": {k: base64.b64encode(v).decode() for k, v in r.files.items()},
            "error": r.error}


def response_json(resp: CallResponse, encoding: str = "text") -> dict[str, Any]:
    """A call's answer as the native API gives it."""
    return {"compile": None if resp.compile is None else result_json(resp.compile, encoding),
            "results": [result_json(r, encoding) for r in resp.results],
            "artifact": None if resp.artifact is None
            else {"id": resp.artifact, "ttl_s": round(resp.artifact_ttl_s or 0.0, 3)}}


#: whether a class is a CallBackend (a runtime protocol's isinstance looks up every member
#: each time: ~30 us, once per call otherwise; its members are methods, so the class says)
_IS_CALL_BACKEND: dict[type, bool] = {}


def call_backend(backends: Any) -> CallBackend:
    """The node's backend of stateless calls. Raises NotFound when none runs here."""
    for b in backends:
        t = type(b)
        is_call = _IS_CALL_BACKEND.get(t)
        if is_call is None:
            is_call = _IS_CALL_BACKEND[t] = isinstance(b, CallBackend)
        if is_call:
            return b  # type: ignore[no-any-return]
    raise NotFound("no backend of this node runs stateless calls: start edged with "
                   "--fncall-image or --fncall-layers")


# -- SandboxFusion's /run_code ----------------------------------------------------------------

_FUSION_FIELDS = {"code", "language", "stdin", "compile_timeout", "run_timeout",
                  "memory_limit_MB", "files", "fetch_files"}
#: what SandboxFusion reads of each output stream (1 MiB)
FUSION_OUTPUT = 1 << 20


def parse_run_code(body: object) -> CallRequest:
    """A ``/run_code`` body -> CallRequest. Raises BadRequest naming the field (FastAPI
    answers such a body with 422; so does the listener)."""
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    unknown = set(body) - _FUSION_FIELDS
    if unknown:
        raise BadRequest(f"body: unknown field {sorted(unknown)[0]!r}")
    if "code" not in body or "language" not in body:
        raise BadRequest("body: code and language are required")
    code = _text(body["code"], "code")
    language = _text(body["language"], "language", limit=64)
    run_s = _seconds(body.get("run_timeout", 10), "run_timeout")
    compile_s = _seconds(body.get("compile_timeout", 10), "compile_timeout")
    mem = body.get("memory_limit_MB", -1)
    if isinstance(mem, bool) or not isinstance(mem, int) or mem == 0 or mem < -1:
        raise BadRequest("memory_limit_MB: must be -1 (none) or a positive integer")
    stdin = body.get("stdin")
    return CallRequest(
        language=language, source=code.encode(),
        cases=(CallCase(stdin=None if stdin is None else _text(stdin, "stdin").encode()),),
        files=_files(body.get("files"), "files"),
        fetch=_strings(body.get("fetch_files", []), "fetch_files", most=256),
        limits=CallLimits(cpu_s=run_s, wall_s=run_s,
                          memory_bytes=None if mem == -1 else mem << 20,
                          output_bytes=FUSION_OUTPUT),
        compile_limits=CallLimits(cpu_s=compile_s, wall_s=compile_s,
                                  output_bytes=FUSION_OUTPUT, file_bytes=256 << 20))


def _fusion_result(r: CallResult) -> dict[str, Any]:
    if r.status == "Internal Error":
        return {"status": "Error", "execution_time": None, "cpu_time": None, "return_code": None,
                "stdout": None, "stderr": r.error or "internal error"}
    tle = r.status == "Time Limit Exceeded"
    code = r.exit_code if r.signal is None else -r.signal
    return {"status": "TimeLimitExceeded" if tle else "Finished",
            "execution_time": round(r.wall_s, 6), "cpu_time": round(r.cpu_s, 6),
            "return_code": None if tle else code,
            "stdout": r.stdout.decode("utf-8", "replace"),
            "stderr": r.stderr.decode("utf-8", "replace")}


def run_code_json(resp: CallResponse) -> dict[str, Any]:
    """A call's answer as SandboxFusion's ``RunCodeResponse``."""
    comp = None if resp.compile is None else _fusion_result(resp.compile)
    run = _fusion_result(resp.results[0]) if resp.results else None
    status, message = "Success", ""
    for res in (comp, run):
        if res is not None and res["status"] == "Error":
            status, message = "SandboxError", res["stderr"] or ""
            break
    else:
        if any(res is not None and (res["status"] == "TimeLimitExceeded"
                                    or res["return_code"] not in (0, None))
               for res in (comp, run)):
            status = "Failed"
    files = dict(resp.results[0].files) if resp.results else {}
    return {"status": status, "message": message, "compile_result": comp, "run_result": run,
            "executor_pod_name": None,
            "files": {k: base64.b64encode(v).decode() for k, v in files.items()}}


CALLS: web.AppKey[Any] = web.AppKey("calls", object)
KEYS: web.AppKey[ApiKeys] = web.AppKey("api_keys", ApiKeys)
BODY: web.AppKey[Any] = web.AppKey("read_body", object)


def fusion_key(headers: Any) -> str | None:
    """The key a ``/run_code`` request presents: ``X-API-Key``, ``Authorization: Bearer``,
    or HTTP Basic auth's password (else its user name). The ``sandbox-fusion`` client and
    verl send no headers of their own, but ``requests`` turns the user information of the
    endpoint URL into Basic auth: ``http://key:KEY@HOST:PORT`` presents KEY unchanged."""
    key = presented_key(headers)
    if key is not None:
        return key
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(token.strip(), validate=True).decode().partition(":")
    except (binascii.Error, ValueError):
        return None
    return password or user or None


@web.middleware
async def _fusion_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """API keys first (401), then SandboxFusion's own error shapes: a bad body is a 422
    with FastAPI's ``{"detail": [...]}``; a refusal for capacity a 503 with Retry-After; a
    node failure a 200 ``SandboxError`` as SandboxFusion answers one."""
    if request.app[KEYS].check(fusion_key(request.headers)) is None:
        return web.json_response({"detail": "missing or wrong API key"}, status=401,
                                 headers={"WWW-Authenticate": "Bearer"})
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except web.HTTPException:
        raise
    except BadRequest as e:
        if e.status == 413:
            return web.json_response({"detail": e.message}, status=413)
        return web.json_response({"detail": [{"type": "value_error", "loc": ["body"],
                                               "msg": e.message}]}, status=422)
    except EdgedError as e:
        if e.status == 503:
            headers = {"Retry-After": str(max(1, math.ceil(e.retry_after or 1)))}
            return web.json_response({"detail": e.message}, status=503, headers=headers)
        return web.json_response({"status": "SandboxError", "message": e.message,
                                  "compile_result": None, "run_result": None,
                                  "executor_pod_name": None, "files": {}})


async def _run_code(request: web.Request) -> web.Response:
    req = parse_run_code(await request.app[BODY](request))
    resp = await call_backend(request.app[CALLS]).call(req)
    return web.json_response(run_code_json(resp))


async def _languages(request: web.Request) -> web.Response:
    return web.json_response(call_backend(request.app[CALLS]).languages())


def fusion_app(backends: Any, keys: ApiKeys, read_body: Any,
               max_body: int) -> web.Application:
    """The SandboxFusion listener's application: ``POST /run_code`` (and ``GET
    /v1/fncalls/languages``), every request checked against ``keys`` (see
    :func:`fusion_key`); ``read_body(request)`` reads a JSON body (the API's, with its
    bounds)."""
    app = web.Application(middlewares=[_fusion_errors], client_max_size=max_body)
    app[CALLS] = backends
    app[KEYS] = keys
    app[BODY] = read_body
    app.router.add_post("/run_code", _run_code)
    app.router.add_get("/v1/fncalls/languages", _languages)
    return app


__all__ = ["call_backend", "fusion_app", "fusion_key", "parse_call", "parse_run_code",
           "response_json", "run_code_json"]
