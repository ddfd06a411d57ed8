"""The call server: the long-lived processes of one FnCall pool sandbox. Runs INSIDE a
sandbox only, and refuses to run anywhere else (see :func:`why_not_in_sandbox`).

Started by the daemon as one exec of sbx-init in a pool sandbox (``python3 -I -B -c
<this file's source> --host-pidns pid:[N] --preload a,b``, as the sandbox's root, confined
like every exec: task profile ``fncall``, which lets it change only /tmp and /dev/shm). It
imports nothing of edged: the sandbox's own Python runs it.

**The guard, before anything else.** The first thing :func:`main` does, before it imports,
reads or changes anything, is to check that it runs in a sandbox's own pid namespace: PID 1
must be ``sbx-init`` (``/proc/1/comm``), it must not be PID 1 itself, and its pid namespace
(``/proc/self/ns/pid``) must be neither the kernel's initial one (inode ``0xEFFFFFFC``,
``PROC_PID_INIT_INO`` in include/linux/proc_ns.h) nor the one the daemon runs in (given as
``--host-pidns``). Anywhere else it exits with status :data:`REFUSED` having done nothing:
run by hand on a host, as root, its wipe of /tmp would remove the host's files. The wipe
also checks the guard passed.

**It kills nothing but its own child.** A call's main process is killed (wall time) through
the pidfd of the fork that made it; nothing else is ever signalled from here: no
``kill(-1)``, no process group, no pid read from /proc. What a call leaves running (a
daemon, a fork bomb) is found (a process of the call's uid, not a zombie) and reported as
``leftovers``; the daemon then removes the whole sandbox through its cgroups (bounded by
construction: cgroups the daemon made) and starts another.

Two processes, split before any call's data is seen, and a third for programs:

- the **io process** (the exec's main process): reads requests from stdin, writes the
  call's files into /tmp, hands the zygote a request that holds only paths and limits,
  reads the outputs back, wipes /tmp and /dev/shm, answers on stdout;
- the **zygote**, forked from it once the preload modules are imported: forks one child
  per call and waits for it. It never reads a call's code, input or output, so no call's
  data is in its memory for the next call's child to find there;
- the **spawner** (``fncall-spawn``, C: ``csrc/fncall/spawn.c``), when the daemon sent its
  binary (``--spawn-size N``: the first N bytes on stdin, written to /dev/shm/.fncall, started,
  then removed): runs the calls that exec a program (``argv``: compiled
  programs, ``/bin/true``, bash) with vfork, so such a call copies no Python process's page
  tables and takes none of its copy-on-write faults. It sets up the child as the zygote's
  child does (below; "a Python call gets" does not apply) and has its own guard. Without
  it (not sent, or it could not be started: ``spawner_error`` in the ready line), the
  zygote runs those calls too.

A call's child (forked from the zygote; what it inherits and what it must not, held by
``tests/edged/backends/fncall/test_forkserver.py``):

- inherits: the modules imported by the zygote, as they were after import (the zygote runs
  no call's code; not ``threading``, see :func:`_zygote`), all of them in the collector's
  frozen generation (``gc.freeze``; the child's own objects are collected as usual); a
  Python call's text streams over fds 0-2, made once by the zygote and never used there
  (:func:`_prepare`); ``str`` hash randomisation (one seed per pool sandbox); nothing else
  of the environment than what the request names;
- does not inherit: any file descriptor of the zygote or the io process (it gets 0, 1, 2:
  its stdin file and its stdout and stderr files; every other descriptor is closed); a
  previous call's data (see above; /tmp and /dev/shm are wiped between calls); ``random``'s
  state (CPython reseeds it in a forked child); the privileges (it drops to the request's
  uid and gid, no supplementary groups, no capabilities: it cannot signal, trace or read
  the server, which runs as the sandbox's root); signal dispositions (defaults, then a
  Python call gets what an interpreter start sets: SIGPIPE and SIGXFSZ ignored, SIGINT
  raising KeyboardInterrupt); the server's resource limits (RLIMIT_CPU, RLIMIT_FSIZE,
  RLIMIT_AS from the request; RLIMIT_CORE 0).

Wire format (both ways): one JSON line, then the payload bytes its sizes announce.
Request ``{"id", "files": [[relpath, size, mode]], "stdin": size | null, "argv": [...] |
null (Python: run "script"), "script", "args", "env", "uid", "gid", "wall_s", "cpu_s",
"fsize", "as_bytes", "output", "fetch": [relpath]}`` followed by the files' bytes, then
stdin's. Answer ``{"id", "exit_code", "signal", "timed_out", "cpu_s", "wall_s",
"rss_bytes", "stdout": [size, total], "stderr": [size, total], "files": [[relpath, size |
null]], "leftovers", "ipc", "error"}`` followed by stdout (at most ``output`` bytes),
stderr, and each fetched file (``null``: absent, not a regular file, or larger than
``fetch_limit``); a ``*`` pattern in ``fetch`` stands for the matching names at the top of
the working directory. The first line the server writes is ``{"ready": true,
"preload_failed": [...], "present": [...]}`` (which of the ``--probe`` paths exist).
"""

from __future__ import annotations

import os
import sys

#: not ``typing.TYPE_CHECKING``: the server does not import typing (a large module every
#: call's child would inherit); mypy takes this name as that
TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import Any, NoReturn

#: exit status of a server that refused to run (not inside a sandbox)
REFUSED = 3
#: the kernel's initial pid namespace (PROC_PID_INIT_INO, include/linux/proc_ns.h)
PROC_PID_INIT_INO = 0xEFFFFFFC
#: where a call runs (its working directory), and where the server keeps its files (a call's
#: stdin, stdout and stderr, root's, mode 0700): on /dev/shm, a tmpfs of its own, whose
#: creates, reads and removals cost a third of what they cost in /tmp on the overlay root
WORK = "/tmp/work"
PRIVATE = "/dev/shm/.fncall"
#: what is wiped between calls: everything a call may change (the task profile "fncall")
SCRATCH = ("/tmp", "/dev/shm")
#: a job for the spawner at most (one datagram; execve takes 128 KiB per string at most)
SPAWN_JOB_MAX = 1 << 17
#: a job for the zygote in one datagram at most; a larger one (a Python call's environment
#: or arguments) goes by a file of the server's, the datagram naming it
ZYGOTE_MSG_MAX = 1 << 16

_guarded = False


def why_not_in_sandbox(host_pidns: str | None) -> str | None:
    """None when this process runs in a sandbox's own pid namespace, else why not (a
    sentence). ``host_pidns``: the daemon's ``/proc/self/ns/pid`` link text, or None."""
    try:
        with open("/proc/1/comm") as f:
            comm = f.read().strip()
    except OSError as e:
        return f"cannot read /proc/1/comm: {e}"
    if comm != "sbx-init":
        return f"PID 1 is {comm!r}, not sbx-init"
    if os.getpid() == 1:
        return "this process is PID 1"
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError as e:
        return f"cannot read /proc/self/ns/pid: {e}"
    if ns == f"pid:[{PROC_PID_INIT_INO}]":
        return f"it runs in the initial pid namespace ({ns})"
    if not host_pidns:
        return "the daemon's pid namespace was not given (--host-pidns)"
    if ns == host_pidns:
        return f"it runs in the daemon's pid namespace ({ns})"
    return None


def _args(argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"host_pidns": None, "preload": "", "probe": "", "spawn_size": 0}
    it = iter(argv)
    for a in it:
        if a == "--host-pidns":
            out["host_pidns"] = next(it, None)
        elif a == "--preload":
            out["preload"] = next(it, "")
        elif a == "--probe":
            out["probe"] = next(it, "")
        elif a == "--spawn-size":
            out["spawn_size"] = int(next(it, "0"))
    return out


def main(argv: list[str] | None = None) -> None:
    """The guard (see the module), then serve until stdin ends."""
    argv = sys.argv[1:] if argv is None else argv
    opts = _args(argv)
    why = why_not_in_sandbox(opts["host_pidns"])
    if why is not None:
        os.write(2, (f"fncall server: refusing to run: {why}\n").encode())
        os._exit(REFUSED)
    global _guarded
    _guarded = True
    _serve(opts)


# -- from here on, only ever reached inside a sandbox ------------------------------------------

def _serve(opts: dict[str, Any]) -> None:
    import importlib
    import json
    import socket

    failed = []
    for name in [m for m in opts["preload"].split(",") if m]:
        try:
            importlib.import_module(name)
        except Exception as e:
            failed.append(f"{name}: {e}")
    # The zygote is forked before the io process does anything else: what the io process
    # imports later stays out of the zygote, whose page tables every call's fork copies.
    zy, io = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        io.close()
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 0)  # the control pipe is the io process's alone
        os.dup2(devnull, 1)
        os.close(devnull)
        _zygote(zy)
        os._exit(0)
    zy.close()
    _wipe()
    out = _Out()
    inp = _In(0)
    spawner = spawn_pid = spawn_error = None
    if opts["spawn_size"]:
        binary = inp.exactly(opts["spawn_size"])
        try:
            spawner, spawn_pid = _start_spawner(binary, opts["host_pidns"])
        except OSError as e:
            spawn_error = str(e)
    present = [p for p in opts["probe"].split(",") if p and os.path.exists(p)]
    #: the server's own processes (and sbx-init), never a call's: not read for leftovers
    servers = frozenset(str(p) for p in (1, os.getpid(), pid, spawn_pid) if p)
    _private()
    out.line({"ready": True, "preload_failed": failed, "zygote": pid, "spawner": spawn_pid,
              "spawner_error": spawn_error, "present": present})
    while True:
        head = inp.line()
        if head is None:
            return
        try:
            req = json.loads(head)
        except ValueError as e:
            out.line({"id": None, "error": f"bad request: {e}"})
            return
        try:
            rep, blobs = _call(req, inp, io, spawner, servers)
        except _Fatal as e:
            out.line({"id": req.get("id"), "error": str(e), "fatal": True})
            return
        # one write: sbx-init reads it at once and sends the daemon one frame, not three
        out.write(b"".join([(json.dumps(rep) + "\n").encode(), *blobs]))


def _start_spawner(binary: bytes, host_pidns: str) -> tuple[socket.socket, int]:
    """Start ``fncall-spawn`` from its ``binary``: (the socket to it, its pid)."""
    import socket

    os.makedirs(PRIVATE, mode=0o700, exist_ok=True)
    path = os.path.join(PRIVATE, "fncall-spawn")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
    try:
        _write_all(fd, binary)
    finally:
        os.close(fd)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.posix_spawn(path, [path, "--host-pidns", host_pidns], {}, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDWR, 0),  # not the control pipe
            (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_RDWR, 0),
            (os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)])
    except OSError:
        mine.close()
        raise
    finally:
        theirs.close()
        os.unlink(path)
    return mine, pid


def _spawn_job(job: dict[str, Any]) -> bytes:
    """A job for ``fncall-spawn`` (its wire format: ``csrc/fncall/spawn.c``). Raises
    ValueError for a NUL byte in an argument or the environment (as execve would), or a
    job larger than :data:`SPAWN_JOB_MAX`."""
    fields = [f"u{job['uid']}", f"g{job['gid']}", f"w{float(job.get('wall_s') or 0)}",
              f"c{float(job.get('cpu_s') or 0)}", f"f{int(job.get('fsize') or 0)}",
              f"m{int(job.get('as_bytes') or 0)}", "i" + job["stdin"], "o" + job["stdout"],
              "e" + job["stderr"], "d" + job["cwd"]]
    fields += ["a" + str(a) for a in job["argv"]]
    for k, v in (job.get("env") or {}).items():
        if "=" in k or not k:
            raise ValueError(f"environment variable name {k!r}")
        fields.append(f"E{k}={v}")
    if any("\0" in f for f in fields):
        raise ValueError("embedded null byte")
    msg = b"".join(f.encode("utf-8", "surrogateescape") + b"\0" for f in fields)
    if len(msg) > SPAWN_JOB_MAX:
        raise ValueError(f"argv and environment: {len(msg)} bytes, more than {SPAWN_JOB_MAX}")
    return msg


class _Fatal(Exception):
    """The server cannot go on (its zygote is gone, a wipe failed): it answers and exits;
    the daemon recycles the sandbox."""


class _In:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def line(self) -> bytes | None:
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = os.read(self.fd, max(1 << 16, n - len(self.buf)))
            if not chunk:
                raise _Fatal("stdin ended inside a request")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n:]
        return data


class _Out:
    def line(self, obj: object) -> None:
        import json

        self.write((json.dumps(obj) + "\n").encode())

    @staticmethod
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]


def _safe_rel(rel: object) -> str | None:
    """``rel`` as a path under the working directory, or None if it would leave it."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return None
    norm = os.path.normpath(os.path.join(WORK, rel))
    if norm != WORK and norm.startswith(WORK + "/"):
        return norm
    return None


def _call(req: dict[str, Any], inp: _In, zy: socket.socket, spawner: socket.socket | None,
          servers: frozenset[str] = frozenset()) -> tuple[dict[str, Any], list[bytes]]:
    import json
    import marshal

    uid, gid = int(req.get("uid", 65534)), int(req.get("gid", 65534))
    if _kept is None:  # the wipe found it not the one made (see _private)
        _private()
    os.mkdir(WORK, 0o755)
    os.chown(WORK, uid, gid)
    err = None
    for rel, size, mode in req.get("files", []):
        data = inp.exactly(int(size))
        path = _safe_rel(rel)
        if path is None:
            err = err or f"file {rel!r}: not a path inside the working directory"
            continue
        parent = os.path.dirname(path)
        if parent != WORK and not os.path.isdir(parent):
            os.makedirs(parent, 0o755, exist_ok=True)
            p = parent
            while p != WORK:
                os.chown(p, uid, gid)
                p = os.path.dirname(p)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     int(mode) & 0o777)
        try:
            _write_all(fd, data)
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
    stdin = os.path.join(PRIVATE, "stdin")
    own = ["stdout", "stderr"]  # the server's files of this call in PRIVATE
    if req.get("stdin") is not None:
        own.append("stdin")
        fd = os.open(stdin, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, inp.exactly(int(req["stdin"])))
        finally:
            os.close(fd)
    else:
        stdin = "/dev/null"
    rep = {"id": req.get("id"), "error": err}
    if err is None:
        job = {k: req.get(k) for k in ("argv", "script", "args", "env", "wall_s", "cpu_s",
                                      "fsize", "as_bytes")}
        job.update(uid=uid, gid=gid, cwd=WORK, stdin=stdin,
                   stdout=os.path.join(PRIVATE, "stdout"),
                   stderr=os.path.join(PRIVATE, "stderr"))
        # the zygote speaks marshal (see _zygote), the spawner its own format and JSON
        to, who, msg = zy, "zygote", b""
        decode: Callable[[bytes], Any] = marshal.loads
        if spawner is not None and job.get("argv"):
            to, who, decode = spawner, "spawner", json.loads
            try:
                msg = _spawn_job(job)
            except ValueError as e:
                rep["error"] = f"cannot start the call: {e}"
        if rep["error"] is None:
            if not msg:
                msg = marshal.dumps(job)
                if len(msg) > ZYGOTE_MSG_MAX:
                    own.append("job")
                    path = os.path.join(PRIVATE, "job")
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                                 0o600)
                    try:
                        _write_all(fd, msg)
                    finally:
                        os.close(fd)
                    msg = marshal.dumps({"job_file": path})
            try:  # a blocking socket: the daemon gives up on a call that does not end
                to.send(msg)
                answer = to.recv(1 << 16)
            except OSError as e:
                raise _Fatal(f"{who}: {e}") from e
            if not answer:
                raise _Fatal(f"{who}: gone")
            rep.update(decode(answer))
    limit = int(req.get("output") or (1 << 20))
    blobs = []
    for name in ("stdout", "stderr"):
        data, total = _read_capped(os.path.join(PRIVATE, name), limit)
        rep[name] = [len(data), total]
        blobs.append(data)
    files = []
    for rel in _expand(req.get("fetch", [])):
        path = _safe_rel(rel)
        got = None if path is None else _read_file(path, int(req.get("fetch_limit") or limit))
        files.append([rel, None if got is None else len(got)])
        if got is not None:
            blobs.append(got)
    rep["files"] = files
    rep["leftovers"] = _leftovers(uid, servers)
    rep["ipc"] = _ipc_left()
    try:
        for name in own:  # PRIVATE itself is kept (see _private)
            try:  # noqa: SIM105 - no context manager per file in the per-call path
                os.unlink(os.path.join(PRIVATE, name))
            except FileNotFoundError:
                pass
        _wipe()
    except OSError as e:
        raise _Fatal(f"wipe: {e}") from e
    return rep, blobs


#: the inode number of the directory PRIVATE the server made as its parent's listing gives it
#: (``d_ino``: on an overlay root it is not ``st_ino``), kept across calls (see
#: :func:`_private`); None until made, and again once a wipe found another in its place
_kept: int | None = None


def _private() -> None:
    """Make :data:`PRIVATE` (the sandbox root's, mode 0700: no call, as uid 65534 without
    capabilities, can enter, change or, its parent being sticky, rename it) and remember which
    directory it is: kept across calls, so a call's wipe removes only the server's files
    in it (:func:`_call`), and :func:`_wipe` spares that directory alone, by the inode
    number its parent's listing gives (what the wipe compares), never an entry of the same
    name a call could have made. Raises _Fatal if what is there is not a directory of the
    server's with that mode."""
    import stat

    global _kept
    try:  # noqa: SIM105 - contextlib is not imported for this
        os.mkdir(PRIVATE, 0o700)
    except FileExistsError:
        pass  # the spawner's start made it
    st = os.lstat(PRIVATE)
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or stat.S_IMODE(st.st_mode) != 0o700):
        raise _Fatal(f"{PRIVATE}: not the server's directory (mode {st.st_mode:o}, "
                     f"uid {st.st_uid})")
    with os.scandir(_PRIVATE_TOP) as it:
        ino = [e.inode() for e in it if e.name == _PRIVATE_NAME]
    if len(ino) != 1:
        raise _Fatal(f"{PRIVATE}: not in the listing of {_PRIVATE_TOP}")
    _kept = ino[0]


def _expand(fetch: list[Any]) -> list[Any]:
    """The paths to read back: each as given, a ``*`` pattern as the names of the working
    directory's top that match it (sorted)."""
    import fnmatch

    out = []
    for rel in fetch:
        if isinstance(rel, str) and "*" in rel and "/" not in rel:
            try:
                names = sorted(os.listdir(WORK))
            except OSError:
                names = []
            out += [n for n in names if fnmatch.fnmatchcase(n, rel)]
        else:
            out.append(rel)
    return out


def _read_all(path: str) -> bytes:
    """The whole file at ``path`` (one of the server's own: no call can write there)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        chunks = []
        while c := os.read(fd, 1 << 20):
            chunks.append(c)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_capped(path: str, limit: int) -> tuple[bytes, int]:
    """(the first ``limit`` bytes of the file, its size); (b"", 0) if absent. Read up to
    its size when opened (what a process left running writes later is not waited for)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return b"", 0
    try:
        total = os.fstat(fd).st_size
        want = min(limit, total)
        chunks, n = [], 0
        while n < want:
            c = os.read(fd, min(1 << 20, want - n))
            if not c:
                break
            chunks.append(c)
            n += len(c)
        return b"".join(chunks), total
    finally:
        os.close(fd)


def _read_file(path: str, limit: int) -> bytes | None:
    """A fetched file's bytes, or None (absent, not a regular file, larger than ``limit``).
    Never follows a symlink the call planted as the last component."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data, _ = _read_capped(path, limit)
        return data
    finally:
        os.close(fd)


def _leftovers(uid: int, servers: frozenset[str] = frozenset()) -> bool:
    """Whether any live process of the call's ``uid`` is left (zombies excepted): a call
    that daemonised or fork-bombed. Read from /proc/<pid>/status (the real uid; a process
    that made itself non-dumpable still shows its uid there). ``servers``: the pids (as
    /proc names them) of the server's own live processes and sbx-init, which run as root
    and are not read (a call cannot be one of them: they live, so their pids are not
    reused)."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or name in servers:
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue  # gone meanwhile
        state = uids = None
        for line in status.splitlines():
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("Uid:"):
                uids = line.split()[1:]
                break
        if uids and state not in ("Z", "X") and str(uid) in uids:
            return True
    return False


def _ipc_left() -> bool:
    """Whether System V IPC objects exist in this IPC namespace (a call made them; they
    would outlive it, and only their owner may remove them): a /proc/sysvipc file holds
    more than its heading line."""
    for kind in ("shm", "sem", "msg"):
        try:
            fd = os.open("/proc/sysvipc/" + kind, os.O_RDONLY)
        except OSError:
            continue
        try:
            # one read: a seq_file read fills the buffer with as many lines as fit
            if os.read(fd, 1 << 12).count(b"\n") > 1:
                return True
        finally:
            os.close(fd)
    return False


def _wipe() -> None:
    """Remove everything beneath the scratch paths (/tmp, /dev/shm): what a call left,
    but the server's own directory :data:`PRIVATE` (that inode, see :func:`_private`;
    emptied of the server's files by :func:`_call`). Symlinks are removed, never
    followed: every directory is opened with ``O_NOFOLLOW`` relative to its parent's
    descriptor and emptied through its own (:func:`_rmtree_at`)."""
    global _kept
    if not _guarded:  # never on a host: see main()
        raise RuntimeError("fncall server: wipe outside a sandbox")
    kept, _kept = _kept, None
    for top in SCRATCH:
        try:  # the tops are the sandbox's mounts, not a call's to replace: followed
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            if _empty_at(fd, kept if top == _PRIVATE_TOP else None):
                _kept = kept  # spared: still the server's
        finally:
            os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PRIVATE_TOP, _, _PRIVATE_NAME = PRIVATE.rpartition("/")


def _empty_at(fd: int, keep: int | None = None) -> bool:
    """Remove every entry of the directory open at ``fd`` but the directory named as
    :data:`PRIVATE` whose inode is ``keep``, if given; whether that one was there and
    spared. (An entry is on its directory's file system: nothing is mounted in the
    scratch paths but by the sandbox's making, and a call cannot mount.)"""
    spared = False
    with os.scandir(fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False), e.inode()) for e in it]
    for name, is_dir, ino in entries:
        if is_dir and ino == keep and name == _PRIVATE_NAME:
            spared = True
            continue
        if is_dir:
            _rmtree_at(fd, name)
        else:
            os.unlink(name, dir_fd=fd)
    return spared


def _rmtree_at(parent: int, name: str) -> None:
    """Remove the directory ``name`` of the directory open at ``parent`` and all beneath
    it. Raises OSError (ELOOP, ENOTDIR: it was swapped for a symlink or a file meanwhile)."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        _empty_at(fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


# -- the zygote -----------------------------------------------------------------------------

def _zygote(sock: socket.socket) -> None:
    # What a call's child uses, imported once here rather than in every child (an import
    # of a C extension is a dlopen), and bound as globals (an import statement in the child
    # looks the module up and reads its spec: writes to pages it would not touch otherwise).
    global _signal, _resource, _types, _builtins, _select, _time
    import _signal  # type: ignore[import-not-found]  # the C module (no stub)
    import builtins as _builtins
    import io  # noqa: F401
    import marshal
    import resource as _resource
    import select as _select
    import signal  # noqa: F401
    import time as _time
    import traceback  # noqa: F401
    import types as _types

    # Not threading: imported, its at-fork hook runs in every child (~80 page faults and
    # ~0.5 ms of CPU a call); a call that uses threads imports it itself.
    _prepare()
    # The loop is lean on purpose: every page the zygote writes after a fork is a page
    # fault (a copy while the child lives), so requests and answers are marshal (one C
    # call each way), not json.
    loads, dumps, run = marshal.loads, marshal.dumps, _run_child
    while True:
        try:
            msg = sock.recv(ZYGOTE_MSG_MAX)
        except OSError:
            return
        if not msg:
            return
        try:
            job = loads(msg)
            if "job_file" in job:  # larger than a datagram: the io process's file
                job = loads(_read_all(job["job_file"]))
            rep = run(job)
        except Exception as e:
            rep = {"error": f"{type(e).__name__}: {e}"}
        sock.send(dumps(rep))


#: set by :func:`_prepare` in the zygote: the signals whose disposition a child resets (those
#: not at their default), whether a child can raise its ``oom_score_adj``, a Python call's
#: stdin, stdout and stderr
_RESET_SIGNALS: tuple[int, ...] = ()
#: the same for a Python call: those of :data:`_RESET_SIGNALS` a Python call would set
#: back to what the zygote has anyway (SIGPIPE and SIGXFSZ ignored, SIGINT raising
#: KeyboardInterrupt: an interpreter start's) are left as they are
_RESET_SIGNALS_PY: tuple[int, ...] = ()
#: (signal, handler) a Python call sets because the zygote's differs from an interpreter's
_SET_SIGNALS_PY: tuple[tuple[int, Any], ...] = ()
_OOM_ADJ = False
_STREAMS: dict[str, Any] = {}
#: the interpreter's own streams, replaced by those in the zygote (kept, never flushed)
_ORIGINAL_STREAMS: list[Any] = []
#: a Python call's ``__main__`` module, made once by the zygote, never used there
_MAIN: Any = None
#: modules the child uses, bound by :func:`_zygote`
_signal: Any = None
_resource: Any = None
_types: Any = None
_builtins: Any = None
_select: Any = None
_time: Any = None


def _streams() -> dict[str, Any]:
    """sys.stdin, stdout and stderr of a Python call, over fds 0, 1 and 2, as an
    interpreter makes them for files (UTF-8; stderr line-buffered, backslashreplace)."""
    import io

    return {
        "stdin": io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8"),
        "stdout": io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8"),
        "stderr": io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8",
                                   errors="backslashreplace", line_buffering=True),
    }


def _install(streams: dict[str, Any]) -> None:
    """Make ``streams`` sys.stdin, stdout, stderr (and ``sys.__stdin__``...)."""
    for name, stream in streams.items():
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _prepare() -> None:
    """Once in the zygote, before its first fork: do here what every child would do alike.

    - the signals a child must reset: those the kernel holds as ignored or caught for this
      process (``SigIgn``/``SigCgt`` of /proc/self/status; the zygote's dispositions never
      change after this), so that a child makes a few ``sigaction`` calls, not 62; for a
      Python call, fewer still: not those it would set again to what they are (SIGPIPE and
      SIGXFSZ ignored, SIGINT's ``default_int_handler``); glibc's own (32 to SIGRTMIN - 1)
      never, sigaction refuses them;
    - the environment emptied (``os.environ`` and the C library's): a child starts from
      none and sets what its request names, instead of unsetting the server's variables
      one by one in every call;
    - whether ``/proc/self/oom_score_adj`` can be opened for writing at all (the task
      profile's Landlock rules may refuse it: then no child tries, and fails, every call);
    - a Python call's text streams (:func:`_streams`), made over fds 0-2 while each is
      ``/dev/null``, and made the zygote's ``sys.stdin``, ``stdout``, ``stderr`` (the
      zygote never writes to them: its stdout is /dev/null, its fd 2 the exec's stderr
      again once they are made): a child, whose fds 0-2 are then its own files (opened at
      offset 0, seekable, as ``/dev/null`` is), finds them pristine in place instead of
      making three streams and their codecs, or even setting them; and its ``__main__``
      module, empty, as an interpreter makes it;
    - the first use of ``compile``, on no call's data;
    - then every object is moved to the collector's permanent generation (``gc.freeze``):
      a child's collections (and the zygote's own) never visit the inherited objects, so
      they do not write to, and take copy-on-write faults on, the pages holding them.
    """
    import gc
    import signal

    global _RESET_SIGNALS, _RESET_SIGNALS_PY, _SET_SIGNALS_PY, _OOM_ADJ, _STREAMS, _MAIN
    masks = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("SigIgn:", "SigCgt:")):
                masks |= int(line.split()[1], 16)
    glibc = range(32, signal.SIGRTMIN)  # SIGCANCEL, SIGSETXID: sigaction refuses them
    _RESET_SIGNALS = tuple(s for s in range(1, signal.NSIG) if masks >> (s - 1) & 1
                           and s not in (signal.SIGKILL, signal.SIGSTOP) and s not in glibc)
    wanted = {signal.SIGPIPE: signal.SIG_IGN, signal.SIGXFSZ: signal.SIG_IGN,
              signal.SIGINT: signal.default_int_handler}
    _SET_SIGNALS_PY = tuple((s, h) for s, h in wanted.items() if signal.getsignal(s) != h)
    _RESET_SIGNALS_PY = tuple(s for s in _RESET_SIGNALS if s not in wanted)
    os.environ.clear()
    try:
        with open("/proc/self/oom_score_adj", "w"):
            _OOM_ADJ = True  # opened, nothing written
    except OSError:
        _OOM_ADJ = False
    saved = os.dup(2)  # the zygote's own stderr (the exec's): put back below
    null = os.open("/dev/null", os.O_RDWR)
    try:
        for i in (0, 1, 2):
            os.dup2(null, i)
        _STREAMS = _streams()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
    _ORIGINAL_STREAMS[:] = [getattr(sys, name) for name in _STREAMS]  # never freed
    _install(_STREAMS)
    _MAIN = _types.ModuleType("__main__")
    setattr(_MAIN, "__builtins__", _builtins)  # noqa: B010 - an attribute mypy does not know
    compile("pass\n", "<prepare>", "exec")
    gc.collect()
    gc.freeze()


def _run_child(job: dict[str, Any]) -> dict[str, Any]:
    select, signal, time = _select, _signal, _time
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(job)
    pidfd = os.pidfd_open(pid)
    timed_out = False
    try:
        wall = job.get("wall_s")
        deadline = t0 + float(wall) if wall else None
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([pidfd], [], [], left)
            if ready:
                break
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                # this call's main process, and nothing else: its own pidfd
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                deadline = None
        _, status, ru = os.wait4(pid, 0)
    finally:
        os.close(pidfd)
    return {"exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out, "cpu_s": ru.ru_utime + ru.ru_stime,
            "wall_s": time.monotonic() - t0, "rss_bytes": ru.ru_maxrss * 1024}


def _child(job: dict[str, Any]) -> NoReturn:
    """In the forked child: become the call, then exec its program or run its Python
    script. Never returns: exit status 127 (the reason on stderr) if the set-up fails."""
    resource, signal = _resource, _signal  # the C module: no enums made per call
    try:
        python = not job.get("argv")
        for s in _RESET_SIGNALS_PY if python else _RESET_SIGNALS:  # see _prepare
            signal.signal(s, signal.SIG_DFL)
        os.setsid()
        fin = os.open(job["stdin"], os.O_RDONLY)
        fout = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        ferr = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for i, fd in enumerate((fin, fout, ferr)):
            os.dup2(fd, i)
        os.closerange(3, 1 << 20)
        os.chdir(job["cwd"])
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if job.get("fsize"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(job["fsize"]), int(job["fsize"])))
        if job.get("cpu_s"):
            soft = max(1, int(float(job["cpu_s"]) + 0.999))
            resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
        if job.get("as_bytes"):
            resource.setrlimit(resource.RLIMIT_AS, (int(job["as_bytes"]), int(job["as_bytes"])))
        if _OOM_ADJ:
            try:  # the call, never the server, is the one OOM-killed
                fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
                try:
                    os.write(fd, b"1000")
                finally:
                    os.close(fd)
            except OSError:
                pass
        os.setgroups([])
        os.setresgid(job["gid"], job["gid"], job["gid"])
        os.setresuid(job["uid"], job["uid"], job["uid"])
        env = job.get("env") or {}
        if not python:
            os.execvpe(job["argv"][0], job["argv"], env)
        _run_python(job, env)
    except BaseException as e:
        try:
            os.write(2, (f"fncall: cannot start the call: {e}\n").encode())
        finally:
            os._exit(127)


def _run_python(job: dict[str, Any], env: dict[str, str]) -> NoReturn:
    """Run the script as ``python3 SCRIPT ARGS`` would: ``__main__``, sys.argv, sys.path[0]
    the script's directory, fresh stdio on fds 0-2, the signals an interpreter start sets,
    exit status 1 with the traceback for an uncaught exception, SystemExit's code."""
    for s, handler in _SET_SIGNALS_PY:  # what an interpreter start sets (see _prepare)
        _signal.signal(s, handler)
    if env:
        os.environ.update(env)  # the zygote's is empty (see _prepare)
    path = f"{job['cwd']}/{job['script']}"  # a name relative to it (languages.py)
    sys.argv = [path, *(job.get("args") or [])]
    sys.path.insert(0, path.rpartition("/")[0])
    if not _STREAMS:  # else the zygote's sys.std* are the call's already (see _prepare)
        _install(_streams())
    main = _MAIN
    if main is None:
        main = _types.ModuleType("__main__")
        setattr(main, "__builtins__", _builtins)  # noqa: B010 - mypy does not know it
    main.__file__ = path
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # our own frames are not the call's
        import traceback

        traceback.print_exception(type(e), e, tb, file=sys.stderr)
        code = 1
    threading = sys.modules.get("threading")
    if threading is not None:  # as the interpreter's exit: only if the call imported it
        import contextlib

        with contextlib.suppress(Exception):
            getattr(threading, "_shutdown")()  # noqa: B009 - non-daemon threads end first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120  # as the interpreter does when flushing stdout fails
    os._exit(code)


if __name__ == "__main__":
    main()
