"""One list of a create's fields (``edged.client._common.CREATE_ARGS``, the parameters of
``create_body``) for every create: the SDK's sync and async ``create`` and the cluster
clients' pass their own arguments on by name (``create_body_of(locals())``), so each must
take every one of them, by the same name."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from edged.client import AsyncSandbox, Sandbox
from edged.client._common import CREATE_ARGS, create_body, create_body_of

CREATES: list[Any] = [Sandbox.create, AsyncSandbox.create]
try:  # the cluster clients need Ray (the cluster extra)
    from edged.cluster import AsyncClusterClient, ClusterClient

    CREATES += [ClusterClient.create, AsyncClusterClient.create]
except ImportError:  # pragma: no cover - Ray is in the test extra
    pass


@pytest.mark.parametrize("create", CREATES, ids=[c.__qualname__ for c in CREATES])
def test_every_create_takes_every_create_field(create: object) -> None:
    params = inspect.signature(create).parameters  # type: ignore[arg-type]
    assert set(CREATE_ARGS) - set(params) == set()
    for name in CREATE_ARGS:  # as a keyword, where create_body_of finds it
        assert params[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                     inspect.Parameter.KEYWORD_ONLY), name


def test_create_body_of_a_creates_locals() -> None:
    args = {n: None for n in CREATE_ARGS} | {
        "image": "py:3.11", "cpus": None, "cpu": 2.0, "memory_mib": 64, "env": {"A": "1"},
        "envs": {"B": "2"}, "labels": {"k": "v"}, "network": ["pypi"], "qos": "best_effort",
        "self": object(), "socket": "/run/x.sock", "retry": None}  # and what it is not
    want = create_body("py:3.11", None, id="n1.x", cpus=None, memory_bytes=None, pids=None,
                       disk_bytes=None, env={"A": "1"}, timeout=None, idle_timeout=None,
                       labels={"k": "v"}, network=["pypi"], qos="best_effort", cpu=2.0,
                       memory_mib=64, envs={"B": "2"})
    assert create_body_of(args, id="n1.x") == want
    assert want == {"image": "py:3.11", "id": "n1.x",
                    "resources": {"cpus": 2.0, "memory_bytes": 64 << 20},
                    "env": {"A": "1", "B": "2"}, "labels": {"k": "v"}, "qos": "best_effort",
                    "network": {"allow": ["pypi"]}}
    del args["labels"]
    with pytest.raises(KeyError):  # a create without the field: found by the test above
        create_body_of(args)
