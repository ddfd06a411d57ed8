"""Read the facts of an EROFS image's superblock, in pure Python (for ``layerfs inspect``).

Field offsets and feature bits are those of the kernel's ``fs/erofs/erofs_fs.h``
(``struct erofs_super_block``), as summarised in ``shared/reference/erofs-format.md`` §2-3;
the checksum is the kernel's ``erofs_superblock_csum_verify``: crc32c seeded with ~0 and not
inverted at the end, over the superblock block from byte 1024, with the field zeroed.
"""

from __future__ import annotations

import os
import struct
import uuid as _uuid
from dataclasses import dataclass
from typing import Any

from layerfs.errors import LayerfsError

SUPER_OFFSET = 1024
SUPER_MAGIC = 0xE0F5E1E2

COMPAT_FEATURES = {
    0x1: "sb_chksum", 0x2: "mtime", 0x4: "xattr_filter", 0x8: "shared_ea_in_metabox",
    0x10: "plain_xattr_pfx", 0x20: "ishare_xattrs",
}
INCOMPAT_FEATURES = {
    0x1: "zero_padding", 0x2: "compr_cfgs", 0x4: "chunked_file", 0x8: "device_table",
    0x10: "ztailpacking", 0x20: "fragments", 0x40: "xattr_prefixes", 0x80: "48bit",
    0x100: "metabox",
}


class NotErofsError(LayerfsError, ValueError):
    """The file is not an EROFS image (too short, bad magic, impossible block size)."""


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c_raw(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """CRC-32C (Castagnoli, reflected) of ``data`` from seed ``crc`` with no final
    inversion: the kernel's ``crc32c(seed, data, len)``."""
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


@dataclass(frozen=True, slots=True)
class SuperblockInfo:
    """What an EROFS superblock says. ``block_size`` in bytes; ``blocks`` of the primary
    device; ``epoch`` in seconds since the Unix epoch; ``checksum_ok`` is None when the
    image carries no superblock checksum."""

    block_size: int
    blocks: int
    inodes: int
    root_nid: int
    meta_blkaddr: int
    xattr_blkaddr: int
    epoch: int
    epoch_nsec: int
    uuid: str
    volume_name: str
    feature_compat: int
    feature_incompat: int
    extra_devices: int
    checksum_ok: bool | None

    @property
    def features(self) -> list[str]:
        """Names of every feature bit set (unknown bits as ``compat:0x..``)."""
        out = []
        for value, names, tag in ((self.feature_compat, COMPAT_FEATURES, "compat"),
                                  (self.feature_incompat, INCOMPAT_FEATURES, "incompat")):
            for bit in range(32):
                if value & (1 << bit):
                    out.append(names.get(1 << bit, f"{tag}:{1 << bit:#x}"))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size, "blocks": self.blocks, "inodes": self.inodes,
            "root_nid": self.root_nid, "meta_blkaddr": self.meta_blkaddr,
            "xattr_blkaddr": self.xattr_blkaddr, "epoch": self.epoch,
            "epoch_nsec": self.epoch_nsec, "uuid": self.uuid, "volume_name": self.volume_name,
            "feature_compat": self.feature_compat, "feature_incompat": self.feature_incompat,
            "features": self.features, "extra_devices": self.extra_devices,
            "checksum_ok": self.checksum_ok,
        }


def read_superblock(path: str | os.PathLike[str]) -> SuperblockInfo:
    """Parse the superblock of the EROFS image at ``path``.

    Raises :class:`NotErofsError` (a ``ValueError``) if it is not one, ``OSError`` if it
    cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(SUPER_OFFSET + 4096)
    name = os.fspath(path)
    if len(head) < SUPER_OFFSET + 128:
        raise NotErofsError(f"{name}: too short to be an EROFS image ({len(head)} bytes)")
    sb = head[SUPER_OFFSET:]
    magic, csum, compat, blkszbits, _extslots, root2 = struct.unpack_from("<IIIBBH", sb, 0)
    if magic != SUPER_MAGIC:
        raise NotErofsError(f"{name}: not an EROFS image (magic {magic:#010x})")
    if not 9 <= blkszbits <= 16:
        raise NotErofsError(f"{name}: impossible block size 2^{blkszbits}")
    inos, epoch, nsec, blocks_lo, meta, xattr = struct.unpack_from("<QQIIII", sb, 16)
    uid = _uuid.UUID(bytes=bytes(sb[48:64]))
    vol = bytes(sb[64:80]).split(b"\0", 1)[0].decode("utf-8", "backslashreplace")
    incompat, _algs, extra_devices = struct.unpack_from("<IHH", sb, 80)
    root_nid = root2
    blocks = blocks_lo
    if incompat & 0x80:  # 48BIT: root nid and block count widen
        root_nid = struct.unpack_from("<Q", sb, 112)[0]
        blocks = blocks_lo | (root2 << 32)
    checksum_ok = None
    if compat & 0x1:
        bsz = 1 << blkszbits
        length = bsz - SUPER_OFFSET if bsz > SUPER_OFFSET else bsz
        region = bytearray(sb[:length])
        region[4:8] = b"\0\0\0\0"
        checksum_ok = len(region) == length and crc32c_raw(bytes(region)) == csum
    return SuperblockInfo(
        block_size=1 << blkszbits, blocks=blocks, inodes=inos, root_nid=root_nid,
        meta_blkaddr=meta, xattr_blkaddr=xattr, epoch=epoch, epoch_nsec=nsec,
        uuid=str(uid), volume_name=vol, feature_compat=compat, feature_incompat=incompat,
        extra_devices=extra_devices if incompat & 0x8 else 0, checksum_ok=checksum_ok)
