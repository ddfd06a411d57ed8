"""The ledger through the real daemon: a sandbox created over the API with a named task
profile, attacks run through the API, ``GET /v1/sandboxes/{id}/events`` (checked against the
OpenAPI spec) shows them, they outlive the sandbox, and profile names are validated at
create (bare names only, loaded before anything is made)."""

from __future__ import annotations

from typing import Any

import pytest

from edged.client import Sandbox
from tests.edged.api.speccheck import Api
from tests.edged.test_e2e_container import layer_store, real_node  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.root, pytest.mark.mount]


def test_events_through_the_api(real_node: Any, layer_store: tuple[str, str]) -> None:  # noqa: F811
    _, digest = layer_store
    node = real_node()
    api = Api(node.socket)
    body = {"layers": [digest], "id": "evt", "env": {"PATH": "/bin"}, "task_profile": "default",
            "seccomp_profile": "default"}
    for bad, field in (({"task_profile": "../../etc/passwd"}, "task_profile"),
                       ({"task_profile": "no-such-profile"}, "task profile"),
                       ({"seccomp_profile": "/etc/shadow"}, "seccomp_profile")):
        r = api.post("/v1/sandboxes", {**body, **bad})
        assert r.status == 400 and field in r.json()["error"]["message"], r.body
    r = api.post("/v1/sandboxes", body)
    assert r.status == 201, r.body
    assert r.json()["task_profile"] == "default"
    sbx = Sandbox.connect("evt", socket=node.socket)
    res = sbx.exec("hostname pwned; mount -t tmpfs x /tmp; echo x > /bin/sh; echo done")
    assert res.stdout.endswith("done\n") and "Read-only" in res.stderr, res
    # a grader exec: nothing shadows the protected paths, so it runs
    r = api.post("/v1/sandboxes/evt/exec", {"cmd": "echo graded", "trusted": True})
    assert r.status == 200 and any("graded" in str(x) for x in r.lines), r.body
    assert sbx.exec("echo graded too", trusted=True).stdout == "graded too\n"  # the SDK
    assert {"sethostname", "mount"} <= {e["syscall"] for e in
                                        sbx.events(kind="seccomp_denied")}
    r = api.get("/v1/sandboxes/evt/events")
    assert r.status == 200
    evs = r.json()["events"]
    got = {(e["kind"], e["syscall"]) for e in evs}
    assert {("seccomp_denied", "sethostname"), ("seccomp_denied", "mount")} <= got, evs
    r = api.get("/v1/sandboxes/evt/events?kind=seccomp_denied&since=1&limit=1")
    assert r.status == 200 and len(r.json()["events"]) == 1
    assert r.json()["events"][0]["seq"] > 1
    assert api.delete("/v1/sandboxes/evt").status == 200
    r = api.get("/v1/sandboxes/evt/events")
    assert r.status == 200
    kinds = [e["kind"] for e in r.json()["events"]]
    assert kinds[-1] == "sandbox_gone" and "seccomp_denied" in kinds
    assert api.get("/v1/sandboxes/never-was/events").status == 404
    feats = api.get("/v1/node").json()["features"]  # the node says what confinement it found
    assert {"landlock_abi", "seccomp_notify", "apparmor"} <= set(feats), feats
    assert api.get("/v1/sandboxes/evt/events?since=x").status == 400
