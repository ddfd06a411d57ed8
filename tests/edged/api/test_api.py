"""The /v1 API end to end through a real daemon over the test-double backend; every response
is checked against openapi.json (speccheck.Api)."""

from __future__ import annotations

import base64
import json
import time

import pytest

from tests.edged.api.speccheck import Api
from tests.edged.execs import PATIENCE_S
from tests.edged.fakes import digest

L1, L2, L3 = digest(1), digest(2), digest(3)


@pytest.fixture
def api(node) -> Api:
    return Api(node.socket)


def create(api: Api, **body) -> dict:
    body.setdefault("layers", [L1])
    r = api.post("/v1/sandboxes", body)
    assert r.status == 201, r.body
    return r.json()


def exec_(api: Api, sid: str, **body) -> tuple[str, str, dict]:
    r = api.post(f"/v1/sandboxes/{sid}/exec", body)
    assert r.status == 200, r.body
    assert "start" in r.lines[0] and "end" in r.lines[-1]
    assert sum("end" in x for x in r.lines) == 1
    out = "".join(x.get("stdout", "") for x in r.lines)
    err = "".join(x.get("stderr", "") for x in r.lines)
    return out, err, r.lines[-1]["end"]


def test_lifecycle(api: Api, node) -> None:
    s = create(api, id="box-1", labels={"task": "t1"}, env={"A": "1"})
    assert s["state"] == "running" and s["id"] == "box-1" and s["layers"] == [L1]
    assert node.backend.specs["box-1"].lowers == (str(node.server.manager.layers.mountpoint(L1)),)
    assert api.get("/v1/sandboxes/box-1").json()["labels"] == {"task": "t1"}
    assert api.post("/v1/sandboxes/box-1/pause").json()["state"] == "paused"
    assert api.post("/v1/sandboxes/box-1/resume").json()["state"] == "running"
    r = api.delete("/v1/sandboxes/box-1")
    assert r.status == 200 and r.json()["state"] == "stopped"
    assert api.get("/v1/sandboxes/box-1").status == 404
    assert node.backend.destroyed == ["box-1"]
    assert node.layer_ops.mounted == {}  # last user gone: layer unmounted


@pytest.mark.parametrize(
    ("first", "op", "path"),
    [
        ("pause", "POST", "pause"),  # pause a paused sandbox
        (None, "POST", "resume"),  # resume a running one
    ],
)
def test_wrong_state(api: Api, first, op, path) -> None:
    create(api, id="s")
    if first:
        api.post(f"/v1/sandboxes/s/{first}")
    if op == "PUT":
        r = api.put("/v1/sandboxes/s/files?path=/x", b"data")
    else:
        r = api.post(f"/v1/sandboxes/s/{path}", {"cmd": "true"} if path == "exec" else {})
    assert r.status == 409
    assert r.json()["error"]["code"] == "invalid_state"
    assert "cannot" in r.json()["error"]["message"]


@pytest.mark.parametrize("op", ["exec", "put_file", "get_file", "signal"])
def test_request_to_paused_sandbox_resumes_it(api: Api, node, op: str) -> None:
    """Any request to a paused sandbox resumes it transparently (DSec §5.2): the request
    succeeds and the sandbox is running again."""
    create(api, id="s")
    api.put("/v1/sandboxes/s/files?path=/x", b"data")
    assert api.post("/v1/sandboxes/s/pause").json()["state"] == "paused"
    assert node.backend.paused == {"s"}
    if op == "exec":
        r = api.post("/v1/sandboxes/s/exec", {"cmd": "echo hi"})
        assert r.status == 200 and r.lines[-1]["end"]["exit_code"] == 0
    elif op == "put_file":
        assert api.put("/v1/sandboxes/s/files?path=/y", b"more").status == 200
    elif op == "get_file":
        r = api.get("/v1/sandboxes/s/files?path=/x")
        assert r.status == 200 and r.body == b"data"
    else:
        assert api.post("/v1/sandboxes/s/signal", {"signal": "SIGTERM"}).status == 200
    assert api.get("/v1/sandboxes/s").json()["state"] == "running"
    assert node.backend.paused == set()


def test_errors_have_one_shape(api: Api) -> None:
    cases = [
        (api.get("/v1/sandboxes/nope"), 404, "not_found"),
        (api.post("/v1/sandboxes", {"layers": ["sha256:xyz"]}), 400, "bad_request"),
        (api.post("/v1/sandboxes", {"layers": [L1], "id": "Bad_ID"}), 400, "bad_request"),
        (api.post("/v1/sandboxes", {"layers": [L1], "image": "a:b"}), 400, "bad_request"),
        (api.post("/v1/sandboxes", {"layers": [L1], "network": "host"}), 400, "bad_request"),
        (api.post("/v1/sandboxes", {"layers": [L1], "resources": {"cpus": -1}}), 400,
         "bad_request"),
        (api.post("/v1/sandboxes", {"layers": [L1], "bogus": 1}), 400, "bad_request"),
        (api.post("/v1/sandboxes", {"image": "missing:1"}), 404, "not_found"),
        (api.post("/v1/sandboxes", {"layers": [digest(99)]}), 404, "not_found"),
        (api.request("POST", "/v1/sandboxes", raw=b"{not json",), 400, "bad_request"),
    ]
    for r, status, code in cases:
        assert r.status == status, r.body
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
        assert body["error"]["code"] == code
    r = api.get("/v1/nothing-here", check=False)
    assert r.status == 404 and r.json()["error"]["code"] == "not_found"


def test_bad_input_leaves_nothing(api: Api, node) -> None:
    api.post("/v1/sandboxes", {"layers": [L1, digest(99)], "id": "half"})
    node.backend.fail_create.add("boom")
    r = api.post("/v1/sandboxes", {"layers": [L1, L2], "id": "boom"})
    assert r.status == 500 and r.json()["error"]["code"] == "backend_error"
    assert "injected" in r.json()["error"]["message"]
    assert api.get("/v1/sandboxes").json()["sandboxes"] == []
    assert node.layer_ops.mounted == {}
    assert node.backend.live == {}
    info = api.get("/v1/node").json()
    assert info["allocated"] == {"cpus": 0, "memory_bytes": 0, "memory_request_bytes": 0,
                                 "sandboxes": 0}
    assert not list((node.server.manager.records_dir).glob("*.json"))


def test_duplicate_id_conflict(api: Api) -> None:
    create(api, id="dup")
    r = api.post("/v1/sandboxes", {"layers": [L1], "id": "dup"})
    assert r.status == 409 and r.json()["error"]["code"] == "conflict"


def test_capacity_exhausted_with_retry_after(make_node) -> None:
    node = make_node(cpus=1.0, cpu_overcommit=2.0, memory_bytes=1 << 30, retry_after_s=2.5)
    api = Api(node.socket)
    create(api, id="a", resources={"cpus": 1.5, "memory_bytes": 256 << 20})
    r = api.post("/v1/sandboxes", {"layers": [L1], "id": "b", "resources": {"cpus": 1}})
    assert r.status == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "capacity_exhausted"
    assert "cpus" in r.json()["error"]["message"]
    # asks for more than the node's 1 GiB can hold now (admission on use, not on limits)
    big = {"cpus": 0.1, "memory_bytes": 2 << 30, "memory_request_bytes": 1 << 30}
    r = api.post("/v1/sandboxes", {"layers": [L1], "id": "c", "resources": big})
    assert r.status == 503 and "memory: need 1025.0 MiB" in r.json()["error"]["message"]
    create(api, id="d", resources={"cpus": 0.5, "memory_bytes": 256 << 20})  # still fits
    api.delete("/v1/sandboxes/a")
    create(api, id="b", resources={"cpus": 1})


def test_layers_mounted_once_and_shared(api: Api, node) -> None:
    api.post("/v1/images", {"name": "py:3", "layers": [L1, L2, L3]})
    for i in range(3):
        create(api, id=f"s{i}", layers=None, image="py:3")
    assert node.layer_ops.mount_calls == 3
    assert api.get("/v1/node").json()["layers"] == {L1: 3, L2: 3, L3: 3}
    spec = node.backend.specs["s0"]
    assert [p.rsplit("/", 1)[1] for p in spec.lowers] == [d[7:] for d in (L1, L2, L3)]
    for i in range(3):
        api.delete(f"/v1/sandboxes/s{i}")
    assert node.layer_ops.umount_calls == 3 and node.layer_ops.mounted == {}


def test_list_filter_by_label(api: Api) -> None:
    create(api, id="a", labels={"run": "1", "kind": "x"})
    create(api, id="b", labels={"run": "1"})
    create(api, id="c", labels={"run": "2"})
    ids = lambda q: [s["id"] for s in api.get("/v1/sandboxes" + q).json()["sandboxes"]]  # noqa: E731
    assert ids("") == ["a", "b", "c"]
    assert ids("?label=run=1") == ["a", "b"]
    assert ids("?label=run=1&label=kind=x") == ["a"]
    assert api.get("/v1/sandboxes?label=run").status == 400


def test_exec_streams_and_exit_codes(api: Api) -> None:
    create(api, id="e", env={"FOO": "sandbox", "BAR": "b"})
    out, err, end = exec_(api, "e", cmd="echo $FOO $BAR; echo oops >&2; exit 7",
                          env={"BAR": "exec"})
    assert (out, err) == ("sandbox exec\n", "oops\n")
    assert end["reason"] == "exited" and end["exit_code"] == 7 and end["signal"] is None
    out, _, end = exec_(api, "e", argv=["printf", "%s|", "a b", "c"])
    assert out == "a b|c|" and end["exit_code"] == 0
    _, _, end = exec_(api, "e", cmd="kill -9 $$")
    assert end["reason"] == "signalled" and end["signal"] == 9 and end["exit_code"] is None
    out, _, _ = exec_(api, "e", cmd="cat", stdin="fed\n")
    assert out == "fed\n"


def test_exec_binary_output_base64(api: Api) -> None:
    create(api, id="b64")
    r = api.post("/v1/sandboxes/b64/exec", {"argv": ["printf", "\\377\\000\\001"],
                                           "encoding": "base64"})
    data = b"".join(base64.b64decode(x["stdout"]) for x in r.lines if "stdout" in x)
    assert data == b"\xff\x00\x01"


def test_exec_timeout_keeps_partial_output(api: Api) -> None:
    create(api, id="t")
    t0 = time.monotonic()
    out, _, end = exec_(api, "t", cmd="echo before; sleep 30; echo after", timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert out == "before\n" and end["reason"] == "timeout"


def test_exec_output_limit(api: Api) -> None:
    create(api, id="o")
    out, _, end = exec_(api, "o", cmd="yes", output_limit=10000)
    assert end["reason"] == "output_limit"
    assert len(out) == 10000 and out.startswith("y\ny\n")


def test_exec_bad_requests(api: Api) -> None:
    create(api, id="x")
    for body in ({}, {"cmd": "a", "argv": ["b"]}, {"argv": []}, {"cmd": "true", "cwd": "rel"},
                 {"cmd": "true", "timeout_s": 0}, {"cmd": "true", "output_limit": -1},
                 {"cmd": "true", "encoding": "utf-16"}):
        r = api.post("/v1/sandboxes/x/exec", body)
        assert r.status == 400, body


def test_signal_running_exec(api: Api, node) -> None:
    import threading

    create(api, id="sig")
    box: dict = {}

    def run() -> None:
        box["r"] = api.post("/v1/sandboxes/sig/exec", {"cmd": "sleep 30"})

    t = threading.Thread(target=run)
    t.start()
    for _ in range(200):
        if node.server.manager.get("sig").active_execs:
            break
        time.sleep(0.01)
    assert api.post("/v1/sandboxes/sig/signal", {"signal": "TERM"}).json()["exec_ids"] == [1]
    t.join(10)
    end = box["r"].lines[-1]["end"]
    assert end["reason"] == "signalled" and end["signal"] == 15
    assert api.post("/v1/sandboxes/sig/signal", {"signal": "NOPE"}).status == 400
    assert api.post("/v1/sandboxes/sig/signal", {"exec_id": 42}).status == 404
    for bad in ({"exec_id": [1]}, {"exec_id": {"a": 1}}, {"signal": 15, "all": True},
                {"signal": 9, "all": True, "exec_id": 1}, {"signal": 9, "all": "yes"}):
        r = api.post("/v1/sandboxes/sig/signal", bad)
        assert r.status == 400 and r.json()["error"]["code"] == "bad_request", (bad, r.status)


def test_signal_all_kills_leftovers(api: Api, node) -> None:
    import threading

    create(api, id="all")
    box: dict = {}

    def run() -> None:
        box["r"] = api.post("/v1/sandboxes/all/exec", {"cmd": "sleep 30"})

    t = threading.Thread(target=run)
    t.start()
    for _ in range(200):
        if node.server.manager.get("all").active_execs:
            break
        time.sleep(0.01)
    out = api.post("/v1/sandboxes/all/signal", {"signal": 9, "all": True}).json()
    assert out == {"exec_ids": [1], "killed": 1}
    t.join(10)
    assert box["r"].lines[-1]["end"]["reason"] in ("killed", "signalled")


def test_files_roundtrip_and_escape(api: Api) -> None:
    create(api, id="f")
    data = bytes(range(256)) * 4096  # 1 MiB, several chunks
    r = api.put("/v1/sandboxes/f/files?path=/work/a.bin&mode=600", data)
    assert r.status == 200 and r.json()["bytes"] == len(data)
    r = api.get("/v1/sandboxes/f/files?path=/work/a.bin")
    assert r.status == 200 and r.body == data
    assert api.get("/v1/sandboxes/f/files?path=/missing").status == 404
    r = api.put("/v1/sandboxes/f/files?path=/../../etc/evil", b"x")
    assert r.status == 400 and r.json()["error"]["code"] == "bad_request"
    assert api.put("/v1/sandboxes/f/files?path=relative", b"x").status == 400
    assert api.put("/v1/sandboxes/f/files", b"x").status == 400
    assert api.put("/v1/sandboxes/f/files?path=/a&mode=99", b"x").status == 400


def test_images(api: Api, node) -> None:
    assert api.get("/v1/images").json() == {"images": []}
    r = api.post("/v1/images", {"name": "team/py:3.11", "layers": [L1, L2]})
    assert r.status == 201 and r.json()["layers"] == [L1, L2]
    assert api.get("/v1/images/team/py:3.11").json()["name"] == "team/py:3.11"
    assert api.post("/v1/images", {"name": "x:1", "layers": [digest(99)]}).status == 400
    assert api.post("/v1/images", {"name": "NoTag", "layers": [L1]}).status == 400
    assert [i["name"] for i in api.get("/v1/images").json()["images"]] == ["team/py:3.11"]
    # persisted across a registry reload
    reg = json.loads((node.server.manager.images.path).read_text())
    assert list(reg["images"]) == ["team/py:3.11"]
    assert api.delete("/v1/images/team/py:3.11").status == 200
    assert api.get("/v1/images/team/py:3.11").status == 404
    assert api.delete("/v1/images/team/py:3.11").status == 404


def test_timeout_ttl_and_idle_reaping(api: Api, node) -> None:
    create(api, id="ttl", ttl_s=0.3)
    # idle for 2 s, not less: at load 125 more than 0.3 s passed between its create and
    # its exec, which found it reaped already
    create(api, id="idle", idle_timeout_s=2.0)
    create(api, id="keep")
    exec_(api, "idle", cmd="true")
    r = api.post("/v1/sandboxes/keep/timeout", {"ttl_s": 60})
    assert r.json()["expires_at"] > time.time() + 50
    assert api.post("/v1/sandboxes/keep/timeout", {"bogus": 1}).status == 400
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        ids = {s["id"] for s in api.get("/v1/sandboxes").json()["sandboxes"]}
        if ids == {"keep"}:
            break
        time.sleep(0.05)
    assert ids == {"keep"}
    text = api.get("/metrics").body.decode()
    assert 'edged_sandbox_destroys_total{cause="ttl"} 1.0' in text
    assert 'edged_sandbox_destroys_total{cause="idle"} 1.0' in text


def test_paused_sandbox_not_idle_reaped(api: Api) -> None:
    create(api, id="p", idle_timeout_s=0.2)
    api.post("/v1/sandboxes/p/pause")
    time.sleep(0.6)
    assert api.get("/v1/sandboxes/p").json()["state"] == "paused"


def test_node_and_metrics(api: Api) -> None:
    create(api, id="n", resources={"cpus": 0.5, "memory_bytes": 128 << 20})
    info = api.get("/v1/node").json()
    assert info["capacity"]["cpus"] == 2.0
    assert info["allocated"] == {"cpus": 0.5, "memory_bytes": 128 << 20,
                                 "memory_request_bytes": 32 << 20, "sandboxes": 1}
    net = info["features"].pop("network")
    assert info["sandboxes"] == {"running": 1} and info["features"] == {"fake": True,
                                                                          "cgroup": "none"}
    assert net["enabled"] is False and net["reason"], net  # no cgroup v2 dir: why it is off
    exec_(api, "n", cmd="true")
    r = api.get("/metrics")
    text = r.body.decode()
    assert r.headers["content-type"].startswith("text/plain")
    assert 'edged_sandboxes{state="running"} 1.0' in text
    assert 'edged_execs_total{reason="exited"} 1.0' in text
    assert "edged_sandbox_create_seconds_count 1.0" in text


def test_stats(api: Api) -> None:
    create(api, id="st")
    assert api.get("/v1/sandboxes/st/stats").json()["memory_bytes"] == 1 << 20


def test_client_disconnect_kills_silent_exec(api: Api, node) -> None:
    import json as _json
    import socket

    create(api, id="dc")
    s = socket.socket(socket.AF_UNIX)
    s.connect(node.socket)
    body = _json.dumps({"cmd": "sleep 60"}).encode()
    s.sendall(b"POST /v1/sandboxes/dc/exec HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert b"200" in s.recv(100)
    s.close()
    deadline = time.monotonic() + PATIENCE_S  # generous: the machine may be loaded
    while node.server.manager.get("dc").active_execs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node.server.manager.get("dc").active_execs == 0
    # killed at once; its exit is collected by asyncio's child watcher thread a moment later
    while (not all(h.proc.returncode is not None for h in node.backend.procs["dc"])
           and time.monotonic() < deadline):
        time.sleep(0.01)
    assert all(h.proc.returncode is not None for h in node.backend.procs["dc"])


def test_large_json_body_read_whole(api: Api) -> None:
    """A valid body of a few MiB arrives in many reads: it is read whole, not cut at the
    first chunk (which gave "not valid JSON" for bodies over ~256 KiB); over 4 MiB is 413."""
    create(api, id="big")
    data = "x" * (3 << 20)
    out, _, end = exec_(api, "big", argv=["wc", "-c"], stdin=data)
    assert end["reason"] == "exited" and int(out) == len(data)
    r = api.post("/v1/sandboxes/big/exec", {"argv": ["wc", "-c"], "stdin": "x" * (5 << 20)},
                 check=False)
    assert r.status == 413 and r.json()["error"]["code"] == "payload_too_large", r.body[:200]


def test_numbers_validated_in_one_place(api: Api) -> None:
    """Every numeric field: finite, in its documented range, an integer where one is due;
    out of range is a 400 naming the field (these were 500s: OverflowError, struct.error)."""
    create(api, id="num")

    def bad(path: str, raw: str, field: str) -> None:
        r = api.request("POST", path, raw=raw.encode(), check=False)
        assert r.status == 400, (raw, r.status, r.body[:200])
        err = r.json()["error"]
        assert err["code"] == "bad_request" and field in err["message"], (raw, err)

    ex = "/v1/sandboxes/num/exec"
    bad(ex, '{"cmd": "true", "timeout_s": 1e400}', "timeout_s")
    bad(ex, '{"cmd": "true", "timeout_s": 1e300}', "timeout_s")
    bad(ex, '{"cmd": "true", "timeout_s": NaN}', "timeout_s")
    bad(ex, '{"cmd": "true", "output_limit": 1e23}', "output_limit")
    bad(ex, '{"cmd": "true", "output_limit": 100000000000000000000000}', "output_limit")
    bad(ex, '{"cmd": "true", "pty": "yes"}', "pty")
    bad(ex, '{"cmd": "true", "pty": true, "rows": "x", "cols": 80}', "rows")
    bad(ex, '{"cmd": "true", "pty": true, "rows": 70000, "cols": 80}', "rows")
    bad(ex, '{"cmd": "true", "env": {"A=B": "x"}}', "env")
    bad(ex, '{"cmd": "true", "env": {"": "x"}}', "env")
    bad(ex, '{"cmd": "true", "env": {"A": "x\\u0000y"}}', "env")
    cr = "/v1/sandboxes"
    bad(cr, f'{{"layers": ["{L1}"], "resources": {{"memory_bytes": 1}}}}', "memory_bytes")
    bad(cr, f'{{"layers": ["{L1}"], "resources": {{"pids": 1}}}}', "pids")
    bad(cr, f'{{"layers": ["{L1}"], "resources": {{"cpus": Infinity}}}}', "cpus")
    bad(cr, f'{{"layers": ["{L1}"], "ttl_s": NaN}}', "ttl_s")
    bad(cr, f'{{"layers": ["{L1}"], "idle_timeout_s": -Infinity}}', "idle_timeout_s")
    bad(cr, f'{{"layers": ["{L1}"], "env": {{"A=B": "x"}}}}', "env")
    bad("/v1/sandboxes/num/timeout", '{"ttl_s": Infinity}', "ttl_s")
    bad("/v1/sandboxes/num/timeout", '{"idle_timeout_s": 1e400}', "idle_timeout_s")
    # the sandbox record still serialises as valid JSON
    json.loads(api.get("/v1/sandboxes/num").body, parse_constant=lambda c: 1 / 0)


def test_sandbox_gone_records_its_cause(api: Api) -> None:
    """TTL expiry, idle timeout and delete each leave sandbox_gone with the cause; a negative
    ``since`` is a 400 (it was echoed back as ``next``)."""
    create(api, id="ttl", ttl_s=0.2)
    create(api, id="idle", idle_timeout_s=0.2)
    create(api, id="del")
    assert api.delete("/v1/sandboxes/del").status in (200, 204)
    deadline = time.monotonic() + 10
    causes: dict[str, str] = {}
    while time.monotonic() < deadline and len(causes) < 3:
        for sid in ("ttl", "idle", "del"):
            evs = api.get(f"/v1/sandboxes/{sid}/events?kind=sandbox_gone").json()["events"]
            if evs:
                causes[sid] = evs[-1]["detail"]["cause"]
        time.sleep(0.05)
    assert causes == {"ttl": "ttl", "idle": "idle", "del": "deleted"}
    r = api.get("/v1/sandboxes/ttl/events?since=-5", check=False)
    assert r.status == 400 and r.json()["error"]["code"] == "bad_request"


def test_a_sandbox_the_backend_reports_dead_is_failed(api: Api, node) -> None:
    """A backend's failure report (its sandbox's init ended) makes the sandbox ``failed`` at
    once with the cause in words as its error and in one ``sandbox_failed`` event (a second
    report changes nothing); exec is a 409; delete removes it (issue 9, item 4)."""
    create(api, id="dead")
    cause = {"what": "sbx-init ended", "signal": 9, "oom_kill": True, "log": "last line"}
    for _ in range(2):
        node.call(_report(node, "dead", cause))
    info = api.get("/v1/sandboxes/dead").json()
    assert (info["state"], info["error"]) == (
        "failed", "sbx-init ended (signal 9, out of memory)"), info
    evs = api.get("/v1/sandboxes/dead/events?kind=sandbox_failed").json()["events"]
    assert [e["detail"]["cause"] for e in evs] == [cause]
    r = api.post("/v1/sandboxes/dead/exec", {"cmd": "true"}, check=False)
    assert r.status == 409 and r.json()["error"]["code"] == "invalid_state", r.body
    assert api.delete("/v1/sandboxes/dead").status in (200, 204)
    assert "dead" in node.backend.destroyed
    assert api.get("/v1/sandboxes/dead", check=False).status == 404


async def _report(node, sid: str, cause: dict) -> None:
    node.backend.on_failure(sid, cause)  # on the daemon's loop, as a backend calls it
