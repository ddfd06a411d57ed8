"""Tests of the pure-Python superblock reader against images made by mkfs.erofs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from layerfs.imageinfo import NotErofsError, crc32c_raw, read_superblock

needs_mkfs = pytest.mark.skipif(shutil.which("mkfs.erofs") is None,
                                reason="needs mkfs.erofs (erofs-utils)")


def test_crc32c_known_value() -> None:
    # CRC-32C check value (RFC 3720 B.4): "123456789" -> 0xE3069283 with the usual final
    # inversion; the kernel's raw form omits that inversion.
    assert crc32c_raw(b"123456789") ^ 0xFFFFFFFF == 0xE3069283


@needs_mkfs
def test_reads_mkfs_erofs_image_and_detects_a_bad_checksum(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(5):
        (src / "d" / f"f{i}").write_bytes(b"x" * (i * 5000))
    img = tmp_path / "a.erofs"
    subprocess.run(["mkfs.erofs", "--quiet", "-T0", "-U", "c8b0df67-387b-4ad4-871c-a67e3bdeb82a",
                    str(img), str(src)], check=True)
    sb = read_superblock(img)
    assert sb.block_size == 4096
    assert sb.inodes == 7  # root, d, five files
    assert sb.root_nid == 36
    assert sb.uuid == "c8b0df67-387b-4ad4-871c-a67e3bdeb82a"
    assert sb.checksum_ok is True
    assert "sb_chksum" in sb.features
    assert sb.blocks * sb.block_size == img.stat().st_size

    raw = bytearray(img.read_bytes())
    raw[1024 + 16] ^= 1  # the inode count, inside the checksummed region
    img.write_bytes(bytes(raw))
    assert read_superblock(img).checksum_ok is False


def test_refuses_what_is_not_erofs(tmp_path: Path) -> None:
    p = tmp_path / "x"
    p.write_bytes(b"\0" * 8192)
    with pytest.raises(NotErofsError, match="not an EROFS image"):
        read_superblock(p)
    p.write_bytes(b"short")
    with pytest.raises(ValueError, match="too short"):
        read_superblock(p)
