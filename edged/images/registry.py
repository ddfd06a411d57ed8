"""The image registry: ``name:tag`` → layer digests (bottom first), persisted as one JSON file
in the state dir, written atomically (temp file, fsync, rename)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edged.errors import BadRequest, NotFound

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
# OCI distribution's name grammar, simplified: lowercase path components, then a tag.
_COMPONENT = r"[a-z0-9]+(?:[._-][a-z0-9]+)*"
REF_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*:[\w][\w.-]{{0,127}}")


def check_digest(d: object) -> str:
    """Return ``d`` if it is ``sha256:<64 lowercase hex>``, else raise :class:`BadRequest`."""
    if not isinstance(d, str) or not DIGEST_RE.fullmatch(d):
        raise BadRequest(f"layer {d!r}: not a digest of the form sha256:<64 hex digits>")
    return d


def check_ref(ref: object) -> str:
    """Return ``ref`` if it is ``name:tag`` (OCI-style lowercase name), else
    :class:`BadRequest`."""
    if not isinstance(ref, str) or not REF_RE.fullmatch(ref):
        raise BadRequest(f"image {ref!r}: not of the form name:tag")
    return ref


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` so that a crash leaves the old or the new file,
    never a torn one (temp file in the same dir, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class ImageRegistry:
    """Images known to this node. ``has_layer``: optional check that a digest is held by the
    layer store (registering an image of missing layers is a :class:`BadRequest`)."""

    def __init__(self, path: Path, has_layer: Callable[[str], bool] | None = None) -> None:
        self.path = path
        self.has_layer = has_layer
        self._images: dict[str, dict[str, Any]] = {}
        if path.exists():
            try:
                data = json.loads(path.read_text())
                self._images = {check_ref(k): v for k, v in data["images"].items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise BadRequest(f"image registry {path}: unreadable: {e}") from e

    def all(self) -> list[dict[str, Any]]:
        """Every image as ``{"name", "layers", "created_at"}``, sorted by name."""
        return [self._obj(k) for k in sorted(self._images)]

    def _obj(self, ref: str) -> dict[str, Any]:
        v = self._images[ref]
        return {"name": ref, "layers": list(v["layers"]), "created_at": v["created_at"]}

    def get(self, ref: str) -> dict[str, Any]:
        """The image ``ref`` (:class:`NotFound` if absent)."""
        check_ref(ref)
        if ref not in self._images:
            raise NotFound(f"image {ref}: not registered")
        return self._obj(ref)

    def put(self, ref: str, layers: list[str]) -> dict[str, Any]:
        """Register or replace ``ref`` → ``layers`` (bottom first, 1..64 digests)."""
        check_ref(ref)
        if not isinstance(layers, list) or not 1 <= len(layers) <= 64:
            raise BadRequest(f"image {ref}: layers must be a list of 1 to 64 digests")
        for d in layers:
            check_digest(d)
            if self.has_layer is not None and not self.has_layer(d):
                raise BadRequest(f"image {ref}: layer {d} is not in the layer store")
        new = dict(self._images)
        new[ref] = {"layers": list(layers), "created_at": time.time()}
        self._save(new)
        return self._obj(ref)

    def delete(self, ref: str) -> None:
        """Forget ``ref`` (:class:`NotFound` if absent). Layers stay in the store."""
        self.get(ref)
        new = dict(self._images)
        del new[ref]
        self._save(new)

    def _save(self, images: dict[str, dict[str, Any]]) -> None:
        write_json_atomic(self.path, {"images": images})
        self._images = images
