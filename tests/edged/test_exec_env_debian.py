"""An exec's environment in a real Debian sandbox, through the daemon (issue 9, item 10): what
a login shell would have (sbx-init's defaults, ``csrc/sbx-init/child.c``), from the uid's
entry in the image's own ``/etc/passwd``, overridden by the sandbox's env and then the exec's;
``TERM`` on a PTY.

The sandbox is the Debian rootfs the tests share (``scripts/rootfs.sh``: bookworm minbase with
python3), built into a layer once per module."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edged.client import Sandbox
from tests.edged.test_e2e_container import layer_store, real_node  # noqa: F401

pytestmark = [pytest.mark.root, pytest.mark.mount]

ROOTFS_TAR = Path("/var/cache/edged-test/debian-rootfs.tar")
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture(scope="module")
def debian(layer_store) -> str:  # noqa: F811
    from layerfs.build import build_layer
    from layerfs.store import Store

    if not ROOTFS_TAR.exists():
        pytest.skip(f"{ROOTFS_TAR} missing: run scripts/rootfs.sh")
    return build_layer(str(ROOTFS_TAR), kind="base", store=Store(layer_store[0])).digest


def _env(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.replace("\r\n", "\n").splitlines()
                if "=" in line)


def _pty_env(socket: str, sandbox_id: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` run on a PTY over the exec WebSocket (the SDK has no PTY exec)."""
    import aiohttp

    async def main() -> tuple[str, dict]:
        out, end = "", {}
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket)) as s,
            s.ws_connect(f"http://edged/v1/sandboxes/{sandbox_id}/exec/ws") as ws,
        ):
            await ws.send_json({"argv": ["env"], "pty": True, "env": env})
            async for msg in ws:
                ev = msg.json()
                out += ev.get("stdout", "")
                if "end" in ev or "error" in ev:
                    end = ev
                    break
        return out, end

    out, end = asyncio.run(asyncio.wait_for(main(), 30))
    assert end.get("end", {}).get("exit_code") == 0, (out, end)
    return _env(out)


def test_exec_env_in_a_debian_sandbox(real_node, debian) -> None:  # noqa: F811
    # Bug (issue 9, item 10): an exec's env had only what the request gave (a shell adds PWD).
    node = real_node()
    with Sandbox.create(layers=[debian], env={"LANG": "de_DE.UTF-8", "EDITOR": "vi"},
                        socket=node.socket) as sbx:
        def env(**kw) -> dict[str, str]:
            r = sbx.exec(["env"], **kw)
            assert r.ok, r
            return _env(r.stdout)

        # root: Debian's entry (root:x:0:0:root:/root:/bin/bash); the sandbox's LANG wins,
        # so LC_ALL is left out (it would override it)
        assert env() == {"PATH": LOGIN_PATH, "HOME": "/root", "USER": "root",
                         "LOGNAME": "root", "SHELL": "/bin/bash", "LANG": "de_DE.UTF-8",
                         "EDITOR": "vi"}
        # a uid with an entry (nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin)
        got = env(user=65534)
        assert (got["HOME"], got["USER"], got["LOGNAME"], got["SHELL"]) == (
            "/nonexistent", "nobody", "nobody", "/usr/sbin/nologin"), got
        # a uid without one: HOME=/ (not root's home), named by its number
        got = env(user=4242)
        assert (got["HOME"], got["USER"], got["LOGNAME"], got["SHELL"]) == (
            "/", "4242", "4242", "/bin/sh"), got
        # the exec's env over the sandbox's over the defaults
        got = env(env={"LANG": "C.UTF-8", "LC_ALL": "C", "HOME": "/work", "PATH": "/bin"})
        assert (got["LANG"], got["LC_ALL"], got["HOME"], got["PATH"], got["EDITOR"]) == (
            "C.UTF-8", "C", "/work", "/bin", "vi"), got
        assert "TERM" not in env()
        # what the defaults are for: a login-like shell finds its home and programs, and
        # Python sees a UTF-8 locale (C.UTF-8 is built into glibc)
        r = sbx.exec("cd && pwd && command -v python3 && python3 -c "
                     "'import locale; print(locale.getpreferredencoding())'",
                     env={"LANG": "C.UTF-8"})
        assert r.ok and r.stdout.split() == ["/root", "/usr/bin/python3", "UTF-8"], r
        # on a PTY: TERM, unless the exec's env gives the client's
        assert _pty_env(node.socket, sbx.id, {})["TERM"] == "xterm-256color"
        assert _pty_env(node.socket, sbx.id, {"TERM": "screen"})["TERM"] == "screen"
