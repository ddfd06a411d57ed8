"""Snapshots of a sandbox into a layer (POST /v1/sandboxes/{id}/snapshot): what a new
sandbox on layers + [digest] sees, determinism, excludes, freezing, and the bad cases (a
sandbox whose disk is full, hostile paths in the upper, bad requests)."""

from __future__ import annotations

import os
import stat

import pytest

from edged.client import BadRequestError, NotFoundError, Sandbox
from layerfs.errors import InvalidSourceError
from layerfs.sources.upper import compile_excludes, load_upper
from layerfs.store import Store

pytestmark = [pytest.mark.root, pytest.mark.mount]

CHANGES = r"""
set -e
mkdir -p /root/new/sub && printf 'hello\n' > /root/new/f
printf 'appended\n' >> /var/lib/dpkg/available
rm /var/lib/dpkg/status
rm -rf /var/lib/apt && mkdir -p /var/lib/apt/lists && touch /var/lib/apt/lists/mine
mv /var/log /var/log2
ln -s /etc/shadow /root/evil
ln -s ../../../../../proc/1/root/etc/shadow /root/evil2
mkfifo /root/fifo
ln /root/new/f /root/new/hard
chown 1000:1001 /root/new/sub && chmod 2750 /root/new/sub
python3 -c 'open(b"/root/name\nwith\xffbytes", "w").write("odd")'
mkdir -p /root/proj/__pycache__ /tmp/junk && touch /root/proj/__pycache__/x.pyc /tmp/junk/y
touch /root/proj/keep.py
"""

CHECK = r"""
cat /root/new/f; tail -1 /var/lib/dpkg/available
test ! -e /var/lib/dpkg/status && echo status-gone
ls /var/lib/apt; ls /var/lib/apt/lists
test ! -e /var/log && test -d /var/log2 && echo log-moved
readlink /root/evil; readlink /root/evil2
test -p /root/fifo && echo fifo
test /root/new/f -ef /root/new/hard && echo hardlink
stat -c '%u:%g %a' /root/new/sub
cat "$(printf '/root/name\nwith\377bytes')"; echo
test ! -e /root/proj/__pycache__ && test -e /root/proj/keep.py && echo pycache-excluded
test ! -e /tmp/junk && echo tmp-excluded
"""

EXPECT = ["hello", "appended", "status-gone", "lists", "mine", "log-moved", "/etc/shadow",
          "../../../../../proc/1/root/etc/shadow", "fifo", "hardlink", "1000:1001 2750",
          "odd", "pycache-excluded", "tmp-excluded"]


def _sbx(node, layers: list[str], **kw) -> Sandbox:
    return Sandbox.create(layers=layers, socket=node.socket, cpus=1.0, memory_bytes=512 << 20,
                          **kw)


def test_snapshot_round_trip_and_determinism(deb_node, debian_layer) -> None:
    node = deb_node()
    store, base = debian_layer
    with _sbx(node, [base]) as sbx:
        r = sbx.exec(CHANGES)
        assert r.ok, r.stderr
        digest = sbx.snapshot(exclude=["__pycache__", "/tmp"], image="snap/test:1")
        info = sbx.last_snapshot
        assert info["layers"] == [base, digest] and info["kind"] == "workspace"
        assert info["whiteouts"] >= 2 and info["opaque_dirs"] == 1, info
        # /tmp whole (its copy-up and junk/y), the __pycache__ dir and its file
        assert info["excluded"] == 5 and sorted(info["excluded_paths"]) == [
            "/root/proj/__pycache__", "/tmp"]
        assert info["frozen_s"] > 0
        assert sbx.refresh()["state"] == "running"  # thawed
        assert sbx.exec("echo thawed").stdout == "thawed\n"
        # nothing changed: the same layer, byte for byte
        assert sbx.snapshot(exclude=["__pycache__", "/tmp"]) == digest
        # a paused sandbox is snapshotted and stays paused
        sbx.pause()
        assert sbx.snapshot(exclude=["__pycache__", "/tmp"]) == digest
        assert sbx.refresh()["state"] == "paused"
    assert Store(store).manifest(digest).kind == "workspace"
    for how in ({"layers": [base, digest]}, {"image": "snap/test:1"}):
        with Sandbox.create(socket=node.socket, **how) as again:
            r = again.exec(CHECK)
            assert r.ok, r.stderr
            assert r.stdout.split("\n")[:len(EXPECT)] == EXPECT


def test_snapshot_of_a_sandbox_whose_disk_is_full(deb_node, debian_layer) -> None:
    node = deb_node()
    _, base = debian_layer
    with _sbx(node, [base], disk_bytes=24 << 20) as sbx:
        r = sbx.exec("dd if=/dev/urandom of=/root/fill bs=1M count=64; echo dd=$?; "
                     "stat -c %s /root/fill")
        assert "dd=1" in r.stdout and "No space left" in r.stderr  # it filled the disk
        size = int(r.stdout.split()[-1])
        assert size > 16 << 20
        before = sbx.exec("sha256sum /root/fill").stdout.split()[0]
        digest = sbx.snapshot()
        assert sbx.exec("echo alive").stdout == "alive\n"
        with _sbx(node, [base, digest], disk_bytes=8 << 20) as again:
            r = again.exec("stat -c %s /root/fill; sha256sum /root/fill; "
                           "echo more > /root/other && echo writable")
            lines = r.stdout.split("\n")
            assert int(lines[0]) == size and lines[1].split()[0] == before
            assert lines[2] == "writable"  # the copy is in a layer, not in its disk


def test_hostile_upper_is_refused_typed_and_thawed(deb_node, debian_layer) -> None:
    node = deb_node()
    store, base = debian_layer
    with _sbx(node, [base]) as sbx:
        # a path longer than PATH_MAX, made one relative step at a time
        r = sbx.exec(["python3", "-c", "import os\nos.chdir('/root')\nfor i in range(20):\n"
                      "    os.mkdir('d' * 250); os.chdir('d' * 250)\n"
                      "open('f', 'w').write('deep'); print('made')"])
        assert r.stdout == "made\n", r.stderr
        layers_before = set(Store(store).digests())
        with pytest.raises(BadRequestError, match="snapshot"):
            sbx.snapshot()
        assert set(Store(store).digests()) == layers_before  # nothing half-added
        assert sbx.refresh()["state"] == "running"
        assert sbx.exec("echo thawed").stdout == "thawed\n"
        # once the deep tree is gone, the snapshot goes through
        assert sbx.exec("rm -rf /root/d*").ok
        digest = sbx.snapshot()
        assert digest not in layers_before


def test_bad_requests(deb_node, debian_layer) -> None:
    node = deb_node()
    _, base = debian_layer
    with _sbx(node, [base]) as sbx:
        for kw, match in (({"kind": "rootfs"}, "kind"), ({"exclude": ["../x"]}, "exclude"),
                          ({"exclude": [""]}, "exclude"), ({"image": "no tag!"}, "image")):
            with pytest.raises(BadRequestError, match=match):
                sbx.snapshot(**kw)
        assert sbx.exec("true").ok
    with pytest.raises(NotFoundError):
        sbx.snapshot()


def test_load_upper_rules(tmp_path) -> None:
    """The source on its own: ids mapped into the sandbox's, overlay bookkeeping dropped,
    opaque kept in both namespaces, sockets and capabilities dropped, foreign ids and
    redirects refused."""
    import socket

    up = tmp_path / "upper"
    (up / "d").mkdir(parents=True)
    (up / "d" / "f").write_text("x")
    (up / "o").mkdir()
    base = 100000
    for p in (up, up / "d", up / "d" / "f", up / "o"):
        os.chown(p, base + 5, base + 6)
    os.setxattr(up / "o", "trusted.overlay.opaque", b"y")
    os.setxattr(up / "d", "trusted.overlay.origin", b"\x00\x01")
    os.setxattr(up / "d" / "f", "user.keep", b"1")
    os.mknod(up / "d" / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(up / "d" / "sock"))
    s.close()
    tree, rep = load_upper(str(up), id_base=base, id_count=65536)
    d = tree.get("d")
    assert (d.uid, d.gid) == (5, 6)
    assert b"trusted.overlay.origin" in d.xattrs  # re-added: it holds a whiteout
    assert d.xattrs[b"trusted.overlay.origin"] == b""
    assert tree.get("d/f").xattrs == {b"user.keep": b"1"}
    assert tree.get("o").xattrs == {b"trusted.overlay.opaque": b"y",
                                    b"user.overlay.opaque": b"y"}
    assert tree.get("d/gone").is_whiteout and tree.get("d/sock") is None
    assert (rep.whiteouts, rep.opaque_dirs, rep.dropped_sockets) == (1, 1, 1)
    os.chown(up / "d" / "f", 4242, 4242)
    with pytest.raises(InvalidSourceError, match="/d/f: uid 4242 is outside"):
        load_upper(str(up), id_base=base, id_count=65536)
    os.chown(up / "d" / "f", base, base)
    os.setxattr(up / "o", "trusted.overlay.redirect", b"/elsewhere")
    with pytest.raises(InvalidSourceError, match="/o: overlay redirect"):
        load_upper(str(up), id_base=base, id_count=65536)


@pytest.mark.parametrize(("patterns", "path", "hit"), [
    (["__pycache__"], "a/b/__pycache__", True),
    (["__pycache__"], "__pycache__", True),
    (["*.pyc"], "x/y.pyc", True),
    (["*.pyc"], "x/y.pyc.txt", False),
    (["/tmp"], "tmp", True),
    (["/tmp"], "var/tmp", False),
    (["/work/**/build"], "work/a/b/build", True),
    (["/work/*/build"], "work/a/b/build", False),
])
def test_exclude_patterns(patterns: list[str], path: str, hit: bool) -> None:
    rx = compile_excludes(patterns)
    assert rx is not None and bool(rx.fullmatch(path.encode())) is hit
