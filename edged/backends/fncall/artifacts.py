"""Kept compile results ("compile once, run many"): what a compile step produced (the files
its language names as outputs), kept by id for a bounded time in the daemon's memory and
copied into the working directory of every run that names the id (go-judge's
``copyOutCached`` file ids are the model).

Bounds: each artifact lives at most ``max_ttl_s`` seconds (a request may ask for less);
all of them together hold at most ``max_bytes``, the ones that expire first making room
for a new one (an artifact larger than that on its own is refused).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from edged.backends.base import CallFile
from edged.errors import NotFound, PayloadTooLarge


@dataclass(frozen=True)
class Artifact:
    """A kept compile result: its ``language``, its files, when it expires (monotonic)."""

    id: str
    language: str
    files: tuple[CallFile, ...]
    expires: float

    @property
    def size(self) -> int:
        return sum(len(f.data) for f in self.files)


class Artifacts:
    """The kept compile results of one FnCall backend."""

    def __init__(self, *, max_bytes: int, max_ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.max_ttl_s = max_ttl_s
        self._by_id: dict[str, Artifact] = {}
        self._bytes = 0

    def _expire(self, now: float) -> None:
        for a in [a for a in self._by_id.values() if a.expires <= now]:
            self._drop(a)

    def _drop(self, a: Artifact) -> None:
        if self._by_id.pop(a.id, None) is not None:
            self._bytes -= a.size

    def put(self, language: str, files: tuple[CallFile, ...],
            ttl_s: float | None = None) -> Artifact:
        """Keep ``files`` for ``ttl_s`` seconds (None or more than the maximum: the
        maximum). Raises PayloadTooLarge for an artifact over ``max_bytes`` by itself."""
        now = time.monotonic()
        self._expire(now)
        ttl = self.max_ttl_s if ttl_s is None else min(max(ttl_s, 0.0), self.max_ttl_s)
        a = Artifact("art-" + secrets.token_hex(12), language, files, now + ttl)
        if a.size > self.max_bytes:
            raise PayloadTooLarge(f"compile result of {a.size} bytes: more than the "
                                  f"{self.max_bytes} bytes kept results may take")
        for old in sorted(self._by_id.values(), key=lambda x: x.expires):
            if self._bytes + a.size <= self.max_bytes:
                break
            self._drop(old)
        self._by_id[a.id] = a
        self._bytes += a.size
        return a

    def get(self, artifact_id: str) -> Artifact:
        """The artifact ``artifact_id``. Raises NotFound (never kept, expired, evicted)."""
        self._expire(time.monotonic())
        a = self._by_id.get(artifact_id)
        if a is None:
            raise NotFound(f"compile result {artifact_id!r}: not kept (never, expired or "
                           f"evicted)")
        return a

    def ttl_of(self, a: Artifact) -> float:
        """Seconds ``a`` has left."""
        return max(0.0, a.expires - time.monotonic())

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._by_id)


__all__ = ["Artifact", "Artifacts"]
