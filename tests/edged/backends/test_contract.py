"""What the daemon and the node need of a backend is in the contract
(:mod:`edged.backends.base`), not found by probing: every backend declares the descriptors it
holds per sandbox, the network goes to a backend that is a :class:`NetnsJoiner`, and a
sandbox without cgroups refuses pause, resume and kill-all through the cgroups interface."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path

import pytest

from edged.backends.base import NetnsJoiner
from edged.backends.container import ContainerBackend
from edged.backends.fncall.backend import FnCallBackend
from edged.backends.microvm.backend import MicroVmBackend
from edged.cgroups.none import NoCgroup
from edged.daemon import network_backend
from edged.errors import InvalidState
from tests.edged.fakes import FakeBackend

BACKENDS = [ContainerBackend, MicroVmBackend, FnCallBackend, FakeBackend]


@pytest.mark.parametrize("cls", BACKENDS, ids=[c.__name__ for c in BACKENDS])
def test_every_backend_declares_its_descriptors_per_sandbox(cls: type) -> None:
    n = cls.__dict__.get("fds_per_sandbox")  # its own, not found by getattr at run time
    assert isinstance(n, int) and n >= 0, (cls, n)


def test_container_sandboxes_hold_a_pidfd_and_a_control_socket() -> None:
    assert (ContainerBackend.fds_per_sandbox, MicroVmBackend.fds_per_sandbox) == (2, 3)


class _Joiner(FakeBackend):
    name = "joiner"

    def egress_cgroup_dir(self) -> Path | None:
        return Path("/sys/fs/cgroup/unified/x")

    def init_pid(self, sandbox_id: str) -> int:
        return 1


def test_the_network_goes_to_the_first_netns_joiner(tmp_path: Path) -> None:
    plain, joiner = FakeBackend(tmp_path / "a"), _Joiner(tmp_path / "b")
    assert not isinstance(plain, NetnsJoiner)
    assert network_backend([plain, joiner]) is joiner
    assert network_backend([plain]) is None
    container = ContainerBackend(tmp_path / "state")
    try:
        assert isinstance(container, NetnsJoiner)
        assert network_backend([plain, container, joiner]) is container
        assert container.egress_cgroup_dir() == container.cgroups.bpf_dir()
    finally:
        # bpf_dir() made the backend's directory in the unified hierarchy: a closed
        # backend removes its empty parents (it was left behind after every suite run,
        # found by the session's cgroup check in tests/conftest.py)
        asyncio.run(container.close())


def test_no_cgroup_refuses_freezing_and_kill_all_as_invalid_state() -> None:
    cg = NoCgroup({})
    with pytest.raises(InvalidState, match="pause needs a freezer"):
        cg.freeze(True)
    with pytest.raises(InvalidState, match="resume needs a freezer"):
        cg.freeze(False)
    with pytest.raises(InvalidState, match="killing every process needs"):
        cg.kill_workload(1)


def test_a_container_without_cgroups_refuses_pause_resume_kill_all(tmp_path: Path) -> None:
    b = ContainerBackend(tmp_path / "state")
    b._sandboxes["s"] = types.SimpleNamespace(paused=False, cg=NoCgroup({}),  # type: ignore
                                              pid=1)

    async def body() -> None:
        for call, what in ((b.pause, "pause"), (b.resume, "resume"),
                           (b.kill_processes, "killing every process")):
            with pytest.raises(InvalidState, match=what):
                await call("s")
        assert b._sandboxes["s"].paused is False

    asyncio.run(body())
