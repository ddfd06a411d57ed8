"""What a build costs before it starts: the modules a directory build and ``layerfs
build --no-store`` import (start-up time, issue 9 item 18), and the digest helpers the
CLI uses in place of the store's. No timing: the modules are counted, not the clock."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerfs.digest import sha256_fd, sha256_file, sha256_while
from layerfs.output import make_durable, replace_with

# Modules a build from a directory has no use for; each cost 2-20 ms of CPU at start-up
# (`python -X importtime`, perf stat): the dataclasses machinery (inspect, ast, dis),
# the store (zstandard, a thread pool, logging), tempfile/shutil, the Tree classes,
# typing (with re, enum, contextlib: ~16 ms; see layerfs.native.named_tuple).
_NOT_FOR_A_LIBRARY_BUILD = ("dataclasses", "inspect", "layerfs.tree", "layerfs.store",
                            "layerfs.output", "tempfile", "zstandard", "typing", "re",
                            "enum", "contextlib")
_NOT_FOR_A_CLI_BUILD = ("layerfs.store", "zstandard", "concurrent.futures", "asyncio",
                        "aiohttp", "uuid", "layerfs.tree", "layerfs.lazy.client")


def _imported_after(code: str, *argv: str) -> set[str]:
    """The modules in sys.modules after ``code`` ran in a fresh interpreter."""
    probe = code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    r = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                       text=True, check=False, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_library_directory_build_imports_little(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"x" * 5000)
    img = tmp_path / "a.img"
    mods = _imported_after(
        "import os, sys\n"
        "from layerfs.sources.directory import scan_directory\n"
        "from layerfs.writer import write_image\n"
        "fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o644)\n"
        "st = write_image(scan_directory(sys.argv[1]), fd)\n"
        "assert st.files == 1 and st.size == os.fstat(fd).st_size, st\n",
        str(src), str(img))
    assert "layerfs._native" in mods  # the probe did build
    assert not mods & set(_NOT_FOR_A_LIBRARY_BUILD), mods & set(_NOT_FOR_A_LIBRARY_BUILD)
    assert img.read_bytes()[1024:1028] == bytes.fromhex("e2e1f5e0")


def test_cli_build_without_store_imports_little(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"hello")
    img = tmp_path / "a.img"
    mods = _imported_after(
        "import sys\nfrom layerfs.cli import main\n"
        "assert main(['build', sys.argv[1], '--kind', 'base', '--no-store', '-o', "
        "sys.argv[2]]) == 0\n", str(src), str(img))
    assert "layerfs.build" in mods
    assert not mods & set(_NOT_FOR_A_CLI_BUILD), mods & set(_NOT_FOR_A_CLI_BUILD)
    assert img.stat().st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@pytest.mark.parametrize("size", [0, 1, 4095, 8 << 20, (8 << 20) + 1, (17 << 20) - 3])
def test_sha256_fd_is_the_files_sha256(tmp_path: Path, size: int) -> None:
    # Sizes around the 8 MiB mapping windows, and an empty file (which mmap refuses).
    p = tmp_path / "f"
    data = os.urandom(size)
    p.write_bytes(data)
    want = "sha256:" + hashlib.sha256(data).hexdigest()
    assert sha256_file(p) == want
    fd = os.open(p, os.O_RDONLY)
    try:
        os.lseek(fd, 7 if size > 7 else 0, os.SEEK_SET)
        assert sha256_fd(fd) == want  # the whole file whatever the position
        assert sha256_while(fd, lambda _fd: None) == want
    finally:
        os.close(fd)


def test_sha256_fd_reads_a_file_it_cannot_map(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap

    p = tmp_path / "f"
    data = os.urandom((8 << 20) + 5)
    p.write_bytes(data)
    calls: list[int] = []

    def refuse(*_a: object, **kw: object) -> None:
        calls.append(int(kw.get("offset", 0)))  # type: ignore[call-overload]
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert sha256_file(p) == "sha256:" + hashlib.sha256(data).hexdigest()
    assert calls == [0]


def test_sha256_while_raises_what_the_work_raised(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    seen: list[int] = []

    def work(fd: int) -> None:
        seen.append(os.fstat(fd).st_size)
        raise OSError(5, "fsync failed")

    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="fsync failed"):
            sha256_while(fd, work)
    finally:
        os.close(fd)
    assert seen == [3]  # the work ran on the same file


def test_replace_with_durable_skips_only_what_was_done(tmp_path: Path) -> None:
    tmp = tmp_path / ".t"
    tmp.write_bytes(b"img")
    os.chmod(tmp, 0o600)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        make_durable(fd)  # the mode the output gets, then fsync
    finally:
        os.close(fd)
    replace_with(str(tmp), tmp_path / "out", durable=True)
    out = tmp_path / "out"
    assert out.read_bytes() == b"img" and not tmp.exists()
    assert out.stat().st_mode & 0o777 == 0o644 & ~_umask()
