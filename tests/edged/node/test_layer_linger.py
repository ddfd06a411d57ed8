"""Layers stay mounted ``layer_linger_s`` after their last sandbox (the next create reuses the
mount and its page cache), then are unmounted; shutdown releases them at once."""

from __future__ import annotations

import time

from tests.edged.api.speccheck import Api
from tests.edged.fakes import digest

L1, L2 = digest(1), digest(2)


def _create(api: Api, sid: str) -> None:
    r = api.post("/v1/sandboxes", {"id": sid, "layers": [L1, L2]})
    assert r.status == 201, r.body


def test_layers_linger_then_unmount(make_node) -> None:
    node = make_node(layer_linger_s=0.5)
    api = Api(node.socket)
    _create(api, "a")
    assert api.delete("/v1/sandboxes/a").status == 200
    # kept: one reference each, held by the linger, not by a sandbox
    assert node.server.manager.layers.refs() == {L1: 1, L2: 1}
    assert node.server.manager.layers.lingering() == sorted([L1, L2])
    _create(api, "b")  # reuses the mounts
    assert node.layer_ops.mount_calls == 2
    assert node.server.manager.layers.refs() == {L1: 2, L2: 2}
    assert api.delete("/v1/sandboxes/b").status == 200
    assert node.server.manager.layers.refs() == {L1: 1, L2: 1}
    assert node.layer_ops.umount_calls == 0
    deadline = time.monotonic() + 5
    while node.layer_ops.mounted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.layer_ops.mounted == {} and node.layer_ops.umount_calls == 2
    assert node.server.manager.layers.refs() == {}
    assert node.server.manager.layers.lingering() == []


def test_shutdown_releases_lingering_layers(make_node) -> None:
    node = make_node(layer_linger_s=3600.0)
    api = Api(node.socket)
    _create(api, "a")
    assert api.delete("/v1/sandboxes/a").status == 200
    assert node.layer_ops.umount_calls == 0
    node.stop()
    assert node.layer_ops.mounted == {} and node.layer_ops.umount_calls == 2
