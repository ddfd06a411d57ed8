"""The guest boot handshake, mirrored from ``csrc/sbx-init/guest.h`` (the source of truth:
keep both in step).

On the control port, before the sbx-init protocol (``csrc/sbx-init/protocol.h``): the guest
sends :data:`READY` once it waits for its sandbox (a template is saved at that point); the
host sends :func:`boot_record` (the sandbox's disks, limits, confinement); the guest answers
:data:`DONE` (0 or an errno and a message) and from then on speaks the protocol.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

VERSION = 1
PORT_NAME = "sbx.ctl"
MAX_LAYERS = 16
MAX_PAYLOAD = 1 << 20
SERIAL_LOWER = "sbx-l"  # + index, bottom first
SERIAL_UPPER = "sbx-upper"

#: struct sbx_boot_ready: magic[8] "SBXREADY", version, reserved, boot_ns
READY = struct.Struct("<8sIIQ")
#: struct sbx_boot: magic[8] "SBXBOOT1", len, nlayers, realtime_ns, memory_max, caps,
#: pids_max, flags, landlock_len, seccomp_len, strings_len, reserved
BOOT = struct.Struct("<8sIIQQQIIIIII")
#: struct sbx_boot_done: magic[8] "SBXBOOTD", code, msg_len, boot_ns
DONE = struct.Struct("<8siIQ")
assert READY.size == 24 and BOOT.size == 64 and DONE.size == 24

FLAG_CONFINE_CAPS = 0x1


@dataclass(frozen=True)
class BootSpec:
    """What a clone's guest needs for its sandbox. ``nlayers``: lower disks (serials
    ``sbx-l0``.., bottom first); ``memory_max``/``pids_max``: the workload cgroup's limits
    (0: none); ``caps``: capability bit mask every exec keeps, None: keep all;
    ``protected``/``grader_paths``: absolute paths; ``landlock``/``seccomp``: the blobs sbx-init
    takes in a container as files (``edged.security``), empty for none."""

    nlayers: int
    hostname: str
    realtime_ns: int
    memory_max: int = 0
    pids_max: int = 0
    caps: int | None = None
    protected: tuple[str, ...] = ()
    grader_paths: tuple[str, ...] = ()
    landlock: bytes = b""
    seccomp: bytes = b""


def boot_record(spec: BootSpec) -> bytes:
    """Encode the boot record. Raises ValueError for what the guest would refuse (layer
    count out of range, a NUL or ':' in a string, a relative path, payload too large)."""
    if not 1 <= spec.nlayers <= MAX_LAYERS:
        raise ValueError(f"nlayers: {spec.nlayers} not in 1..{MAX_LAYERS}")
    for p in (*spec.protected, *spec.grader_paths):
        if not p.startswith("/") or ":" in p or "\0" in p:
            raise ValueError(f"path {p!r}: must be absolute, without ':' or NUL")
    if "\0" in spec.hostname or not spec.hostname:
        raise ValueError("hostname: empty or with a NUL")
    strings = b"".join(
        s.encode() + b"\0"
        for s in (spec.hostname, ":".join(spec.protected), ":".join(spec.grader_paths))
    )
    payload = spec.landlock + spec.seccomp + strings
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"boot payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    flags = FLAG_CONFINE_CAPS if spec.caps is not None else 0
    head = BOOT.pack(
        b"SBXBOOT1", len(payload), spec.nlayers, spec.realtime_ns, spec.memory_max,
        spec.caps or 0, spec.pids_max, flags, len(spec.landlock), len(spec.seccomp),
        len(strings), 0,
    )
    return head + payload


def parse_ready(data: bytes) -> int:
    """The guest's boot time (ns, CLOCK_BOOTTIME) from a ready record. Raises ValueError if
    ``data`` is not one of this version."""
    magic, version, _r, boot_ns = READY.unpack(data)
    if magic != b"SBXREADY" or version != VERSION:
        raise ValueError(f"not a ready record of version {VERSION}: {data!r}")
    return int(boot_ns)


def parse_done(head: bytes) -> tuple[int, int, int]:
    """``(code, msg_len, boot_ns)`` of a done record's fixed part. Raises ValueError on a
    wrong magic."""
    magic, code, msg_len, boot_ns = DONE.unpack(head)
    if magic != b"SBXBOOTD":
        raise ValueError(f"not a boot-done record: {head!r}")
    return int(code), int(msg_len), int(boot_ns)


def parse_steps(msg: str) -> dict[str, float]:
    """The step times of a successful boot's message (``"name=MICROSECONDS ..."``), in
    seconds; unparsable parts are skipped."""
    out: dict[str, float] = {}
    for part in msg.split():
        name, _, us = part.partition("=")
        if us.isdigit():
            out[name] = int(us) / 1e6
    return out
