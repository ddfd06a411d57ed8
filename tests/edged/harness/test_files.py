"""The SDK's file operations on a real sandbox: parents made on write, list/stat/exists/
mkdir/remove/rename, and paths that try to leave the sandbox (symlinks planted by the
workload, '..', mounts)."""

from __future__ import annotations

import pytest

from edged.client import BadRequestError, ConflictError, NotFoundError, Sandbox

pytestmark = [pytest.mark.root, pytest.mark.mount]


def test_file_operations(deb_node, debian_layer, tmp_path) -> None:
    node = deb_node()
    marker = tmp_path / "host-secret"
    marker.write_text("host")
    with Sandbox.create(layers=[debian_layer[1]], socket=node.socket) as sbx:
        assert sbx.files.write("/root/a/b/c.txt", "deep") == 4  # parents made
        with pytest.raises(NotFoundError):
            sbx.files.write("/root/x/y.txt", "no", parents=False)
        assert sbx.files.mkdir("/root/d1/d2") is True
        assert sbx.files.mkdir("/root/d1/d2") is False
        with pytest.raises(ConflictError):
            sbx.files.mkdir("/root/a/b/c.txt/sub")
        ents = sbx.files.list("/root/a", depth=2)
        assert [(e["path"], e["type"]) for e in ents] == [("/root/a/b", "dir"),
                                                          ("/root/a/b/c.txt", "file")]
        st = sbx.files.stat("/root/a/b/c.txt")
        assert (st["size"], st["owner"], st["permissions"]) == (4, "root", "-rw-r--r--")
        # a symlink planted by the workload is listed and stat'ed as itself, never followed
        assert sbx.exec(f"ln -s {marker} /root/out; ln -s / /root/rootlink").ok
        st = sbx.files.stat("/root/out")
        assert st["type"] == "symlink" and st["symlink_target"] == str(marker)
        assert [e["name"] for e in sbx.files.list("/root/rootlink/..")] != []  # inside
        with pytest.raises(NotFoundError):
            sbx.files.read(str(marker))  # resolves inside the sandbox: no such file
        with pytest.raises(NotFoundError):
            sbx.files.read("/root/out")  # through the planted link: still inside
        sbx.files.rename("/root/a/b/c.txt", "/root/moved.txt")
        assert sbx.files.read("/root/moved.txt") == "deep"
        assert not sbx.files.exists("/root/a/b/c.txt")
        sbx.files.remove("/root/out")  # the link, not its target
        assert marker.read_text() == "host"
        sbx.files.remove("/root/a")
        assert not sbx.files.exists("/root/a")
        for bad in ("/../etc/passwd", "/proc/self/environ"):
            with pytest.raises(BadRequestError):
                sbx.files.list(bad)
        with pytest.raises(BadRequestError):
            sbx.files.remove("/usr/bin")  # a protected path's read-only mount
        with pytest.raises(BadRequestError):
            sbx.files.remove("/")
        assert sbx.exec("test -x /usr/bin/python3").ok
