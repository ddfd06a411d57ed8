"""sbx-init's security events: SBX_EVENT payloads decoded into ledger records, and the exec
ends that are limit hits."""

from __future__ import annotations

from edged.backends.base import ExecEnd
from edged.sbxinit import events
from edged.sbxinit import protocol as P
from edged.security import seccomp
from edged.security.ledger import Ledger


def _event(nr: int, args: tuple[int, ...], arch: int = 0xC000003E, dropped: int = 0) -> bytes:
    return P.EVENT_S.pack(P.EV_SECCOMP, 42, nr, arch, *args, 0x401000, dropped, 0, b"attack")


def test_record_event_decodes_seccomp_denials() -> None:
    led = Ledger(None)
    ioctl = next(n for n in range(512) if seccomp.syscall_name(n) == "ioctl")
    events.record_event(led.record, "s", 3,
                             _event(ioctl, (4, 0xDEAD_C0C0586D, 0, 0, 0, 0), dropped=2))
    events.record_event(led.record, "s", 3, _event(1, (0,) * 6, arch=0x40000003))
    events.record_event(led.record, "s", 3, b"short")
    ev = led.events("s")
    assert [e.kind for e in ev] == ["seccomp_denied", "seccomp_denied", "protocol_violation"]
    assert ev[0].syscall == "ioctl" and ev[0].process == "attack" and ev[0].pid == 42
    assert ev[0].detail["ioctl"] == "0xc0c0586d"  # the low 32 bits the kernel compares
    assert ev[0].detail["dropped_before"] == 2 and ev[0].detail["exec_id"] == 3
    assert ev[1].syscall == "syscall_1" and "foreign" in ev[1].detail["abi"]


def test_record_event_dropped_summary() -> None:
    led = Ledger(None)
    summary = P.EVENT_S.pack(P.EV_DROPPED, 0, 0, 0, *(0,) * 6, 0, 1234, 0, b"")
    events.record_event(led.record, "s", 7, summary)
    events.record_event(led.record, "s", 7, P.EVENT_S.pack(P.EV_DROPPED, 0, 0, 0,
                                                                 *(0,) * 6, 0, 0, 0, b""))
    ev = led.events("s")
    assert [e.kind for e in ev] == ["seccomp_denied", "protocol_violation"]  # empty: bogus
    assert ev[0].syscall is None and ev[0].detail == {"dropped_before": 1234, "exec_id": 7,
                                                      "summary": True}


def test_record_event_disk_full_from_a_guest() -> None:
    # a microVM guest's sbx-init tells of its full upper disk (the host's file lags the
    # guest's page cache): was a protocol_violation before the kind existed
    led = Ledger(None)
    events.record_event(led.record, "s", 5, P.EVENT_S.pack(P.EV_DISK_FULL, 0, 0, 0, 16 << 20,
                                                           *(0,) * 5, 0, 0, 0, b""))
    ev = led.events("s")
    assert [e.kind for e in ev] == ["disk_full"]
    assert ev[0].detail == {"bytes": 16 << 20, "exec_id": 5}


def test_record_end_only_limit_hits() -> None:
    led = Ledger(None)
    for reason in ("exited", "oom", "timeout", "output_limit", "killed", "signalled"):
        events.record_end(led.record, "s", 1, ExecEnd(reason=reason, exit_code=None,
                                                      signal=None, duration_s=0.5,
                                                      peak_memory_bytes=None))
    assert [e.kind for e in led.events("s")] == ["oom_kill", "timeout", "output_limit"]
