"""The sbx-init control protocol, mirrored from ``csrc/sbx-init/protocol.h`` (the source of
truth: keep both in step). Every backend speaks it to its sbx-init, over whatever byte
stream reaches it (see :mod:`edged.sbxinit.client`).

Frames: a 16-byte little-endian header ``(len u32, type u16, flags u16, exec_id u32,
reserved u32)`` then ``len`` payload bytes. Payload layouts are the ``struct sbx_*`` of the
header, packed here with :mod:`struct`. An exec's output flows under a credit window:
sbx-init sends at most :data:`WINDOW` bytes of an exec's output beyond what the client has
acknowledged with :data:`CREDIT`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

VERSION = 1
MAX_PAYLOAD = 1 << 20
MAX_DATA = 64 << 10
MAX_STRINGS = 8192
MAX_EXECS = 256
WINDOW = 256 << 10

HDR = struct.Struct("<IHHII")
EXEC = struct.Struct("<IIQQIHHII")
SIGNAL = struct.Struct("<iI")
RESIZE = struct.Struct("<HHI")
CREDIT_S = struct.Struct("<II")
HELLO_S = struct.Struct("<IIII")
STARTED_S = struct.Struct("<II")
END_S = struct.Struct("<IiiIQQ")
ERROR_S = struct.Struct("<iI")
#: struct sbx_event: kind, pid, nr, arch, args[6], ip, dropped, reserved, comm[16]
EVENT_S = struct.Struct("<IIiI6QQII16s")
#: struct sbx_file: mode, uid, gid, flags (then the path, NUL-terminated)
FILE_S = struct.Struct("<IIII")
#: struct sbx_done: count, reserved
DONE_S = struct.Struct("<QQ")
MAX_FILES = 16
MAX_PATH = 4096

assert HDR.size == 16 and EXEC.size == 40 and END_S.size == 32 and EVENT_S.size == 96
assert FILE_S.size == 16 and DONE_S.size == 16

# client -> sbx-init
HELLO = 1
EXEC_T = 2
STDIN = 3
STDIN_EOF = 4
SIGNAL_T = 5
RESIZE_T = 6
KILL = 7
CREDIT = 8
KILL_ALL = 9
FILE_PUT = 10
FILE_DATA = 11
FILE_END = 12
FILE_GET = 13
FILE_CREDIT = 14
FILE_ABORT = 15
QUIESCE = 16  # answered with DONE; sbx-init then sends nothing until our next frame
#: HELLO's header flag: another client than the one before on this stream (its execs go)
HELLO_NEW_CLIENT = 0x1
# sbx-init -> client
HELLO_OK = 0x81
STARTED = 0x82
STDOUT = 0x83
STDERR = 0x84
END = 0x85
ERROR = 0x86
EVENT = 0x87
DONE = 0x88

#: SBX_EVENT kinds
EV_SECCOMP = 1
EV_DROPPED = 2  # only ``dropped``: denials not sent one by one, before an exec's END
EV_DISK_FULL = 3  # a guest's upper disk is full at an exec's end; args[0]: its bytes

EXEC_STDIN = 0x1
EXEC_PTY = 0x2
EXEC_GRADER = 0x4  # the task profile's grader_view paths as the layers hold them

CGROUP_MODES = {0: "none", 1: "v1", 2: "v2"}

#: enum sbx_reason -> ExecEnd.reason
REASONS = {1: "exited", 2: "signalled", 3: "timeout", 4: "oom", 5: "output_limit", 6: "killed"}


def frame(type_: int, exec_id: int = 0, payload: bytes = b"", flags: int = 0) -> bytes:
    """One encoded frame. Raises ValueError if ``payload`` exceeds :data:`MAX_PAYLOAD`."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HDR.pack(len(payload), type_, flags, exec_id, 0) + payload


def exec_frame(
    exec_id: int,
    argv: tuple[str, ...],
    env: dict[str, str],
    cwd: str,
    uid: int,
    gid: int,
    timeout_ms: int,
    output_limit: int,
    flags: int,
    rows: int = 0,
    cols: int = 0,
) -> bytes:
    """Encode an EXEC request. Raises ValueError for input sbx-init would refuse (empty argv,
    a NUL inside a string, too many strings, payload too large), naming the entry."""
    if not argv or not argv[0]:
        raise ValueError("argv: must have a non-empty argv[0]")
    strings = [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
    if len(argv) + len(env) > MAX_STRINGS:
        raise ValueError(f"argv+env: {len(argv) + len(env)} strings exceed {MAX_STRINGS}")
    for k in env:
        if not k or "=" in k:
            raise ValueError(f"env: bad variable name {k!r}")
    parts = []
    for s in strings:
        b = s.encode("utf-8", "surrogateescape")
        if b"\0" in b:
            raise ValueError(f"argv/env/cwd: NUL byte in {s[:40]!r}")
        parts.append(b + b"\0")
    payload = (
        EXEC.pack(uid, gid, timeout_ms, output_limit, flags, rows, cols, len(argv), len(env))
        + b"".join(parts)
    )
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"argv+env: {len(payload)} bytes exceed {MAX_PAYLOAD}")
    return frame(EXEC_T, exec_id, payload)


def file_frame(type_: int, request_id: int, path: str, mode: int = 0, uid: int = 0,
               gid: int = 0) -> bytes:
    """Encode a FILE_PUT or FILE_GET request. Raises ValueError for a path sbx-init would
    refuse (not absolute, a NUL in it, too long)."""
    b = path.encode("utf-8", "surrogateescape")
    if not b.startswith(b"/") or b"\0" in b or len(b) + 1 > MAX_PATH:
        raise ValueError(f"path {path[:60]!r}: must be absolute, without NUL, at most "
                         f"{MAX_PATH - 1} bytes")
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"mode {mode:#o} out of range")
    return frame(type_, request_id, FILE_S.pack(mode, uid, gid, 0) + b + b"\0")


@dataclass(frozen=True)
class Frame:
    """A decoded frame from sbx-init."""

    type: int
    exec_id: int
    payload: bytes


class Decoder:
    """Incremental frame decoder for bytes received from sbx-init."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """Add received bytes; return the complete frames. Raises ValueError on a frame
        larger than :data:`MAX_PAYLOAD` (a broken peer)."""
        self._buf += data
        out: list[Frame] = []
        off = 0
        while len(self._buf) - off >= HDR.size:
            length, type_, _flags, exec_id, _r = HDR.unpack_from(self._buf, off)
            if length > MAX_PAYLOAD:
                raise ValueError(f"sbx-init sent a frame of {length} bytes")
            if len(self._buf) - off - HDR.size < length:
                break
            start = off + HDR.size
            out.append(Frame(type_, exec_id, bytes(self._buf[start : start + length])))
            off = start + length
        del self._buf[:off]
        return out
