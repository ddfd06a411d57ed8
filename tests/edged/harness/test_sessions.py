"""Shell sessions in real sandboxes: state that persists between runs, ends found whatever
the output says, per-run timeouts and output limits, several sessions at once, and the bad
cases (a killed shell, a command that never ends, a busy session, a client gone mid-run)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import time

import pytest

from edged.client import ConflictError, InvalidStateError, NotFoundError, Sandbox
from edged.node.sessions import _Splitter, bootstrap, encode_command

pytestmark = [pytest.mark.root, pytest.mark.mount]


def _sbx(node, digest: str, **kw) -> Sandbox:
    return Sandbox.create(layers=[digest], socket=node.socket, cpus=1.0,
                          memory_bytes=512 << 20, **kw)


def test_bash_state_persists(deb_node, debian_layer) -> None:
    node = deb_node()
    with _sbx(node, debian_layer[1]) as sbx, sbx.session() as s:
        assert s.shell == "/bin/bash"
        assert s.run("cd /tmp && X=41 && export Y=yes").ok
        assert s.run("f() { echo \"f:$1:$((X+1))\"; }").ok
        r = s.run("pwd; f arg; echo $Y; echo $BASH_VERSION | cut -c1")
        assert r.ok and r.stdout.splitlines() == ["/tmp", "f:arg:42", "yes", "5"]
        assert r.stderr == ""
        # the previous status is $? of the next run; stderr kept apart; no newline added
        r = s.run("false")
        assert (r.reason, r.exit_code) == ("exited", 1)
        r = s.run("echo $?; printf 'no newline' >&2; exit_status=7; (exit 7)")
        assert (r.stdout, r.stderr, r.exit_code) == ("1\n", "no newline", 7)
        # multi-line commands, unbalanced quotes (a syntax error, not a hang), backslashes
        r = s.run("for i in 1 2; do\n  echo \"l$i\\\\n\"\ndone")
        assert r.stdout == "l1\\n\nl2\\n\n"
        r = s.run("echo 'unterminated")
        assert r.reason == "exited" and r.exit_code == 2 and "unexpected EOF" in r.stderr
        assert s.run("echo still here").stdout == "still here\n"
        # a command reading stdin gets EOF, not the session's channel
        r = s.run("cat; echo after-cat")
        assert r.stdout == "after-cat\n"
        assert s.refresh()["runs"] == 9


def test_sh_fallback_and_output_that_looks_like_an_end(real_node, layer_store) -> None:
    """busybox has no bash: the session is sh. Output holding marker bytes and old nonces
    is output, not an end."""
    node = real_node()
    with _sbx(node, layer_store[1]) as sbx:
        s = sbx.session()
        assert s.shell == "/bin/sh"
        assert s.run("cd /etc; V=3").ok
        assert s.run("pwd; echo $V").stdout == "/etc\n3\n"
        fake = "\\036" + "0" * 32 + "\\036" + "\\036" + "0" * 32 + " 0\\036"
        r = s.run(f"printf '{fake}'; printf '{fake}' >&2; sleep 0.2; echo real-end")
        assert r.ok and r.stdout.endswith("real-end\n") and "\x1e" + "0" * 32 in r.stdout
        assert "\x1e" in r.stderr
        assert sbx.session(shell="sh").shell == "/bin/sh"
        with pytest.raises(Exception, match="no shell"):
            sbx.session(shell="bash")


def test_timeout_output_limit_and_the_session_goes_on(deb_node, debian_layer) -> None:
    node = deb_node()
    with _sbx(node, debian_layer[1]) as sbx, sbx.session() as s:
        s.run("cd /tmp")
        t0 = time.monotonic()
        r = s.run("echo before; sleep 30; echo never", timeout=0.5)
        assert r.reason == "timeout" and r.stdout == "before\n"
        assert time.monotonic() - t0 < 5
        assert s.run("pwd").stdout == "/tmp\n"  # the shell and its state survived
        r = s.run("yes | head -c 1000000", output_limit=1000)
        assert r.reason == "output_limit" and len(r.stdout) == 1000
        assert s.run("echo ok").stdout == "ok\n"
        # a run that outlives the first 3 s of interrupts (a shell a loaded host had not yet
        # let start its command got all six within 3 s, and the session was killed) but ends
        # within the ~10 s they last keeps its session
        t0 = time.monotonic()
        r = s.run("trap '' INT TERM; sleep 4; echo late", timeout=0.3)
        assert r.reason == "timeout" and not r.raw_end.get("session_ended"), r.raw_end
        assert time.monotonic() - t0 > 3.5
        assert s.run("pwd").stdout == "/tmp\n"
        # a command that ignores SIGINT and SIGTERM costs the session, typed
        r = s.run("trap '' INT TERM; while :; do :; done", timeout=0.3)
        assert r.reason == "timeout" and r.raw_end["session_ended"] is True
        with pytest.raises(InvalidStateError, match="has ended"):
            s.run("echo gone")


def test_killed_shell_ends_the_session_typed(deb_node, debian_layer) -> None:
    node = deb_node()
    with _sbx(node, debian_layer[1]) as sbx:
        s = sbx.session()
        r = s.run("kill -9 $$")
        assert r.reason == "session_ended" and r.raw_end["session_ended"]
        assert s.refresh()["state"] == "ended"
        with pytest.raises(InvalidStateError):
            s.run("true")
        # another session killed from outside, between runs (an exec cannot signal
        # another exec's processes: Landlock scopes signals per exec)
        s2 = sbx.session()
        assert s2.info["pid"] > 1
        assert sbx.kill_processes() >= 1
        deadline = time.monotonic() + 5
        while s2.refresh()["state"] != "ended" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s2.info["state"] == "ended"
        # `exit 3` ends it with the shell's status
        s3 = sbx.session()
        r = s3.run("exit 3")
        assert (r.reason, r.exit_code) == ("session_ended", 3)
        # sessions and their end are listed; closing forgets them
        assert [x.id for x in sbx.sessions()] == [s.id, s2.id, s3.id]
        s.close()
        s.close()  # idempotent
        assert [x.id for x in sbx.sessions()] == [s2.id, s3.id]


def test_sessions_run_side_by_side_and_one_run_at_a_time(deb_node, debian_layer) -> None:
    node = deb_node()
    with _sbx(node, debian_layer[1]) as sbx:
        a, b = sbx.session(id="a"), sbx.session(id="b")
        with pytest.raises(ConflictError):
            sbx.session(id="a")
        a.run("cd /tmp")
        b.run("cd /etc")
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            fa = ex.submit(a.run, "sleep 1; pwd")
            fb = ex.submit(b.run, "sleep 1; pwd")
            time.sleep(0.3)
            with pytest.raises(ConflictError, match="in progress"):
                a.run("true")
            assert (fa.result().stdout, fb.result().stdout) == ("/tmp\n", "/etc\n")
        with pytest.raises(NotFoundError):
            Sandbox.connect(sbx.id, socket=node.socket).session(id="x").close() or \
                sbx._t.json("GET", f"/v1/sandboxes/{sbx.id}/sessions/nope")


def test_client_gone_mid_run_interrupts_it(deb_node, debian_layer) -> None:
    node = deb_node()
    with _sbx(node, debian_layer[1]) as sbx, sbx.session() as s:
        s.run("cd /work 2>/dev/null || cd /tmp")
        conn = http.client.HTTPConnection("localhost")
        conn.sock = socket.socket(socket.AF_UNIX)
        conn.sock.connect(node.socket)
        conn.request("POST", f"/v1/sandboxes/{sbx.id}/sessions/{s.id}/run",
                     json.dumps({"cmd": "sleep 60; echo late"}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert json.loads(resp.readline())["start"]["session"] == s.id
        t0 = time.monotonic()
        conn.sock.shutdown(socket.SHUT_RDWR)  # gone for good (close() leaves the fd to GC)
        conn.close()
        deadline = time.monotonic() + 10
        while True:  # the interrupted run lets go of the session
            try:
                r = s.run("echo next; grep -lx sleep /proc/[0-9]*/comm 2>/dev/null | wc -l")
                break
            except ConflictError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.stdout == "next\n0\n"  # no sleep left running
        assert time.monotonic() - t0 < 10


def test_splitter_holds_back_a_marker_split_across_chunks() -> None:
    nonce = b"ab" * 16
    sp = _Splitter(nonce, with_status=True)
    data = b"out\x1e" + nonce + b" 17\x1e"
    got = b"".join(sp.feed(data[i:i + 1]) for i in range(len(data)))
    assert got == b"out" and sp.done and sp.status == 17
    sp = _Splitter(nonce, with_status=False)
    assert sp.feed(b"x\x1eab") == b"x"  # could be a marker: held back
    assert sp.feed(b"zz") == b"\x1eabzz"  # was not
    assert sp.feed(b"\x1e" + nonce + b"\x1etail") == b"" and sp.done


def test_encoding_round_trips_through_printf() -> None:
    import subprocess

    for cmd in ("echo a\\nb", "x\n\ny", "\\\\\\", "tab\tend", "é ü", "\\c stop", "%s %b"):
        line = encode_command(cmd).rstrip(b"\n")
        for shell in ("bash", "sh"):
            out = subprocess.run([shell, "-c", 'printf "%b." "$1"', "x", line.decode()],
                                 capture_output=True, check=True).stdout
            assert out[:-1] == cmd.encode(), (shell, cmd, out)
    assert "printf -v" in bootstrap(True) and "printf -v" not in bootstrap(False)
    with pytest.raises(ValueError, match="NUL"):
        encode_command("a\0b")


def test_client_gone_before_the_first_event_frees_the_session(deb_node, debian_layer) -> None:
    node = deb_node()
    with _sbx(node, debian_layer[1]) as sbx, sbx.session() as s:
        for _ in range(5):  # a request whose client is gone before any answer
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(node.socket)
            body = json.dumps({"cmd": "sleep 30"}).encode()
            sock.sendall(f"POST /v1/sandboxes/{sbx.id}/sessions/{s.id}/run HTTP/1.1\r\n"
                         f"Host: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            deadline = time.monotonic() + 15
            while True:
                try:
                    assert s.run("echo free").stdout == "free\n"
                    break
                except ConflictError:
                    assert time.monotonic() < deadline, "the session stayed busy"
                    time.sleep(0.1)
        deadline = time.monotonic() + 10  # (the last run's end reaches us a moment first)
        while node.server.manager.get(sbx.id).active_execs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.server.manager.get(sbx.id).active_execs == 0
