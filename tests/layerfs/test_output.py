"""Output paths (layerfs.output): only a new or regular file is ever replaced; devices,
FIFOs, sockets, symlinks and directories at the path are refused and left as they were;
``-`` is stdout (not a terminal); images get 0644 minus the umask.

Never against a host device: every special file here is made in a temp directory."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from layerfs.build import build_layer
from layerfs.output import OutputError, check_output, file_mode
from layerfs.tree import Inode, Tree
from layerfs.writer import write_image


def _tree() -> Tree:
    t = Tree()
    t.put("etc/motd", Inode(mode=stat.S_IFLNK | 0o777, target=b"/x", size=2))
    return t


def _chardev(p: pathlib.Path) -> None:
    os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))


def _fifo(p: pathlib.Path) -> None:
    os.mkfifo(p)


def _symlink(p: pathlib.Path) -> None:
    (p.parent / "victim").write_bytes(b"keep me")
    os.symlink("victim", p)


def _dangling(p: pathlib.Path) -> None:
    os.symlink("nowhere", p)


def _directory(p: pathlib.Path) -> None:
    p.mkdir()


@contextlib.contextmanager
def _socket(p: pathlib.Path) -> Iterator[None]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(p))
        yield
    finally:
        s.close()


_MAKERS: dict[str, Callable[[pathlib.Path], None]] = {
    "char device": _chardev, "FIFO": _fifo, "symlink": _symlink,
    "dangling symlink": _dangling, "directory": _directory,
}


def _ident(p: pathlib.Path) -> tuple[int, ...]:
    st = os.lstat(p)
    return st.st_ino, st.st_mode, st.st_rdev, st.st_size


@pytest.mark.parametrize("kind", [
    pytest.param("char device", marks=pytest.mark.root), "FIFO", "symlink",
    "dangling symlink", "directory"])
@pytest.mark.parametrize("how", ["write_image", "build"])
def test_non_regular_output_is_refused_untouched(tmp_path: pathlib.Path, kind: str,
                                                 how: str) -> None:
    if kind == "char device" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    d = tmp_path / "d"
    d.mkdir()
    target = d / "out.erofs"
    _MAKERS[kind](target)
    before = _ident(target)
    listing = sorted(os.listdir(d))
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    with pytest.raises(OutputError) as ei:
        if how == "write_image":
            write_image(_tree(), target)
        else:
            build_layer(str(src), kind="base", store=None, output=str(target))
    assert str(ei.value).startswith(f"{target}: exists and is a")
    assert ".tmp" not in str(ei.value) and ".layerfs" not in str(ei.value)
    assert _ident(target) == before
    assert sorted(os.listdir(d)) == listing
    if kind == "symlink":
        assert (d / "victim").read_bytes() == b"keep me"


def test_socket_output_is_refused(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "sock"
    with _socket(target):
        with pytest.raises(OutputError, match="is a socket"):
            write_image(_tree(), target)
        assert stat.S_ISSOCK(os.lstat(target).st_mode)


def test_regular_file_is_replaced_with_umask_mode(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "out.erofs"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    old = os.umask(0o027)
    try:
        assert file_mode() == 0o640
        write_image(_tree(), target)
        src = tmp_path / "src"
        src.mkdir()
        out2 = tmp_path / "built.erofs"
        build_layer(str(src), kind="base", store=None, output=str(out2))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(out2).st_mode) == 0o640
    assert target.read_bytes()[1024:1028] == bytes.fromhex("e2e1f5e0")  # EROFS magic
    assert sorted(os.listdir(tmp_path)) == ["built.erofs", "out.erofs", "src"]


def test_missing_directory_names_the_path(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_output(tmp_path / "no" / "x.erofs")


def _cli(*args: str, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "layerfs.cli", *args], stdout=stdout,
                          stderr=subprocess.PIPE, check=False)


def test_build_to_stdout(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"hello")
    r = _cli("build", str(src), "--kind", "base", "--no-store", "-o", "-", "--json")
    assert r.returncode == 0, r.stderr
    assert r.stdout[1024:1028] == bytes.fromhex("e2e1f5e0")
    assert b'"digest": "sha256:' + hashlib.sha256(r.stdout).hexdigest().encode() in r.stderr
    ref = tmp_path / "ref.erofs"
    build_layer(str(src), kind="base", store=None, output=str(ref))
    assert ref.read_bytes() == r.stdout


def test_stdout_on_a_terminal_is_refused(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    master, slave = os.openpty()
    try:
        r = _cli("build", str(src), "--kind", "base", "--no-store", "-o", "-", stdout=slave)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 1
    assert b"stdout is a terminal" in r.stderr
