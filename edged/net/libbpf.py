"""Thin bindings to libbpf (``libbpf.so.1``, Debian's libbpf1 >= 1.1) through cffi's ABI
mode: the few calls edged needs to load the egress object, attach its programs to a cgroup,
read and write its maps and drain its ring buffer. Every call is checked here and a failure
raised as :class:`BpfError` (an :class:`~edged.errors.BackendError`) carrying errno and what
was being done; callers above never see a raw return code.

libbpf >= 1.0 returns NULL or a negative errno and sets ``errno`` (its "strict" mode is the
only mode). Sources: ``bpf/libbpf.h`` and ``bpf/bpf.h`` of libbpf 1.1; attach types from
``linux/bpf.h`` (``enum bpf_attach_type``).
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from typing import Any

from edged.errors import BackendError

_CDEF = """
struct bpf_object;
struct bpf_program;
struct bpf_map;
struct ring_buffer;
typedef int (*ring_buffer_sample_fn)(void *ctx, void *data, size_t size);
typedef int (*libbpf_print_fn_t)(int level, const char *, void *ap);

libbpf_print_fn_t libbpf_set_print(libbpf_print_fn_t fn);
struct bpf_object *bpf_object__open_file(const char *path, const void *opts);
int bpf_object__load(struct bpf_object *obj);
void bpf_object__close(struct bpf_object *obj);
struct bpf_program *bpf_object__find_program_by_name(const struct bpf_object *obj,
                                                     const char *name);
struct bpf_map *bpf_object__find_map_by_name(const struct bpf_object *obj, const char *name);
int bpf_program__fd(const struct bpf_program *prog);
int bpf_map__fd(const struct bpf_map *map);

int bpf_prog_attach(int prog_fd, int attachable_fd, int type, unsigned int flags);
int bpf_prog_detach2(int prog_fd, int attachable_fd, int type);
int bpf_prog_query(int target_fd, int type, uint32_t query_flags, uint32_t *attach_flags,
                   uint32_t *prog_ids, uint32_t *prog_cnt);
int bpf_prog_get_fd_by_id(uint32_t id);
int bpf_map_get_fd_by_id(uint32_t id);
int bpf_obj_get_info_by_fd(int bpf_fd, void *info, uint32_t *info_len);
int bpf_prog_get_next_id(uint32_t start_id, uint32_t *next_id);
int bpf_map_get_next_id(uint32_t start_id, uint32_t *next_id);
int bpf_link_get_next_id(uint32_t start_id, uint32_t *next_id);

int bpf_map_update_elem(int fd, const void *key, const void *value, uint64_t flags);
int bpf_map_lookup_elem(int fd, const void *key, void *value);
int bpf_map_delete_elem(int fd, const void *key);
int bpf_map_get_next_key(int fd, const void *key, void *next_key);

struct ring_buffer *ring_buffer__new(int map_fd, ring_buffer_sample_fn sample_cb, void *ctx,
                                     const void *opts);
void ring_buffer__free(struct ring_buffer *rb);
int ring_buffer__consume(struct ring_buffer *rb);
int ring_buffer__epoll_fd(const struct ring_buffer *rb);
"""

# enum bpf_attach_type (linux/bpf.h)
CGROUP_INET_EGRESS = 1
CGROUP_INET4_CONNECT = 10
CGROUP_INET6_CONNECT = 11
CGROUP_UDP4_SENDMSG = 14
CGROUP_UDP6_SENDMSG = 15
CGROUP_UDP4_RECVMSG = 19
CGROUP_UDP6_RECVMSG = 20
F_ALLOW_MULTI = 1 << 1  # BPF_F_ALLOW_MULTI
# map update flags
BPF_ANY = 0

_lock = threading.Lock()
_state: dict[str, Any] = {}


class BpfError(BackendError):
    """A libbpf call failed; ``errno`` is set (EPERM: no CAP_BPF/CAP_SYS_ADMIN, ENOENT:
    no such key or object, E2BIG: a map is full, ...)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.errno = code


def lib() -> tuple[Any, Any]:
    """``(ffi, lib)``, opened once. Raises :class:`BpfError` (ENOENT) if libbpf.so.1 or cffi
    is missing."""
    with _lock:
        if "lib" not in _state:
            try:
                import cffi

                ffi = cffi.FFI()
                ffi.cdef(_CDEF)
                handle = ffi.dlopen("libbpf.so.1")
            except (ImportError, OSError) as exc:
                raise BpfError(errno.ENOENT, f"libbpf.so.1 not usable: {exc}") from exc
            # Quiet: libbpf's own lines (section warnings, verifier logs) would land raw in
            # the daemon's JSON log on stderr; failures are raised with errno instead.
            handle.libbpf_set_print(ffi.NULL)
            _state["ffi"], _state["lib"] = ffi, handle
        return _state["ffi"], _state["lib"]


def check(rc: int, what: str) -> int:
    """``rc`` if >= 0, else raise :class:`BpfError` with errno (libbpf returns -errno)."""
    if rc < 0:
        code = -rc if rc < -1 else (_ffi_errno() or errno.EIO)
        raise BpfError(code, f"{what}: {os.strerror(code)}")
    return rc


def _ffi_errno() -> int:
    ffi, _ = lib()
    return int(ffi.errno)


def next_ids(kind: str) -> list[int]:
    """Ids of every BPF ``kind`` (``"prog"``, ``"map"``, ``"link"``) on the host (needs
    CAP_SYS_ADMIN): what the leak tests count."""
    ffi, L = lib()
    fn = {"prog": L.bpf_prog_get_next_id, "map": L.bpf_map_get_next_id,
          "link": L.bpf_link_get_next_id}[kind]
    out: list[int] = []
    nxt = ffi.new("uint32_t *")
    cur = 0
    while fn(cur, nxt) == 0:
        cur = int(nxt[0])
        out.append(cur)
    return out


class Map:
    """One map by fd (owned: :meth:`close` closes it). ``key_size``/``value_size`` in bytes."""

    def __init__(self, fd: int, name: str, key_size: int, value_size: int) -> None:
        self.fd = fd
        self.name = name
        self.key_size = key_size
        self.value_size = value_size

    def update(self, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
        """Insert or replace; raises :class:`BpfError` (E2BIG when full)."""
        _, L = lib()
        check(L.bpf_map_update_elem(self.fd, key, value, flags), f"map {self.name}: update")

    def lookup(self, key: bytes) -> bytes | None:
        """The value of ``key``, or None."""
        ffi, L = lib()
        buf = ffi.new("char[]", self.value_size)
        if L.bpf_map_lookup_elem(self.fd, key, buf) < 0:
            if _ffi_errno() == errno.ENOENT:
                return None
            check(-1, f"map {self.name}: lookup")
        return bytes(ffi.buffer(buf, self.value_size))

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False if it was absent."""
        _, L = lib()
        if L.bpf_map_delete_elem(self.fd, key) < 0:
            if _ffi_errno() == errno.ENOENT:
                return False
            check(-1, f"map {self.name}: delete")
        return True

    def keys(self) -> list[bytes]:
        """Every key (a snapshot; entries may change meanwhile)."""
        ffi, L = lib()
        out: list[bytes] = []
        cur = ffi.NULL
        nxt = ffi.new("char[]", self.key_size)
        while L.bpf_map_get_next_key(self.fd, cur, nxt) == 0:
            k = bytes(ffi.buffer(nxt, self.key_size))
            out.append(k)
            cur = ffi.new("char[]", k)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: struct bpf_map_info (linux/bpf.h): type, id, key_size, value_size, max_entries, map_flags,
#: name[16]
_MAP_INFO = struct.Struct("=6I16s")
#: struct bpf_prog_info up to name[16]: type, id, tag[8], jited_len, xlated_len,
#: jited_insns, xlated_insns, load_time, created_by_uid, nr_map_ids, map_ids, name[16]
_PROG_INFO = struct.Struct("=II8sIIQQQIIQ16s")


def map_by_id(map_id: int) -> Map:
    """Open a map by its id (an earlier daemon's, found through the programs it attached)."""
    ffi, L = lib()
    fd = check(L.bpf_map_get_fd_by_id(map_id), f"map id {map_id}")
    buf = ffi.new("char[]", _MAP_INFO.size)
    n = ffi.new("uint32_t *", _MAP_INFO.size)
    try:
        check(L.bpf_obj_get_info_by_fd(fd, buf, n), f"map id {map_id}: info")
    except BpfError:
        os.close(fd)
        raise
    _t, _id, ks, vs, _max, _fl, name = _MAP_INFO.unpack(bytes(ffi.buffer(buf, _MAP_INFO.size)))
    return Map(fd, name.rstrip(b"\0").decode(), ks, vs)


def prog_info(fd: int) -> tuple[str, list[int]]:
    """``(name, map ids)`` of the program ``fd``."""
    ffi, L = lib()
    ids = ffi.new("uint32_t[]", 64)
    raw = bytearray(_PROG_INFO.size)
    _PROG_INFO.pack_into(raw, 0, 0, 0, b"", 0, 0, 0, 0, 0, 0, 64,
                         int(ffi.cast("uintptr_t", ids)), b"")
    buf = ffi.new("char[]", bytes(raw))
    n = ffi.new("uint32_t *", _PROG_INFO.size)
    check(L.bpf_obj_get_info_by_fd(fd, buf, n), "program info")
    fields = _PROG_INFO.unpack(bytes(ffi.buffer(buf, _PROG_INFO.size)))
    nr, name = fields[9], fields[11]
    return name.rstrip(b"\0").decode(), [int(ids[i]) for i in range(min(nr, 64))]


def query(cgroup_fd: int, attach_type: int) -> list[int]:
    """Ids of the programs attached to the cgroup ``cgroup_fd`` for ``attach_type``."""
    ffi, L = lib()
    flags = ffi.new("uint32_t *")
    ids = ffi.new("uint32_t[]", 64)
    cnt = ffi.new("uint32_t *", 64)
    check(L.bpf_prog_query(cgroup_fd, attach_type, 0, flags, ids, cnt), "query cgroup programs")
    return [int(ids[i]) for i in range(int(cnt[0]))]


def prog_fd_by_id(prog_id: int) -> int:
    _, L = lib()
    return check(L.bpf_prog_get_fd_by_id(prog_id), f"program id {prog_id}")


def attach(prog_fd: int, cgroup_fd: int, attach_type: int) -> None:
    """Attach to a cgroup with BPF_F_ALLOW_MULTI: the attachment belongs to the cgroup (it
    outlives the daemon, so a restart leaves sandboxes filtered) and programs attached by
    others above or below still run."""
    _, L = lib()
    check(L.bpf_prog_attach(prog_fd, cgroup_fd, attach_type, F_ALLOW_MULTI),
          f"attach program (type {attach_type})")


def detach(prog_fd: int, cgroup_fd: int, attach_type: int) -> None:
    _, L = lib()
    check(L.bpf_prog_detach2(prog_fd, cgroup_fd, attach_type),
          f"detach program (type {attach_type})")
