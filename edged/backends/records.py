"""A backend's record of each sandbox on disk: ``<sandboxes_dir>/<id>/meta.json`` (a JSON
object the backend defines; ``pid`` and ``starttime`` name the process that holds the
sandbox), written whole (temp file, rename) and read back after a daemon restart to re-adopt
what still runs. Shared by the container and microVM backends."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from edged.backends.uidslots import starttime

NAME = "meta.json"


def read(sandboxes_dir: Path, sandbox_id: str) -> dict[str, Any] | None:
    """The record of ``sandbox_id``, or None if it is missing or unreadable."""
    try:
        meta: dict[str, Any] = json.loads((sandboxes_dir / sandbox_id / NAME).read_text())
    except (OSError, ValueError):
        return None
    return meta


def read_all(sandboxes_dir: Path) -> dict[str, dict[str, Any]]:
    """Every readable record under ``sandboxes_dir``: sandbox id → record (none if the
    directory does not exist)."""
    out: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(sandboxes_dir):
            meta = read(sandboxes_dir, e.name)
            if meta is not None:
                out[e.name] = meta
    return out


def write(d: Path, meta: dict[str, Any]) -> None:
    """Write ``meta`` as ``d/meta.json`` whole (a temp file renamed over it)."""
    tmp = d / (NAME + ".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, d / NAME)


def alive(meta: dict[str, Any]) -> bool:
    """Whether the record's process still runs: its pid is live with the same start time
    (a reused pid has another)."""
    pid = int(meta.get("pid") or 0)
    return pid > 0 and starttime(pid) == meta.get("starttime")
