"""The unmodified e2b SDK (pinned in the test extra) against edged's E2B-compatible listener
on loopback, end to end: create, commands (foreground, background + wait, on_stdout, stdin,
kill), PTY (typed into, resized), files (write, read, list, exists, remove, rename, make_dir,
watch_dir), Sandbox.list, kill,
set_timeout, pause/connect; and what it must refuse (no key, a wrong key, another key's
sandbox, a wrong access token)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

e2b = pytest.importorskip("e2b")

pytestmark = [pytest.mark.root, pytest.mark.mount]

KEY_A = "team-a-0123456789abcdef"
KEY_B = "team-b-fedcba9876543210"


@pytest.fixture
def e2b_node(deb_node, debian_layer, tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text(f"a {KEY_A}\nb {KEY_B}\n")
    keys.chmod(0o600)
    node = deb_node(e2b_listen="127.0.0.1:0", api_keys_file=str(keys))
    node.server.manager.images.put("debian:latest", [debian_layer[1]])
    host, port = node.server.e2b.bound[0]
    url = f"http://{host}:{port}"
    for k, v in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url), ("E2B_API_KEY", KEY_A)):
        monkeypatch.setenv(k, v)  # the drop-in: three environment variables
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    return node, url


def test_e2b_sdk_end_to_end(e2b_node) -> None:
    from e2b import CommandExitException, Sandbox

    node, _ = e2b_node
    sbx = Sandbox.create(template="debian", timeout=120, metadata={"run": "t1"},
                         envs={"GREETING": "hi"})
    try:
        # foreground, with the sandbox's env and a streamed callback
        seen: list[str] = []
        r = sbx.commands.run("echo $GREETING; echo err >&2; pwd", on_stdout=seen.append)
        assert (r.exit_code, r.stdout, r.stderr) == (0, "hi\n/root\n", "err\n")
        assert "".join(seen) == "hi\n/root\n"
        assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        with pytest.raises(CommandExitException) as ei:
            sbx.commands.run("exit 3")
        assert ei.value.exit_code == 3
        # background + wait, listed while it runs, output after reconnecting
        h = sbx.commands.run("sleep 0.5; echo done", background=True)
        assert any(p.pid == h.pid for p in sbx.commands.list())
        res = h.wait()
        assert res.stdout == "done\n" and res.exit_code == 0
        # stdin and kill
        h = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "piped\n")
        sbx.commands.close_stdin(h.pid)
        assert h.wait().stdout == "piped\n"
        h = sbx.commands.run("sleep 60", background=True)
        assert sbx.commands.kill(h.pid)
        with pytest.raises(CommandExitException):
            h.wait()
        # files
        info = sbx.files.write("/root/dir/sub/hello.txt", "hello files")
        assert info.path == "/root/dir/sub/hello.txt"
        assert sbx.files.read("/root/dir/sub/hello.txt") == "hello files"
        sbx.files.write("/root/dir/bin.dat", b"\x00\xff\x01")
        assert sbx.files.read("/root/dir/bin.dat", format="bytes") == b"\x00\xff\x01"
        names = sorted(e.name for e in sbx.files.list("/root/dir"))
        assert names == ["bin.dat", "sub"]
        assert sbx.files.exists("/root/dir/bin.dat")
        sbx.files.rename("/root/dir/bin.dat", "/root/dir/moved.dat")
        sbx.files.remove("/root/dir/moved.dat")
        assert not sbx.files.exists("/root/dir/moved.dat")
        assert sbx.files.make_dir("/root/newdir") is True
        assert sbx.files.make_dir("/root/newdir") is False
        assert sbx.commands.run("cat /root/dir/sub/hello.txt").stdout == "hello files"
        # listing, timeout
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        sbx.set_timeout(600)
        rec = node.server.manager.get(sbx.sandbox_id)
        assert rec.expires_at - time.time() > 500
        # pause and connect (resumes); the files survive
        sbx.pause()
        assert node.server.manager.get(sbx.sandbox_id).state.value == "paused"
        again = Sandbox.connect(sbx.sandbox_id)
        assert node.server.manager.get(sbx.sandbox_id).state.value == "running"
        assert again.files.read("/root/dir/sub/hello.txt") == "hello files"
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    with pytest.raises(KeyError):
        node.server.manager.get(sbx.sandbox_id)


def _req(url: str, method: str = "GET", headers: dict | None = None, body: bytes | None = None):
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_keys_and_tokens_are_enforced(e2b_node) -> None:
    from e2b import Sandbox

    node, url = e2b_node
    assert _req(url + "/v2/sandboxes")[0] == 401
    assert _req(url + "/v2/sandboxes", headers={"X-API-Key": KEY_A + "x"})[0] == 401
    sbx = Sandbox.create(template="debian")
    try:
        # another key's client sees nothing of it
        status, body = _req(url + "/v2/sandboxes", headers={"X-API-Key": KEY_B})
        assert status == 200 and json.loads(body) == []
        assert _req(f"{url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": KEY_B})[0] == 404
        assert _req(f"{url}/sandboxes/{sbx.sandbox_id}", method="DELETE",
                    headers={"X-API-Key": KEY_B})[0] == 404
        # envd without the sandbox's token
        h = {"E2b-Sandbox-Id": sbx.sandbox_id}
        assert _req(url + "/health", headers=h)[0] == 401
        assert _req(url + "/health", headers={**h, "X-Access-Token": "0" * 64})[0] == 401
        assert _req(url + "/files?path=/etc/passwd", headers={
            "E2b-Sandbox-Id": "sbx-not-ours", "X-Access-Token": "x"})[0] == 502
        # the node's own sandboxes are not E2B's
        assert node.server.manager.find({"e2b": "1"})[0].id == sbx.sandbox_id
        # an unknown template
        status, body = _req(url + "/v2/sandboxes", "POST", {"X-API-Key": KEY_A,
                            "Content-Type": "application/json"}, b'{"templateID": "nope"}')
        assert status == 404 and b"nope" in body
    finally:
        sbx.kill()


def test_listener_refuses_to_start_without_keys(deb_node, tmp_path) -> None:
    from edged.errors import EdgedError

    bad = tmp_path / "keys"
    bad.write_text("# nothing\n")
    bad.chmod(0o600)
    with pytest.raises(EdgedError, match="no key"):
        deb_node(e2b_listen="127.0.0.1:0", api_keys_file=str(bad))


def test_e2b_sdk_pty_and_watch(e2b_node, monkeypatch) -> None:
    """A PTY (bash on a terminal, typed into, resized) and a directory watcher through the
    unmodified SDK, its listings slow (a loaded node)."""
    from e2b import FilesystemEventType, PtySize, Sandbox

    node, _ = e2b_node
    mgr = node.server.manager
    list_dir = mgr.list_dir

    async def slow_list_dir(*a, **kw):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.5)
        return await list_dir(*a, **kw)

    monkeypatch.setattr(mgr, "list_dir", slow_list_dir)
    sbx = Sandbox.create(template="debian", timeout=120)
    try:
        h = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(h.pid, b"stty size; echo sum=$((6*7))\nexit 0\n")
        seen: list[bytes] = []
        h.wait(on_pty=seen.append)
        out = b"".join(seen)
        assert b"30 100" in out and b"sum=42" in out, out[-500:]
        sbx.files.make_dir("/root/w")
        sbx.files.write("/root/w/old.txt", "0")
        w = sbx.files.watch_dir("/root/w")
        # what is changed once watch_dir has returned is told (a poll every 0.2 s: a file
        # made and removed within one poll is not seen, so each step waits for its event)
        sbx.files.write("/root/w/x.txt", "1")
        kinds = _watch_until(w, ("x.txt", FilesystemEventType.CREATE))
        assert ("old.txt", FilesystemEventType.CREATE) not in kinds, kinds
        sbx.commands.run("rm /root/w/x.txt; echo more >> /root/w/old.txt")
        kinds = _watch_until(w, ("x.txt", FilesystemEventType.REMOVE),
                             ("old.txt", FilesystemEventType.WRITE))
        w.stop()
    finally:
        sbx.kill()


def _watch_until(w, *wanted, timeout_s: float = 15.0) -> list:
    """(name, type) of a watch handle's events until every one ``wanted`` came."""
    kinds: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(k in kinds for k in wanted):
        time.sleep(0.2)
        kinds += [(e.name, e.type) for e in w.get_new_events()]
    assert all(k in kinds for k in wanted), (wanted, kinds)
    return kinds
