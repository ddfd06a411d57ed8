"""What sbx-init reports that is a security event: denied syscalls (``SBX_EVENT``) and exec
ends that are limit hits, turned into records of an :data:`~edged.datatypes.EventSink`
(the daemon's ledger)."""

from __future__ import annotations

from typing import Any

from edged.datatypes import EventSink, ExecEnd
from edged.sbxinit import protocol as P
from edged.security import seccomp
from edged.security.confine import AUDIT_ARCH_X86_64

_END_EVENTS = {"oom": "oom_kill", "timeout": "timeout", "output_limit": "output_limit"}


def record_event(sink: EventSink | None, sandbox_id: str, exec_id: int,
                 payload: bytes) -> None:
    """Decode one ``SBX_EVENT`` payload and record it (a bad payload is itself recorded as a
    ``protocol_violation``: sbx-init is inside the sandbox's reach in principle)."""
    if sink is None:
        return
    if len(payload) != P.EVENT_S.size:
        sink(sandbox_id, "protocol_violation",
             detail={"frame": "event", "bytes": len(payload), "exec_id": exec_id})
        return
    kind, pid, nr, arch, *rest = P.EVENT_S.unpack(payload)
    args = rest[:6]
    ip, dropped, _r, comm = rest[6:]
    if kind == P.EV_DROPPED and dropped:
        # sbx-init sends at most 200 denials a second one by one; the rest are counted
        sink(sandbox_id, "seccomp_denied",
             detail={"dropped_before": dropped, "exec_id": exec_id, "summary": True})
        return
    if kind == P.EV_DISK_FULL:
        # a microVM guest's upper disk, seen full by the guest (its page cache is not yet
        # in the host's file)
        sink(sandbox_id, "disk_full", detail={"bytes": args[0], "exec_id": exec_id})
        return
    if kind != P.EV_SECCOMP:
        sink(sandbox_id, "protocol_violation", detail={"frame": "event", "kind": kind})
        return
    foreign = arch != AUDIT_ARCH_X86_64 or nr & 0x40000000
    name = f"syscall_{nr}" if foreign else seccomp.syscall_name(nr)
    detail: dict[str, Any] = {"nr": nr, "arch": f"{arch:#x}", "args": [f"{a:#x}" for a in args],
                              "errno": "EPERM", "exec_id": exec_id, "ip": f"{ip:#x}"}
    if foreign:
        detail["abi"] = "foreign (i386 or x32)"
    if name == "ioctl":
        detail["ioctl"] = f"{args[1] & 0xFFFFFFFF:#x}"
    if dropped:
        detail["dropped_before"] = dropped
    sink(sandbox_id, "seccomp_denied", pid=pid or None,
         process=comm.rstrip(b"\0").decode("utf-8", "replace") or None, syscall=name,
         detail=detail)


def record_end(sink: EventSink | None, sandbox_id: str, exec_id: int, end: ExecEnd) -> None:
    """Record an exec end that is a limit hit (OOM kill, timeout, output limit)."""
    kind = _END_EVENTS.get(end.reason)
    if sink is not None and kind is not None:
        sink(sandbox_id, kind, detail={"exec_id": exec_id, "duration_s": round(end.duration_s, 3),
                                       "peak_memory_bytes": end.peak_memory_bytes})


__all__ = ["record_end", "record_event"]
