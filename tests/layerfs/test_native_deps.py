"""layerfs without confinement: its native module holds the writer, the scanner and the lazy
server only (confinement is edged._native), so it links no libseccomp, and on a host where
libseccomp cannot be loaded layerfs still imports and builds a layer. Also the lazy server's
C object: freed, and the caller's fuse fd left the caller's."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import layerfs

ROOT = Path(__file__).resolve().parents[2]


def _ldd(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return subprocess.run(["ldd", spec.origin], capture_output=True, text=True,
                          check=True).stdout


def test_layerfs_native_binds_no_confinement() -> None:
    spec = importlib.util.spec_from_file_location("lbn", ROOT / "layerfs/_build_native.py")
    assert spec and spec.loader
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert not {"confine", "seccomp"} & set(build.MODULES)
    from layerfs import native

    assert not [n for n in dir(native.lib) if "seccomp" in n or "landlock" in n]
    assert "libseccomp" not in _ldd("layerfs._native")
    assert "libseccomp" in _ldd("edged._native")  # (what the check above would catch)


@pytest.mark.root
@pytest.mark.mount
def test_layerfs_builds_a_layer_where_libseccomp_cannot_load(tmp_path: Path) -> None:
    """In a mount namespace of its own, libseccomp is an empty file: edged._native cannot
    load there, layerfs imports and writes a layer."""
    lib = next(line.split("=>")[1].split()[0] for line in _ldd("edged._native").splitlines()
               if "libseccomp" in line)
    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("hi\n")
    out = tmp_path / "layer.erofs"
    script = f"""
import sys
try:
    import edged.native
except ImportError as e:
    print("no edged._native:", e)
else:
    sys.exit("edged._native loaded: libseccomp is still there")
from layerfs.build import build_layer
build_layer({str(src)!r}, kind="base", store=None, output={str(out)!r})
print("built")
"""
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f'mount --make-rprivate / && mount --bind /dev/null "{lib}" && exec "$0" -c "$1"',
         sys.executable, script],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "no edged._native" in proc.stdout and "built" in proc.stdout
    assert out.stat().st_size > 0
    if shutil.which("fsck.erofs"):
        subprocess.run(["fsck.erofs", str(out)], check=True, capture_output=True)


@pytest.mark.root
def test_lazy_server_object_is_freed_and_the_fd_stays_the_callers() -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    from layerfs.native import check, ffi, lib, new_error

    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        err = new_error()
        lz = lib.lfs_lazy_new(fd, 0, err)
        if lz == ffi.NULL:
            check(-1, err, "lazy server")
        assert lib.lfs_lazy_free(lz) == 0  # never started: freed at once
        os.fstat(fd)  # still open: the session had a copy of its own
        assert lib.lfs_lazy_free(ffi.NULL) == 0
    finally:
        os.close(fd)
    assert layerfs.__name__ == "layerfs"
