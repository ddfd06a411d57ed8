"""Shared test fixtures and capability checks.

Tests that need root, mounts, FUSE or a VM carry a marker (see pyproject.toml) and skip
with a stated reason where the capability is missing.
"""

from __future__ import annotations

import os
import shutil

import pytest


def _is_root() -> bool:
    return os.geteuid() == 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") and not _is_root():
        pytest.skip("needs root")
    if item.get_closest_marker("mount") and not _is_root():
        pytest.skip("needs root to mount(2) EROFS/overlayfs")
    if item.get_closest_marker("fuse") and not (os.path.exists("/dev/fuse") and _is_root()):
        pytest.skip("needs /dev/fuse and root")
    if item.get_closest_marker("vm") and not shutil.which("qemu-system-x86_64"):
        pytest.skip("needs qemu-system-x86_64")
