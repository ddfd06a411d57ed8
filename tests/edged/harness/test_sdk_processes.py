"""The SDK additions on a real sandbox: process handles (background, stdin, iterators,
signal, kill), PTY sessions, bytes output, ordered combined output, E2B-style raising,
Modal/E2B names; and retries of a full node's 503."""

from __future__ import annotations

import threading
import time

import pytest

from edged.client import CapacityExhaustedError, CommandExitError, Sandbox

pytestmark = [pytest.mark.root, pytest.mark.mount]


def test_process_handles(deb_node, debian_layer) -> None:
    node = deb_node()
    with Sandbox.create(template=None, layers=[debian_layer[1]], socket=node.socket,
                        cpu=1.0, memory_mib=256, envs={"X": "1"}) as sbx:
        assert sbx.info["resources"]["memory_bytes"] == 256 << 20
        h = sbx.exec("cat; echo done-$X", background=True)
        assert h.exec_id is not None and not h.done
        h.write_stdin("line one\n")
        h.write_stdin(b"line two\n")
        h.close_stdin()
        r = h.wait(30)
        assert r.ok and r.stdout == "line one\nline two\ndone-1\n"
        # iterators see output as it comes, before the end
        h = sbx.exec("for i in 1 2 3; do echo $i; sleep 0.2; done", background=True)
        it = h.stdout
        assert next(it) == "1\n"
        assert "".join(it) == "2\n3\n"
        assert h.wait().stdout == "1\n2\n3\n"
        # signal and kill
        h = sbx.exec("trap 'echo got-term; exit 7' TERM; while :; do sleep 0.1; done",
                     background=True)
        time.sleep(0.5)
        h.signal("SIGTERM")
        r = h.wait(10)
        assert (r.exit_code, r.stdout) == (7, "got-term\n")
        h = sbx.exec("sleep 60", background=True)
        h.kill()
        assert h.wait(10).reason in ("signalled", "killed")
        with pytest.raises(TimeoutError):
            sbx.exec("sleep 5", background=True).wait(0.2)


def test_pty_bytes_order_and_raising(deb_node, debian_layer) -> None:
    node = deb_node()
    with Sandbox.create(layers=[debian_layer[1]], socket=node.socket) as sbx:
        p = sbx.pty(["/bin/sh", "-c", "read x; stty size; read y; echo got:$y; stty size"],
                    rows=30, cols=100)
        p.write_stdin("first\n")
        seen = ""
        for chunk in p.stdout:  # the first size printed before the resize (a loaded node
            seen += chunk       # took longer than a fixed sleep)
            if "30 100" in seen:
                break
        p.resize(40, 120)
        p.write_stdin("hello\n")
        out = p.wait(30).stdout  # 10 s ran out once with the suite at nice 5, load 36
        assert "30 100" in out and "got:hello" in out and "40 120" in out
        # bytes as written; text with replacement characters
        r = sbx.exec(["printf", "\\377\\000ok"])
        assert r.stdout_bytes == b"\xff\x00ok" and r.stdout == "\ufffd\x00ok"
        # stdout and stderr in the order they came
        r = sbx.exec("echo 1; sleep 0.1; echo 2 >&2; sleep 0.1; echo 3")
        assert r.output == [("stdout", "1\n"), ("stderr", "2\n"), ("stdout", "3\n")]
        assert r.combined == "1\n2\n3\n" and r.returncode == 0
        # E2B's commands.run raises on a non-zero exit; exec does not unless asked
        with pytest.raises(CommandExitError) as ei:
            sbx.commands.run("echo out; echo err >&2; exit 5")
        assert (ei.value.exit_code, ei.value.stdout, ei.value.stderr) == (5, "out\n", "err\n")
        assert sbx.exec("exit 5").exit_code == 5
        assert sbx.commands.run("exit 5", check=False).exit_code == 5
        with pytest.raises(CommandExitError):
            sbx.exec("exit 1", check=True)
        assert sbx.exec("id -u", user="root").stdout == "0\n"


def test_503_is_retried_until_capacity_frees(make_node) -> None:
    node = make_node(max_sandboxes=1, retry_after_s=1.0)
    first = Sandbox.create(layers=[sorted(__import__("tests.edged.conftest",
                                                     fromlist=["LAYERS"]).LAYERS)[0]],
                           socket=node.socket)
    layer = first.info["layers"][0]
    threading.Timer(1.5, first.kill).start()
    t0 = time.monotonic()
    second = Sandbox.create(layers=[layer], socket=node.socket)  # waits out the 503s
    assert time.monotonic() - t0 >= 1.0
    from edged.client._http import Transport

    t = Transport(node.socket, retries=0)
    with pytest.raises(CapacityExhaustedError) as ei:
        t.json("POST", "/v1/sandboxes", {"layers": [layer]})
    assert ei.value.retry_after == 1.0
    assert Transport(node.socket, backoff_s=0.1).retry_wait(2, None) <= 0.6
    second.kill()
