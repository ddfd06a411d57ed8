"""Every error the daemon sends reaches the SDK (sync and async) as its own exception class,
and the inputs that used to slip through are refused with a typed 400 (issue 9, item 9)."""

from __future__ import annotations

import asyncio
import json

import pytest

import edged.client
from edged import errors as server_errors
from edged.client import (
    ERRORS_BY_CODE,
    AsyncSandbox,
    BadProfileError,
    BadRequestError,
    PayloadTooLargeError,
    PidsExhaustedError,
    Sandbox,
    SandboxError,
)
from edged.client.errors import from_body
from edged.security.profile import PROFILES_DIR, ProfileError
from tests.edged.api.speccheck import SPEC, Api
from tests.edged.fakes import digest

SPEC_CODES = set(SPEC["components"]["schemas"]["Error"]["properties"]["error"]["properties"]
                 ["code"]["enum"])


def test_every_code_in_the_spec_has_an_sdk_class() -> None:
    assert set(ERRORS_BY_CODE) == SPEC_CODES
    for code, cls in ERRORS_BY_CODE.items():
        assert cls.code == code and issubclass(cls, SandboxError)
        assert cls.__name__ in edged.client.__all__  # exported
        got = from_body(400, {"error": {"code": code, "message": "m"}}, "2")
        assert type(got) is cls and got.message == "m" and got.retry_after == 2.0
    # specific codes are caught by their general class
    assert issubclass(BadProfileError, BadRequestError)
    assert issubclass(PayloadTooLargeError, BadRequestError)
    assert issubclass(PidsExhaustedError, edged.client.InvalidStateError)


def test_every_code_the_daemon_has_is_in_the_spec() -> None:
    daemon_codes = {c.code for c in server_errors.ERRORS_BY_CODE.values()} | {ProfileError.code}
    # method_not_allowed and internal come from the API layer itself (app.errors_middleware)
    assert daemon_codes | {"method_not_allowed", "internal"} == SPEC_CODES


def _both(node, call) -> list[BaseException]:
    """The exception ``call(client_class)`` raises through the sync and the async SDK."""
    got: list[BaseException] = []
    try:
        call(Sandbox)
    except SandboxError as e:
        got.append(e)

    async def main() -> None:
        try:
            r = call(AsyncSandbox)
            if asyncio.iscoroutine(r):
                await r
        except SandboxError as e:
            got.append(e)

    asyncio.run(main())
    assert len(got) == 2, got
    return got


def test_unknown_task_profile_is_a_bad_request_without_a_host_path(node) -> None:
    for e in _both(node, lambda cls: cls.create(layers=[digest(1)], task_profile="nope",
                                                socket=node.socket)):
        assert isinstance(e, BadProfileError) and isinstance(e, BadRequestError)
        assert e.status == 400 and "nope" in e.message
        assert str(PROFILES_DIR) not in e.message and "/" not in e.message


def test_payload_too_large_reaches_the_sdk_typed(node) -> None:
    from edged.client._http import Transport

    # the daemon's 413, through the SDK's transport
    raw = json.dumps({"layers": [digest(1)], "env": {"k": "v" * (5 << 20)}}).encode()
    with pytest.raises(PayloadTooLargeError) as ei:
        Transport(node.socket).open("POST", "/v1/sandboxes", raw,
                                    {"Content-Type": "application/json"})
    assert ei.value.status == 413 and ei.value.code == "payload_too_large"
    # both clients refuse such a body before sending it (the daemon reads 4 MiB of it first)
    big = {"k": "v" * (5 << 20)}
    for e in _both(node, lambda cls: cls.create(layers=[digest(1)], env=big,
                                                socket=node.socket)):
        assert isinstance(e, PayloadTooLargeError) and e.status == 413
    assert Sandbox.list(socket=node.socket) == []


def test_pids_exhausted_reaches_the_sdk_typed(node) -> None:
    from edged.errors import PidsExhausted

    sbx = Sandbox.create(layers=[digest(1)], id="full", socket=node.socket)

    async def refuse(*a: object, **kw: object) -> None:
        raise PidsExhausted("sandbox full: fork: Resource temporarily unavailable")

    node.backend.exec = refuse

    async def aexec(cls: type[AsyncSandbox]) -> None:
        a = await cls.connect("full", socket=node.socket)
        try:
            await a.exec("true")
        finally:
            await a.close()

    def call(cls: type) -> object:
        if cls is Sandbox:
            return sbx.exec("true")
        return aexec(cls)

    for e in _both(node, call):
        assert isinstance(e, PidsExhaustedError) and e.status == 409
    sbx.kill()


def test_json_nesting_bomb_is_a_400(node) -> None:
    api = Api(node.socket)
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        r = api.request("POST", "/v1/sandboxes", raw=body)
        assert r.status == 400 and r.json()["error"]["code"] == "bad_request", r.body[:200]


@pytest.mark.parametrize("name", ["a\nb", "a b", "a_b", "-a", "a-", "a..b", ".a", "a" * 64,
                                  "ä", ""])
def test_bad_hostnames_refused(node, name: str) -> None:
    r = Api(node.socket).post("/v1/sandboxes", {"layers": [digest(1)], "hostname": name})
    assert r.status == 400 and "hostname" in r.json()["error"]["message"]


def test_good_and_default_hostnames(node) -> None:
    api = Api(node.socket)
    for body, want in (({"hostname": "Box-1.example"}, "Box-1.example"),
                       ({"id": "a_b.-c-"}, "a-b.c"), ({"id": "x"}, "x"), ({"id": "-"}, None)):
        if want is None:
            assert api.post("/v1/sandboxes", {"layers": [digest(1)], **body}).status == 400
            continue
        r = api.post("/v1/sandboxes", {"layers": [digest(1)], **body})
        assert r.status == 201, r.body
        sid = r.json()["id"]
        assert node.backend.specs[sid].hostname == want
        api.delete(f"/v1/sandboxes/{sid}")


def test_labels_and_env_are_bounded(node) -> None:
    api = Api(node.socket)

    def create(**body: object) -> int:
        r = api.post("/v1/sandboxes", {"layers": [digest(1)], **body})
        if r.status == 201:
            api.delete(f"/v1/sandboxes/{r.json()['id']}")
        return r.status

    assert create(labels={f"k{i}": "v" for i in range(100_000)}) == 400
    assert create(labels={f"k{i}": "v" for i in range(64)}) == 201
    assert create(labels={f"k{i}": "v" for i in range(65)}) == 400
    assert create(labels={f"k{i:02}": "v" * 256 for i in range(63)}) == 201  # 16,317 chars
    assert create(labels={f"k{i:02}": "v" * 256 for i in range(64)}) == 400  # 16,576
    assert create(env={f"V{i}": "x" for i in range(4096)}) == 201
    assert create(env={f"V{i}": "x" for i in range(4097)}) == 400
    assert create(env={"BIG": "x" * (600 << 10)}) == 400
    # a selector of a listing is not a sandbox's labels: not bounded by count
    sel = "&".join(f"label=k{i}%3Dv" for i in range(100))
    assert api.get(f"/v1/sandboxes?{sel}").status == 200
    assert json.loads(api.get("/v1/sandboxes").body)["sandboxes"] == []
