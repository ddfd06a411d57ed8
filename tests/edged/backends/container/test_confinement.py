"""The container backend's confinement glue: SBX_EVENT decoding into ledger records, limit
counters, the policy files handed to the spawner, and failing closed when a policy cannot be
applied (an AppArmor profile on a kernel without AppArmor)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from edged.backends.base import ExecEnd, ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend, confinement
from edged.backends.container import protocol as P
from edged.errors import EdgedError
from edged.security import seccomp
from edged.security.ledger import Ledger


def _event(nr: int, args: tuple[int, ...], arch: int = 0xC000003E, dropped: int = 0) -> bytes:
    return P.EVENT_S.pack(P.EV_SECCOMP, 42, nr, arch, *args, 0x401000, dropped, 0, b"attack")


def test_record_event_decodes_seccomp_denials() -> None:
    led = Ledger(None)
    ioctl = next(n for n in range(512) if seccomp.syscall_name(n) == "ioctl")
    confinement.record_event(led.record, "s", 3,
                             _event(ioctl, (4, 0xDEAD_C0C0586D, 0, 0, 0, 0), dropped=2))
    confinement.record_event(led.record, "s", 3, _event(1, (0,) * 6, arch=0x40000003))
    confinement.record_event(led.record, "s", 3, b"short")
    ev = led.events("s")
    assert [e.kind for e in ev] == ["seccomp_denied", "seccomp_denied", "protocol_violation"]
    assert ev[0].syscall == "ioctl" and ev[0].process == "attack" and ev[0].pid == 42
    assert ev[0].detail["ioctl"] == "0xc0c0586d"  # the low 32 bits the kernel compares
    assert ev[0].detail["dropped_before"] == 2 and ev[0].detail["exec_id"] == 3
    assert ev[1].syscall == "syscall_1" and "foreign" in ev[1].detail["abi"]


def test_record_event_dropped_summary() -> None:
    led = Ledger(None)
    summary = P.EVENT_S.pack(P.EV_DROPPED, 0, 0, 0, *(0,) * 6, 0, 1234, 0, b"")
    confinement.record_event(led.record, "s", 7, summary)
    confinement.record_event(led.record, "s", 7, P.EVENT_S.pack(P.EV_DROPPED, 0, 0, 0,
                                                                 *(0,) * 6, 0, 0, 0, b""))
    ev = led.events("s")
    assert [e.kind for e in ev] == ["seccomp_denied", "protocol_violation"]  # empty: bogus
    assert ev[0].syscall is None and ev[0].detail == {"dropped_before": 1234, "exec_id": 7,
                                                      "summary": True}


def test_record_end_only_limit_hits() -> None:
    led = Ledger(None)
    for reason in ("exited", "oom", "timeout", "output_limit", "killed", "signalled"):
        confinement.record_end(led.record, "s", 1, ExecEnd(reason=reason, exit_code=None,
                                                            signal=None, duration_s=0.5,
                                                            peak_memory_bytes=None))
    assert [e.kind for e in led.events("s")] == ["oom_kill", "timeout", "output_limit"]


def test_spawner_args_write_policy_files(tmp_path: Path, busybox_tree: Path) -> None:
    spec = SandboxSpec(id="p1", lowers=(str(busybox_tree),), resources=Resources(), env={},
                       hostname="h")
    pol = confinement.prepare(spec)
    assert pol is not None
    args = confinement.spawner_args(dataclasses.replace(pol, apparmor_profile="edged-sbx-p1"),
                                    tmp_path / "policies")
    sc = Path(args[args.index("--seccomp") + 1])
    assert sc.parent == tmp_path / "policies" and sc.read_bytes() == pol.seccomp_prog
    assert (tmp_path / "policies").stat().st_mode & 0o777 == 0o700
    # written once, shared by every sandbox with the same policy
    again = confinement.spawner_args(pol, tmp_path / "policies")
    assert again[again.index("--seccomp") + 1] == str(sc)
    assert len(list((tmp_path / "policies").iterdir())) == (2 if pol.landlock_blob else 1)
    assert args[args.index("--apparmor") + 1] == "edged-sbx-p1"
    assert args.count("--protect") == len(pol.protected) and "/bin" in pol.protected
    assert confinement.prepare(dataclasses.replace(spec, task_profile=None)) is None
    with pytest.raises(EdgedError):
        confinement.prepare(dataclasses.replace(spec, task_profile="no-such-profile"))


@pytest.mark.root
@pytest.mark.mount
def test_exec_fails_closed_when_apparmor_cannot_apply(
        backend: ContainerBackend, busybox_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox told to use an AppArmor profile never runs an exec without it: here, with no
    AppArmor in the kernel, sbx-init cannot set it and the exec is refused."""
    if Path("/sys/kernel/security/apparmor").exists():
        pytest.skip("the kernel has AppArmor: the profile would apply")
    real = confinement.prepare

    def with_aa(spec: SandboxSpec) -> Any:
        pol = real(spec)
        return dataclasses.replace(pol, apparmor_profile="edged-sbx-aa") if pol else None

    monkeypatch.setattr(confinement, "prepare", with_aa)
    spec = SandboxSpec(id="aa", lowers=(str(busybox_tree),), resources=Resources(),
                       env={"PATH": "/bin"}, hostname="aa")

    async def body() -> None:
        await backend.create(spec)
        try:
            with pytest.raises(EdgedError, match="apparmor"):
                await backend.exec("aa", ExecSpec(argv=("true",), env={"PATH": "/bin"}))
        finally:
            await backend.destroy("aa")

    asyncio.run(asyncio.wait_for(body(), 60))


@pytest.mark.parametrize("garbage", [
    P.frame(0x99, 0, b"x"),  # unknown type
    P.frame(P.STARTED, 1, b"\x00"),  # wrong payload size
    P.HDR.pack(P.MAX_PAYLOAD + 1, P.STDOUT, 0, 1, 0),  # oversized
])
def test_a_misbehaving_sbx_init_is_a_recorded_violation(garbage: bytes) -> None:
    """Frames only a compromised PID 1 would send end the connection and are recorded."""
    import socket

    from edged.backends.container.backend import _Conn

    led = Ledger(None)

    async def body() -> None:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=a)
        conn = _Conn("bad", reader, writer, led.record)
        b.sendall(garbage)
        for _ in range(100):
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        assert conn.closed
        await conn.close()
        b.close()

    asyncio.run(asyncio.wait_for(body(), 10))
    ev = led.events("bad")
    assert [e.kind for e in ev] == ["protocol_violation"] and ev[0].detail["from"] == "sbx-init"


def test_prepare_cache_follows_profile_and_layers(tmp_path: Path) -> None:
    """A cached policy is reused while nothing it was built from changed, and rebuilt when a
    layer directory the Landlock ruleset lists gains an entry."""
    root = tmp_path / "root"
    for d in ("bin", "etc", "usr/bin"):
        (root / d).mkdir(parents=True)
    spec = SandboxSpec(id="c1", lowers=(str(root),), resources=Resources(), env={},
                       hostname="h", task_profile="default")
    a = confinement.prepare(spec)
    b = confinement.prepare(dataclasses.replace(spec, id="c2"))
    assert a is not None and b is not None
    assert b.seccomp_prog is a.seccomp_prog and b.landlock_blob is a.landlock_blob
    (root / "data").mkdir()  # a new top-level directory: the ruleset must grant it
    c = confinement.prepare(spec)
    assert c is not None and c.seccomp_prog == a.seccomp_prog
    if a.landlock_blob is not None:
        assert c.landlock_blob != a.landlock_blob
    (root / "etc" / "new").mkdir()  # /etc holds protected files: its listing is read too
    d = confinement.prepare(spec)
    assert d is not None and d.landlock_blob is not c.landlock_blob
    other = confinement.prepare(dataclasses.replace(spec, seccomp_profile="default",
                                                    lowers=(str(root), str(tmp_path))))
    assert other is not None and other.landlock_blob is not d.landlock_blob
