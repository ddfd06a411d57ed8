"""The busybox-static rootfs most sandbox tests build their layer from."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

BUSYBOX = shutil.which("busybox") or "/bin/busybox"


def install_busybox(root: Path, applets: Iterable[str] | None = None) -> Path:
    """Put the static busybox at ``root/bin/busybox`` and a symlink to it in ``root/bin``
    per applet: every applet it lists (``sh`` among them), or just ``applets``. Skips the
    calling test where busybox-static is not installed. Returns ``root``."""
    if not os.path.exists(BUSYBOX):
        pytest.skip("needs busybox-static")
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    if applets is None:
        applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True,
                                 check=True).stdout.split()
    for a in applets:
        if a != "busybox":
            (root / "bin" / a).symlink_to("busybox")
    return root
