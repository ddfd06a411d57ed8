"""The E2B-compatible listener (``edged serve --e2b-listen HOST:PORT --api-keys-file F``):
the unmodified ``e2b`` SDK drives edged's sandboxes with three environment variables::

    E2B_API_URL=http://HOST:PORT E2B_SANDBOX_URL=http://HOST:PORT E2B_API_KEY=<a key>

One TCP port serves both of E2B's APIs: a request carrying ``E2b-Sandbox-Id`` (which the
SDK sends to ``E2B_SANDBOX_URL``) goes to that sandbox's envd (:mod:`.envd`), any other to
the control API (:mod:`.rest`). Off by default; never without a keys file.

Who may do what: a control request needs a key of the keys file (``X-API-Key``,
:mod:`edged.security.apikeys`; 401 otherwise), and sees only the sandboxes created with that
key (its id owns them; others are 404), none of the node's other sandboxes. An envd request
needs the sandbox's access token (``X-Access-Token``, handed out at create and connect):
``HMAC-SHA256(listener secret, sandbox id)``, compared in constant time; the secret is made
once in ``<state_dir>/e2b/secret`` (0600), so tokens hold across daemon restarts. What the
listener keeps of each sandbox (owner, template, metadata) is in ``<state_dir>/e2b/<id>.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from aiohttp import web

from edged.compat.e2b import rest
from edged.compat.e2b.envd import Envd
from edged.compat.e2b.state import SANDBOX, STATE, TEAM, E2bState, Handler
from edged.errors import BadRequest, EdgedError
from edged.node.manager import SandboxManager
from edged.security.apikeys import ApiKeys, presented_key

log = logging.getLogger("edged.compat")

MAX_BODY = 64 << 20


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


@web.middleware
async def dispatch(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Authenticate, then route envd requests (``E2b-Sandbox-Id``) to envd."""
    st = request.app[STATE]
    sid = request.headers.get("E2b-Sandbox-Id")
    if sid is not None:
        meta = st.meta.get(sid)
        presented = request.headers.get("X-Access-Token", "")
        ok = hmac.compare_digest(st.token(sid).encode(), presented.encode("utf-8", "replace"))
        if meta is None:
            return _json_error(502, f"sandbox {sid} not found")  # as E2B's proxy answers
        if not ok:
            return _json_error(401, "invalid or missing X-Access-Token")
        try:
            st.manager.get(sid)
        except EdgedError:
            st.forget(sid)
            return _json_error(502, f"sandbox {sid} not found")
        request[SANDBOX] = sid
        route = st.envd_routes.get((request.method, request.path))
        if route is None:
            return _json_error(404, f"{request.method} {request.path}: no such envd route")
        return await _guard(route, request)
    team = st.keys.check(presented_key(request.headers))
    if team is None:
        return _json_error(401, "invalid or missing API key (X-API-Key)")
    request[TEAM] = team
    return await _guard(handler, request)


async def _guard(handler: Handler, request: web.Request) -> web.StreamResponse:
    """Typed errors as E2B's error body; anything else a logged 500."""
    try:
        return await handler(request)
    except EdgedError as e:
        return _json_error(e.status, e.message)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except ConnectionError:
        return web.Response(status=499)
    except Exception as e:
        log.exception("e2b listener: %s %s", request.method, request.path)
        return _json_error(500, f"internal error: {type(e).__name__}: {e}")


def make_app(manager: SandboxManager, keys: ApiKeys, state_dir: str) -> web.Application:
    """The listener's aiohttp application."""
    app = web.Application(middlewares=[dispatch], client_max_size=MAX_BODY)
    st = app[STATE] = E2bState(manager, keys, state_dir)
    envd = Envd(st)
    st.envd_routes = {(m, p): h for m, p, h in envd.routes()}
    st.on_forget.append(envd.forget)
    # (envd's routes are dispatched by the middleware, on the E2b-Sandbox-Id header)
    for m, p, h in rest.routes():
        app.router.add_route(m, p, h)
    return app


class Listener:
    """The TCP listener, started and stopped with the daemon."""

    def __init__(self, manager: SandboxManager, listen: str, keys_file: str,
                 state_dir: str) -> None:
        """Raises BadRequest for a bad ``HOST:PORT`` or keys file (no key, no listener)."""
        self.host, self.port = parse_listen(listen)
        if not keys_file:
            raise BadRequest("e2b_listen needs api_keys_file: no key, no listener")
        self.keys = ApiKeys(keys_file)
        self.app = make_app(manager, self.keys, state_dir)
        self._runner: web.AppRunner | None = None
        self._prune: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, handle_signals=False, access_log=None,
                                     shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self._prune = asyncio.ensure_future(self._prune_forever())
        log.info("e2b listener", extra={"listen": f"{self.host}:{self.port}",
                                        "keys": len(self.keys.ids)})

    @property
    def bound(self) -> list[tuple[str, int]]:
        """Addresses actually bound (a port 0 becomes a free port)."""
        out = []
        if self._runner is not None:
            for s in self._runner.sites:
                server = getattr(s, "_server", None)
                for sock in getattr(server, "sockets", None) or []:
                    out.append(sock.getsockname()[:2])
        return out

    async def _prune_forever(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            self.app[STATE].prune()

    async def stop(self) -> None:
        if self._prune is not None:
            self._prune.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prune
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def parse_listen(v: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) → (host, port). Raises BadRequest."""
    host, sep, port = v.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise BadRequest(f"e2b_listen {v!r}: must be HOST:PORT")
    if ":" in host:
        if not (host.startswith("[") and host.endswith("]")):
            raise BadRequest(f"e2b_listen {v!r}: an IPv6 host goes in brackets")
        host = host[1:-1]
    return host, int(port)


__all__ = ["Listener", "make_app", "parse_listen"]
