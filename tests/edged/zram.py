"""zram devices in tests, known by what made them, never by number: other helpers' test
daemons hot-add and remove devices at the same time, so a number seen free or taken before a
test says nothing about the test (``zram2`` existed before, was removed by another daemon and
hot-added again by ours; a test that expected ``zram1`` failed the same way).

A device is told apart from a later one under the same number by its sysfs directory's inode
(kernfs gives every new node a new inode number: fs/kernfs/dir.c, idr_alloc_cyclic), read
without opening the device (an open would make its owner's ``hot_remove`` fail with EBUSY)."""

from __future__ import annotations

import os


def identity(name: str) -> int | None:
    """The identity of the zram device ``name`` (``"zram5"``) now: its sysfs directory's inode,
    None if there is no such device."""
    try:
        return os.stat(f"/sys/block/{name}").st_ino
    except FileNotFoundError:
        return None


def gone(name: str, ident: int | None) -> bool:
    """Whether the device ``name`` that had identity ``ident`` is gone: no such device now, or
    a new one under the same number."""
    assert ident is not None, f"{name} was never there"
    return identity(name) != ident
