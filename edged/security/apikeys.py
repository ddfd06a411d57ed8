"""API keys for edged's TCP listeners (the E2B-compatible one, SandboxFusion's ``/run_code``).

The Unix socket is guarded by file permissions; a TCP listener has none, so it serves only
requests that present a key from its keys file (``--api-keys-file``), and does not start at
all without one ("no key, no listener").

File format (UTF-8, one entry per line; blank lines and ``#`` comments ignored)::

    # NAME KEY   (or just KEY)
    trainer-a  3b1f0c6e9d...            # NAME: [A-Za-z0-9_.-]{1,64}
    7c2d4e...                           # unnamed: its id is key-<sha256(key)[:12]>

A key is 16 to 512 printable ASCII characters without spaces. Each key has an **id** (its
name, else a hash of it) that callers use as the owner of what it creates (an E2B "team"):
the key itself is never logged or stored elsewhere. The file must not be readable by
others (mode ``o-r``, as ssh insists for its keys); it is re-read when it changes (checked
at most once a second), so keys rotate without a restart. A file that became unreadable or
empty keeps the last good keys and logs why.

Comparison is in constant time: the SHA-256 of the presented key is compared with
:func:`hmac.compare_digest` against the SHA-256 of *every* key, with no early exit, so
neither the length nor the position of a match shows in the time taken.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from edged.errors import BadRequest

log = logging.getLogger("edged.security")

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_KEY = re.compile(r"[\x21-\x7e]{16,512}\Z")
#: seconds between checks whether the file changed
RECHECK_S = 1.0


class ApiKeyError(BadRequest):
    """A keys file that cannot be used (missing, readable by others, no valid key, a bad
    line): the message names the file and the line."""

    code = "bad_api_keys_file"


@dataclass(frozen=True)
class _Entry:
    id: str
    digest: bytes


def parse(text: str, where: str = "api keys") -> list[tuple[str, str]]:
    """``[(id, key)]`` of a keys file's text. Raises :class:`ApiKeyError` naming the first
    bad line, a duplicate name or key, or a file with no key."""
    out: list[tuple[str, str]] = []
    ids: set[str] = set()
    keys: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) == 1:
            name, key = None, parts[0]
        elif len(parts) == 2:
            name, key = parts
            if not _NAME.match(name):
                raise ApiKeyError(f"{where}:{n}: name {name[:70]!r} must match "
                                  f"[A-Za-z0-9_.-]{{1,64}}")
        else:
            raise ApiKeyError(f"{where}:{n}: expected 'KEY' or 'NAME KEY'")
        if not _KEY.match(key):
            raise ApiKeyError(f"{where}:{n}: a key is 16 to 512 printable ASCII characters "
                              f"without spaces")
        kid = name or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        if kid in ids or key in keys:
            raise ApiKeyError(f"{where}:{n}: duplicate {'name' if kid in ids else 'key'}")
        ids.add(kid)
        keys.add(key)
        out.append((kid, key))
    if not out:
        raise ApiKeyError(f"{where}: no key (no key, no listener)")
    return out


class ApiKeys:
    """The keys of one keys file. :meth:`check` is safe to call from any thread."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Load ``path`` now. Raises :class:`ApiKeyError` (no such file, readable by others,
        no valid key, a bad line)."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._stamp: tuple[int, int, int, int] | None = None
        self._checked = 0.0
        self._load(strict=True)

    @classmethod
    def from_mapping(cls, keys: Mapping[str, str]) -> ApiKeys:
        """Keys given in memory (``{id: key}``; tests, embedding): never re-read."""
        self = cls.__new__(cls)
        self.path = Path("<memory>")
        self._lock = threading.Lock()
        self._entries = [_Entry(i, hashlib.sha256(k.encode()).digest()) for i, k in keys.items()]
        self._stamp = None
        self._checked = float("inf")
        if not self._entries:
            raise ApiKeyError("api keys: no key (no key, no listener)")
        return self

    @property
    def ids(self) -> list[str]:
        """The ids of the keys now in force."""
        return [e.id for e in self._entries]

    def _load(self, *, strict: bool) -> None:
        try:
            st = os.stat(self.path)
            if st.st_mode & stat.S_IROTH:
                raise ApiKeyError(f"{self.path}: readable by others (mode "
                                  f"{stat.S_IMODE(st.st_mode):o}); chmod o-r it")
            stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            text = self.path.read_text(encoding="utf-8")
            entries = [_Entry(i, hashlib.sha256(k.encode()).digest())
                       for i, k in parse(text, str(self.path))]
        except (OSError, UnicodeDecodeError, ApiKeyError) as e:
            if strict:
                if isinstance(e, ApiKeyError):
                    raise
                raise ApiKeyError(f"{self.path}: {getattr(e, 'strerror', None) or e}") from e
            log.warning("api keys: %s; keeping the %d keys loaded before", e,
                        len(self._entries))
            return
        self._entries, self._stamp = entries, stamp
        if not strict:
            log.info("api keys: %s reloaded (%d keys)", self.path, len(entries))

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        with self._lock:
            if now - self._checked < RECHECK_S:
                return
            self._checked = now
            self._load(strict=False)

    def check(self, presented: str | None) -> str | None:
        """The id of the key ``presented`` (None, or a wrong key: None), in constant time."""
        self._refresh()
        if presented is None:
            presented = ""
        want = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found: str | None = None
        for e in self._entries:  # every entry, no early exit
            if hmac.compare_digest(e.digest, want) and presented:
                found = e.id
        return found


def presented_key(headers: Mapping[str, str], header: str = "X-API-Key") -> str | None:
    """The key a request presents: header ``header``, else ``Authorization: Bearer KEY``."""
    v = headers.get(header)
    if v:
        return v.strip()
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


__all__ = ["ApiKeyError", "ApiKeys", "parse", "presented_key"]
