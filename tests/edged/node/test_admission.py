"""Admission against capacity × overcommit."""

from __future__ import annotations

import pytest

from edged.backends.base import Resources
from edged.errors import CapacityExhausted
from edged.node.admission import Capacity

GiB = 1 << 30


def cap(**kw) -> Capacity:
    args = dict(cpus=2.0, memory_bytes=4 * GiB, cpu_overcommit=8.0, memory_overcommit=1.5,
                max_sandboxes=100, retry_after_s=2.0)
    args.update(kw)
    return Capacity(**args)


def test_cpu_overcommitted_hard() -> None:
    c = cap()
    for i in range(16):  # 2 cores × 8
        c.reserve(f"s{i}", Resources(cpus=1.0, memory_bytes=64 << 20))
    with pytest.raises(CapacityExhausted, match="cpus: 16 allocated") as ei:
        c.reserve("x", Resources(cpus=1.0, memory_bytes=64 << 20))
    assert ei.value.retry_after == 2.0 and ei.value.status == 503


def test_memory_overcommitted_modestly() -> None:
    c = cap()
    c.reserve("a", Resources(cpus=0.1, memory_bytes=5 * GiB))
    with pytest.raises(CapacityExhausted, match="memory"):
        c.reserve("b", Resources(cpus=0.1, memory_bytes=GiB + 1))
    c.reserve("b", Resources(cpus=0.1, memory_bytes=GiB))  # exactly 6 GiB = 4 × 1.5
    c.release("a")
    c.reserve("c", Resources(cpus=0.1, memory_bytes=4 * GiB, swap_bytes=GiB))
    assert c.allocated_memory == 6 * GiB


def test_swap_counts_and_release_is_idempotent() -> None:
    c = cap(max_sandboxes=1)
    c.reserve("a", Resources())
    c.reserve("a", Resources())  # re-adoption: same id, no double count
    with pytest.raises(CapacityExhausted, match="maximum of 1"):
        c.reserve("b", Resources())
    c.release("a")
    c.release("a")
    assert c.to_json()["allocated"] == {"cpus": 0, "memory_bytes": 0, "sandboxes": 0}
