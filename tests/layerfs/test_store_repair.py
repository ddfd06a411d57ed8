"""Store damage that must be repairable or reported, not fatal (review findings 6, 7), and
export's output path rule (finding 1): a corrupt chunk is quarantined by verify and
rewritten by the next add; a damaged manifest does not hide the other layers from ls; a
stray file or directory under chunks/ does not stop gc; export never replaces a device,
FIFO, symlink or directory."""

from __future__ import annotations

import hashlib
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from layerfs.output import OutputError
from layerfs.store import Store

MiB = 1 << 20


def _image(path: Path, n: int, seed: int) -> Path:
    path.write_bytes(random.Random(seed).randbytes(n))
    return path


def _chunk_file(root: Path, digest: str) -> Path:
    return root / "chunks" / digest[7:9] / digest[7:]


def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "layerfs.cli", *args],
                          capture_output=True, check=False)


def test_verify_quarantines_a_corrupt_chunk_and_a_rebuild_repairs_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    img = _image(tmp_path / "a.img", 3 * MiB, 1)
    m = store.add_image(img, kind="base", source="")
    bad = m.chunks[1].digest
    f = _chunk_file(root, bad)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    f.write_bytes(bytes(raw))
    # Before the fix an add trusted the existing file: verify kept failing forever.
    rep = store.verify()
    assert not rep.ok and list(rep.quarantined) == [bad]
    moved = Path(rep.quarantined[bad])
    assert moved.parent == root / "quarantine" and moved.read_bytes() == bytes(raw)
    assert not f.exists()
    again = store.ingest(img, kind="base", source="")
    assert again.new_chunks == 1
    assert store.verify().ok
    out = tmp_path / "out.img"
    store.export(m.digest, out)
    assert out.read_bytes() == img.read_bytes()
    # gc leaves the quarantine alone.
    store.gc()
    assert moved.exists()


def test_verify_without_quarantine_moves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root, chunk_size=MiB)
    m = store.add_image(_image(tmp_path / "a.img", MiB, 2), kind="base", source="")
    f = _chunk_file(root, m.chunks[0].digest)
    f.write_bytes(b"junk")
    rep = store.verify(quarantine=False)
    assert not rep.ok and rep.quarantined == {} and f.read_bytes() == b"junk"


def test_ls_lists_the_rest_when_a_manifest_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root)
    good = store.add_image(_image(tmp_path / "a.img", 5000, 3), kind="base", source="")
    badm = store.add_image(_image(tmp_path / "b.img", 5000, 4), kind="toolkit", source="")
    mf = root / "manifests" / (badm.digest[7:] + ".json")
    mf.write_bytes(mf.read_bytes()[:-20])
    ms, bad = store.scan_layers()
    assert [m.digest for m in ms] == [good.digest] and list(bad) == [badm.digest]
    r = _cli("ls", "--store", str(root))
    assert r.returncode == 1
    assert good.digest[:19].encode() in r.stdout
    assert badm.digest.encode() in r.stderr and b"damaged manifest" in r.stderr
    assert b"Traceback" not in r.stderr


def test_gc_skips_and_reports_what_is_not_a_chunk_file(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root)
    store.add_image(_image(tmp_path / "a.img", 5000, 5), kind="base", source="")
    gone = store.add_image(_image(tmp_path / "b.img", 5000, 6), kind="base", source="")
    store.remove(gone.digest)
    stray_dir = root / "chunks" / "ab" / "somedir"
    stray_dir.mkdir()
    (stray_dir / "x").write_bytes(b"x")
    stray_file = root / "chunks" / "cd" / "notes.txt"
    stray_file.write_bytes(b"n")
    rep = store.gc()
    assert rep.chunks_removed == 1 and rep.chunks_kept == 1
    assert sorted(rep.skipped) == [str(stray_dir), str(stray_file)]
    assert (stray_dir / "x").exists() and stray_file.exists()
    assert store.usage().chunks == 1
    r = _cli("gc", "--store", str(root))
    assert r.returncode == 0 and b"skipped" in r.stdout and b"Traceback" not in r.stderr


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory",
                                  pytest.param("chardev", marks=pytest.mark.root)])
def test_export_refuses_a_non_regular_output(tmp_path: Path, kind: str) -> None:
    if kind == "chardev" and os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    root = tmp_path / "store"
    store = Store(root)
    m = store.add_image(_image(tmp_path / "a.img", 5000, 7), kind="base", source="")
    d = tmp_path / "out"
    d.mkdir()
    target = d / "x.erofs"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        (d / "victim").write_bytes(b"keep")
        os.symlink("victim", target)
    elif kind == "directory":
        target.mkdir()
    else:
        # Never the host's /dev/null: our own 1:3 node in a temp directory.
        os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    before = os.lstat(target)
    listing = sorted(os.listdir(d))
    with pytest.raises(OutputError, match=f"^{target}: exists and is a"):
        store.export(m.digest, target)
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (
        before.st_ino, before.st_mode, before.st_rdev)
    assert sorted(os.listdir(d)) == listing
    r = _cli("export", m.digest, "--store", str(root), "-o", str(target))
    assert r.returncode == 1 and f"{target}: exists".encode() in r.stderr
    assert sorted(os.listdir(d)) == listing


def test_export_to_file_and_stdout(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = Store(root)
    img = _image(tmp_path / "a.img", 300000, 8)
    m = store.add_image(img, kind="base", source="")
    out = tmp_path / "o.erofs"
    out.write_bytes(b"old")
    old = os.umask(0o077)
    try:
        store.export(m.digest, out)
    finally:
        os.umask(old)
    assert out.read_bytes() == img.read_bytes()
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    r = _cli("export", m.digest, "--store", str(root), "-o", "-")
    assert r.returncode == 0, r.stderr
    assert "sha256:" + hashlib.sha256(r.stdout).hexdigest() == m.digest
