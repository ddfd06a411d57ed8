"""The backend registry: backends built from config by name, side by side in one daemon, each
sandbox dispatched to the backend its record names (also after a restart), each given its
layers in the form it needs (a mounted tree or the image file), all listed by GET /v1/node."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edged.backends import registry
from edged.backends.base import EventSink, LayerForm
from edged.backends.registry import Backends
from edged.config import Config
from edged.daemon import Server, ServerThread
from edged.errors import BackendError, BadRequest
from tests.edged.api.speccheck import Api
from tests.edged.fakes import FakeBackend, digest, fake_layers

L1, L2 = digest(1), digest(2)


class FakeImageBackend(FakeBackend):
    """A second kind of sandbox that wants image files (as a microVM does)."""

    name = "fake-vm"
    layer_form: LayerForm = "image"


@pytest.fixture
def registered(tmp_path: Path) -> Iterator[list[EventSink | None]]:
    sinks: list[EventSink | None] = []

    def make(name: str, cls: type[FakeBackend]) -> registry.Factory:
        def factory(config: Config, sink: EventSink | None) -> FakeBackend:
            sinks.append(sink)
            b = cls(tmp_path / name)
            b.on_event = sink
            return b
        return factory

    registry.register("fake-a", make("fake-a", FakeBackend))
    registry.register("fake-vm", make("fake-vm", FakeImageBackend))
    yield sinks
    registry.unregister("fake-a")
    registry.unregister("fake-vm")


def test_built_from_config_by_name(registered: list[EventSink | None]) -> None:
    def sink(*a: Any, **k: Any) -> None:
        return None

    b = Backends.from_config(Config(backend="fake-vm", backends="fake-a, fake-vm"), sink)
    assert b.names() == ["fake-vm", "fake-a"] and b.default == "fake-vm"
    assert b.get().layer_form == "image" and b.get("fake-a").layer_form == "tree"
    assert registered == [sink, sink]
    with pytest.raises(BadRequest, match=r"backend: 'nope' is not available \(have "
                                         r"'fake-a', 'fake-vm'\)"):
        b.get("nope")
    with pytest.raises(BackendError, match="backend 'nope': unknown"):
        Backends.from_config(Config(backend="fake-a", backends="nope"))
    # the default alone when `backends` is empty
    assert Backends.from_config(Config(backend="fake-a")).names() == ["fake-a"]


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="edged-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_two_backends_side_by_side_dispatched_by_record(tmp_path: Path, sockdir: Path) -> None:
    live_c: dict[str, Path] = {}
    live_v: dict[str, Path] = {}
    cfg = Config(socket=str(sockdir / "edged.sock"), state_dir=str(tmp_path / "state"),
                 runtime_dir=str(tmp_path / "run"), cpus=2.0, memory_bytes=4 << 30,
                 default_ttl_s=0.0, layer_linger_s=0.0, on_shutdown="keep")

    def start() -> tuple[ServerThread, FakeBackend, FakeImageBackend, Any]:
        ctr = FakeBackend(tmp_path / "c", live_c)
        vm = FakeImageBackend(tmp_path / "v", live_v)
        layers, ops = fake_layers(tmp_path, {L1, L2})
        t = ServerThread(Server(cfg, layers=layers,
                                backends=Backends({"container": ctr, "fake-vm": vm},
                                                  "container")))
        t.start()
        return t, ctr, vm, ops

    t, ctr, vm, ops = start()
    try:
        api = Api(cfg.socket)
        r = api.post("/v1/sandboxes", {"id": "c1", "layers": [L1, L2]})
        assert r.status == 201 and r.json()["backend"] == "container"
        r = api.post("/v1/sandboxes", {"id": "v1", "backend": "fake-vm", "layers": [L1, L2]})
        assert r.status == 201 and r.json()["backend"] == "fake-vm"
        assert set(ctr.live) == {"c1"} and set(vm.live) == {"v1"}
        # each got its layers in its own form: mounts for the container, image files for
        # the VM (not mounted for it: the only mounts are the container's)
        lowers_c, lowers_v = ctr.specs["c1"].lowers, vm.specs["v1"].lowers
        assert all(Path(p).parent == tmp_path / "mnt" for p in lowers_c)
        assert [Path(p).read_bytes() for p in lowers_v] == [L1.encode(), L2.encode()]
        assert ops.mount_calls == 2
        r = api.post("/v1/sandboxes", {"id": "x", "backend": "fullvm", "layers": [L1]})
        assert r.status == 400 and "fullvm" in r.json()["error"]["message"]
        # execs go to each record's backend
        for sid, b in (("c1", ctr), ("v1", vm)):
            r = api.post(f"/v1/sandboxes/{sid}/exec", {"argv": ["true"]})
            assert r.status == 200, r.body
            assert len(b.procs[sid]) == 1
        node = api.get("/v1/node").json()
        assert node["backend"] == "container"
        assert {k: v["layer_form"] for k, v in node["backends"].items()} == {
            "container": "tree", "fake-vm": "image"}
        assert ctr.warmed == vm.warmed == 1
    finally:
        t.stop(30)
    assert ctr.closed == vm.closed == 1
    # a restart adopts each sandbox through the backend its record names
    t, ctr, vm, ops = start()
    try:
        assert (ctr.adopted, vm.adopted) == (["c1"], ["v1"])
        api = Api(cfg.socket)
        assert api.delete("/v1/sandboxes/v1").status == 200
        assert vm.destroyed == ["v1"] and ctr.destroyed == [] and set(ctr.live) == {"c1"}
        assert api.delete("/v1/sandboxes/c1").status == 200
        assert ctr.destroyed == ["c1"]
    finally:
        t.stop(30)
