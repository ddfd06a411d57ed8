"""Host-wide claims on sandbox uid ranges, so that daemons sharing a host never hand out
the same host uids at the same time.

A sandbox of the container backend maps its ids 0..id_count-1 to the host ids of one *slot*
(``uid_base + slot * id_count ...``); a microVM's VMM runs as the first id of a slot of its
own (:mod:`edged.backends.microvm.backend`), so no VMM shares a uid with a container's ids
or with another VMM. Every daemon on the host (a node's daemon, test
daemons, a second instance on other dirs) claims its slots in one directory, by default
:data:`DEFAULT_DIR` (``/run`` is a tmpfs: claims vanish at reboot, with every process that
could hold a range). Slot ``n`` is claimed by the file ``<dir>/<uid_base>+<id_count>/<n>``,
a small JSON object::

    {"owner": "/run/edged",          # the claiming backend's state dir (resolved)
     "daemon": [pid, starttime],      # the claiming daemon process
     "slot": n,
     "sandbox": "sb1" | null,         # null while a pooled spawner holds the slot
     "init": [pid, starttime] | null} # the sandbox's sbx-init, once it runs

Rules, chosen to hold across crashes (``kill -9`` of any process at any point):

- A claim is made by ``link(2)`` of a fully written temp file to the slot's name, which
  fails with EEXIST if the slot is claimed: two daemons can never both succeed, and no
  reader ever sees a half-written claim.
- A claim is *live* while its daemon or its sbx-init runs (pid and start time, field 22 of
  ``/proc/PID/stat``, so a reused pid does not count), or while the owner's
  ``sandboxes/<id>/meta.json`` names this slot and a live sbx-init (the window between the
  spawner's report and the claim's update; a microVM's meta names its VMM). Sandboxes
  outlive their daemon, so the init part is what keeps a range taken across a daemon
  restart.
- A claim that is not live is *stale* and may be taken over, under the directory's flock
  (``.lock``): re-read under the lock, replaced by ``rename(2)``. Takeovers and releases
  are serialised by that lock, so a release never removes another daemon's claim.
- Only a claim's owner (a backend on the same state dir: the same daemon, restarted) may
  release it or re-bind it to itself (:meth:`UidSlots.bind`, when it adopts the sandbox).

Residual risk: a daemon killed after its spawner started sbx-init but before either the
claim or ``meta.json`` recorded sbx-init's pid leaves a sandbox whose claim looks stale; the
restarted daemon tears such a half-made sandbox down (``cleanup_leftovers``), but another
daemon may take the slot in between. All daemons on a host must use the same ``uid_base``
and ``id_count`` (the defaults) or disjoint uid ranges: claims are per grid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Any

from edged.errors import BackendError

log = logging.getLogger("edged.backends")

#: Where every daemon on the host claims its slots (override per backend for tests only).
DEFAULT_DIR = "/run/edged-uid-slots"


def starttime(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None if gone or a zombie:
    with the pid it identifies a live process across pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _running(ident: object) -> bool:
    """Whether ``[pid, starttime]`` names a live process."""
    if not isinstance(ident, list) or len(ident) != 2:
        return False
    pid, st = ident
    return isinstance(pid, int) and pid > 0 and st is not None and starttime(pid) == st


class UidSlots:
    """The claims of one backend (``owner``: its state dir) on slots ``0..max_slots-1`` of
    the grid ``uid_base``/``id_count``, kept in ``directory`` (see the module docstring).
    Methods are blocking (a few small file operations) and raise :class:`BackendError`
    when the directory cannot be used."""

    def __init__(self, owner: str | os.PathLike[str], *, uid_base: int, id_count: int,
                 max_slots: int | None = None,
                 directory: str | os.PathLike[str] = DEFAULT_DIR) -> None:
        self.owner = str(Path(owner).resolve())
        self.dir = Path(directory) / f"{uid_base}+{id_count}"
        #: default: every slot of the grid below 2**32 - 2 (the highest uid a user
        #: namespace can map, less the overflow id)
        self.max_slots = (max_slots if max_slots is not None
                          else ((1 << 32) - 2 - uid_base) // id_count)
        # Daemons start their search at different places, so that one does not walk past
        # another's claims on every create.
        self._next = zlib.crc32(self.owner.encode()) % max_slots if max_slots else 0

    # -- files ----------------------------------------------------------------------------

    def _path(self, slot: int) -> Path:
        return self.dir / str(slot)

    def _ensure_dir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise BackendError(f"uid slot claims {self.dir}: {exc.strerror}") from exc

    def _body(self, slot: int, sandbox: str | None, init: int | None) -> bytes:
        me = [os.getpid(), starttime(os.getpid())]
        return json.dumps({"owner": self.owner, "daemon": me, "slot": slot,
                           "sandbox": sandbox,
                           "init": None if init is None else [init, starttime(init)]}).encode()

    def _tmp(self, body: bytes) -> Path:
        tmp = self.dir / f".tmp-{os.getpid()}-{id(self)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        return tmp

    def read(self, slot: int) -> dict[str, Any] | None:
        """The claim on ``slot``, or None if unclaimed (an unreadable claim reads as ``{}``:
        stale)."""
        try:
            obj = json.loads(self._path(slot).read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return obj if isinstance(obj, dict) else {}

    def _lock(self) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def held() -> Any:
            fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)
        return held()

    # -- claims ---------------------------------------------------------------------------

    def ours(self, claim: dict[str, Any] | None) -> bool:
        """Whether ``claim`` belongs to this backend (its state dir)."""
        return claim is not None and claim.get("owner") == self.owner

    def live(self, claim: dict[str, Any]) -> bool:
        """Whether ``claim``'s daemon or sandbox still runs (see the module docstring)."""
        if _running(claim.get("daemon")) or _running(claim.get("init")):
            return True
        owner, sid = claim.get("owner"), claim.get("sandbox")
        if not isinstance(owner, str) or not isinstance(sid, str) or "/" in sid:
            return False
        try:
            meta = json.loads(Path(owner, "sandboxes", sid, "meta.json").read_bytes())
        except (OSError, ValueError):
            return False
        return (isinstance(meta, dict) and meta.get("slot") == claim.get("slot")
                and _running([meta.get("pid"), meta.get("starttime")]))

    def claim(self, skip: set[int], sandbox: str | None = None) -> int:
        """Claim a free slot not in ``skip`` (slots this backend tracks itself) and return
        it. Raises :class:`BackendError` if every slot is taken."""
        self._ensure_dir()
        n = self._next
        for _ in range(self.max_slots):
            if n not in skip and self._try(n, sandbox):
                self._next = (n + 1) % self.max_slots
                return n
            n = (n + 1) % self.max_slots
        raise BackendError("no free uid range for another sandbox (every slot is claimed "
                           f"in {self.dir})")

    def _try(self, slot: int, sandbox: str | None) -> bool:
        tmp = self._tmp(self._body(slot, sandbox, None))
        try:
            try:
                os.link(tmp, self._path(slot))
                return True
            except FileExistsError:
                pass
            claim = self.read(slot)
            if claim is None or (claim and self.live(claim)):
                return False  # released meanwhile (the next pass sees it), or taken
            with self._lock():
                again = self.read(slot)
                if again != claim:
                    return False  # changed under us: another daemon's now
                os.rename(tmp, self._path(slot))
                log.info("uid slot %d: took over a stale claim %s", slot, claim)
                return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def bind(self, slot: int, sandbox: str, init: int | None) -> bool:
        """Record that ``slot`` is ``sandbox``'s, run by sbx-init ``init`` (host pid): the
        claim then outlives this daemon. Also re-claims a slot of an adopted sandbox (its
        claim names the daemon that made it, or predates claims). Returns False, logged as
        an error, if another live owner holds the slot (ids are then shared)."""
        self._ensure_dir()
        tmp = self._tmp(self._body(slot, sandbox, init))
        try:
            with self._lock():
                claim = self.read(slot)
                if claim and not self.ours(claim) and self.live(claim):
                    log.error("uid slot %d (sandbox %s) is claimed by %s too: its ids are "
                              "shared", slot, sandbox, claim)
                    return False
                os.rename(tmp, self._path(slot))
                return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def release(self, slot: int) -> None:
        """Give ``slot`` back if the claim on it is ours (a claim another daemon took over
        stays)."""
        with contextlib.suppress(FileNotFoundError), self._lock():
            if self.ours(self.read(slot)):
                os.unlink(self._path(slot))


__all__ = ["DEFAULT_DIR", "UidSlots", "starttime"]
