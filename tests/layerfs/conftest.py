"""Fixtures for the layerfs tests: scratch directories, fsck, a real Debian rootfs.

The Debian rootfs tarball (``mmdebstrap --variant=minbase --include=python3 bookworm``)
is built once into a cache (``EDGED_TEST_CACHE``, default ``/var/cache/edged-test``) by
the ``network``+``slow`` test ``test_build_debian_rootfs_cache``; tests that use it skip
with a reason while it is missing.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

CACHE = pathlib.Path(os.environ.get("EDGED_TEST_CACHE", "/var/cache/edged-test"))
DEBIAN_TAR = CACHE / "debian-rootfs.tar"


def build_debian_tar(dest: pathlib.Path = DEBIAN_TAR) -> pathlib.Path:
    """Build the Debian rootfs tarball at ``dest`` (needs network, ~20 s)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp.tar")
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=python3",
                    "bookworm", str(tmp)], check=True)
    os.replace(tmp, dest)
    return dest


def fsck_erofs(image: str | os.PathLike[str]) -> None:
    """Run ``fsck.erofs --extract`` (checks every file decodes) and fail on any error."""
    r = subprocess.run(["fsck.erofs", "--extract", os.fspath(image)], capture_output=True,
                       text=True)
    assert r.returncode == 0, f"fsck.erofs failed ({r.returncode}):\n{r.stdout}{r.stderr}"


@pytest.fixture
def scratch() -> Iterator[pathlib.Path]:
    """A temporary directory on a real filesystem (not overlayfs: file-backed EROFS
    mounts refuse images there), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="layerfs-test-", dir="/var/tmp") as d:
        yield pathlib.Path(d)


@pytest.fixture(scope="session")
def debian_tar() -> pathlib.Path:
    if not DEBIAN_TAR.exists():
        pytest.skip(f"{DEBIAN_TAR} missing: run `pytest -m network "
                    "tests/layerfs/test_directory.py::test_build_debian_rootfs_cache`")
    return DEBIAN_TAR


@pytest.fixture(scope="session")
def debian_rootfs(debian_tar: pathlib.Path) -> Iterator[pathlib.Path]:
    """The Debian rootfs extracted as root (owners, modes, xattrs kept), session-wide."""
    if os.geteuid() != 0:
        pytest.skip("extracting a rootfs with its owners and devices needs root")
    d = pathlib.Path(tempfile.mkdtemp(prefix="layerfs-debian-", dir="/var/tmp"))
    try:
        subprocess.run(["tar", "-xpf", str(debian_tar), "--xattrs", "--xattrs-include=*",
                        "--numeric-owner", "-C", str(d)], check=True)
        yield d
    finally:
        shutil.rmtree(d)
