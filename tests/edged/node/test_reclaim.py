"""Idle detection and reclaim pacing (edged.node.reclaim) over a backend double: which
sandboxes are reclaimed when, the PSI-paced budget, regrowth, wakes and refault rates."""

from __future__ import annotations

import asyncio
import types
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from edged.backends.base import MemoryUsage
from edged.errors import BackendError
from edged.node.reclaim import ReclaimConfig, Reclaimer

MiB = 1 << 20


@dataclass
class Rec:
    id: str
    last_active: float = 0.0
    active_execs: int = 0
    paused: bool = False


class Mem:
    """A backend double: per sandbox memory, CPU that ticks, reclaim moving anon to swap."""

    can_reclaim = True

    def __init__(self) -> None:
        self.use: dict[str, MemoryUsage] = {}
        self.cpu_rate: dict[str, float] = {}  # cores in use
        self.wait_rate: dict[str, float] = {}  # cores' worth of time runnable, not running
        self.reclaims: list[str] = []
        self.fail: set[str] = set()
        self.reads: dict[str, int] = {}  # memory() calls (cgroup file reads) per sandbox

    def add(self, sid: str, anon: int) -> None:
        self.use[sid] = MemoryUsage(resident_bytes=anon + MiB, anon_bytes=anon)

    def tick(self, dt: float) -> None:
        for sid, u in self.use.items():
            self.use[sid] = replace(
                u, cpu_usage_ns=u.cpu_usage_ns + int(self.cpu_rate.get(sid, 0.0) * dt * 1e9),
                cpu_wait_ns=u.cpu_wait_ns + int(self.wait_rate.get(sid, 0.0) * dt * 1e9))

    async def memory(self, sid: str) -> MemoryUsage:
        self.reads[sid] = self.reads.get(sid, 0) + 1
        return self.use[sid]

    async def reclaim(self, sid: str, nbytes: int | None) -> int:
        if sid in self.fail:
            raise BackendError("injected")
        u = self.use[sid]
        self.reclaims.append(sid)
        self.use[sid] = replace(u, resident_bytes=u.resident_bytes - u.anon_bytes,
                                anon_bytes=0, swap_bytes=u.swap_bytes + u.anon_bytes)
        return u.anon_bytes


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(tmp_path: Path, recs: list[Rec], **cfg: object) -> tuple[Reclaimer, Mem, Clock]:
    psi = tmp_path / "memory"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    mem, clock = Mem(), Clock()
    args: dict[str, object] = dict(idle_after_s=30.0, interval_s=2.0, recheck_s=60.0,
                                   rate_bytes=64 * MiB)
    args.update(cfg)
    r = Reclaimer(ReclaimConfig(**args), mem, lambda: recs,  # type: ignore[arg-type]
                  psi_path=str(psi), meminfo_path=str(tmp_path / "none"), clock=clock)
    return r, mem, clock


def run(r: Reclaimer, mem: Mem, clock: Clock, seconds: float, step: float = 2.0) -> list[str]:
    done: list[str] = []
    end = clock.t + seconds
    while clock.t < end:
        clock.t += step
        mem.tick(step)
        done += asyncio.run(r.pass_once()).reclaimed
    return done


def test_idle_sandbox_reclaimed_once_after_cpu_window(tmp_path: Path) -> None:
    recs = [Rec("idle", last_active=1000.0), Rec("busy", last_active=1000.0),
            Rec("exec", last_active=0.0, active_execs=1), Rec("recent", last_active=1050.0)]
    r, mem, clock = make(tmp_path, recs)
    for rec in recs:
        mem.add(rec.id, 12 * MiB)
    mem.cpu_rate["busy"] = 0.2  # a daemonized loop inside: never idle
    # the API was quiet 30 s at t=1030; the CPU window then takes another 30 s
    assert run(r, mem, clock, 58) == []
    done = run(r, mem, clock, 20)
    assert done == ["idle"]  # not the busy one, not the one with an exec running
    assert mem.use["idle"].anon_bytes == 0 and mem.use["idle"].swap_bytes == 12 * MiB
    assert run(r, mem, clock, 200) == ["recent"]  # quiet since 1050: its turn came
    assert r.totals()["sandboxes_reclaimed"] == 2
    assert r.totals()["reclaimed_bytes"] == 24 * MiB


def test_a_cpu_starved_sandbox_is_not_idle(tmp_path: Path) -> None:
    """A best-effort sandbox on a busy node runs little (0.4% of a core, below idle_cpu)
    but waits to run all the time: it is busy, and reclaiming it would page out a heap it
    is still building."""
    recs = [Rec("starved", last_active=1000.0), Rec("idle", last_active=1000.0)]
    r, mem, clock = make(tmp_path, recs)
    for rec in recs:
        mem.add(rec.id, 12 * MiB)
    mem.cpu_rate["starved"] = 0.004
    mem.wait_rate["starved"] = 0.9
    assert run(r, mem, clock, 200) == ["idle"]
    mem.wait_rate["starved"] = 0.0  # its work done: idle now
    mem.cpu_rate["starved"] = 0.0
    assert run(r, mem, clock, 80) == ["starved"]


def test_regrowth_is_reclaimed_again_and_wake_resets(tmp_path: Path) -> None:
    recs = [Rec("a", last_active=1000.0)]
    r, mem, clock = make(tmp_path, recs)
    mem.add("a", 8 * MiB)
    assert run(r, mem, clock, 80) == ["a"]
    assert run(r, mem, clock, 120) == []  # rechecked: nothing grew back
    u = mem.use["a"]  # a background task woke and touched 4 MiB
    mem.use["a"] = replace(u, resident_bytes=u.resident_bytes + 4 * MiB, anon_bytes=4 * MiB)
    assert run(r, mem, clock, 130) == ["a"]
    assert r.woke("a") is True and r.woke("a") is False  # the first request wakes it
    assert r.state["a"].wakes == 1
    recs[0].last_active = clock.t
    assert run(r, mem, clock, 50) == []  # quiet again: a full idle window first
    r.forget("a")
    assert "a" not in r.state


def test_budget_follows_memory_pressure(tmp_path: Path) -> None:
    recs = [Rec(f"s{i}", last_active=0.0) for i in range(40)]
    r, mem, clock = make(tmp_path, recs, rate_bytes=16 * MiB, psi_target=1.0)
    for rec in recs:
        mem.add(rec.id, 4 * MiB)
    full = r.budget
    assert full == 32 * MiB  # rate × interval
    run(r, mem, clock, 4)  # CPU windows start
    psi = tmp_path / "memory"
    # 2 s of the last 32 s stalled: back off
    psi.write_text("some avg10=10.00 avg60=1.00 avg300=0.00 total=2000000\n"
                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    clock.t += 32
    mem.tick(32)
    res = asyncio.run(r.pass_once())
    assert res.stall_pct > 1.0 and r.budget == full // 2
    assert len(res.reclaimed) == 4  # 16 MiB of 5 MiB sandboxes: the budget stops it
    clock.t += 2
    res = asyncio.run(r.pass_once())  # calm again: the budget grows back
    assert res.stall_pct == 0.0 and r.budget == full // 2 + full // 8


def test_errors_of_one_sandbox_do_not_stop_a_pass(tmp_path: Path) -> None:
    recs = [Rec("bad", last_active=0.0), Rec("good", last_active=0.0)]
    r, mem, clock = make(tmp_path, recs)
    mem.add("bad", MiB)
    mem.add("good", MiB)
    mem.fail.add("bad")
    assert run(r, mem, clock, 62) == ["good"]


def test_refault_rate_and_reclaimable(tmp_path: Path) -> None:
    recs = [Rec("a", last_active=0.0), Rec("b", last_active=0.0)]
    r, mem, clock = make(tmp_path, recs, rate_bytes=MiB // 2)  # budget: one per pass
    mem.add("a", 100 * MiB)
    mem.add("b", 40 * MiB)
    run(r, mem, clock, 30)
    assert r.idle_bytes() == 140 * MiB  # idle, not reclaimed yet: their anon
    assert run(r, mem, clock, 2) == ["a"]
    assert r.idle_bytes() == 40 * MiB
    assert r.refault_rate() is None  # reclaimed less than a minute ago
    ws = r.state["a"].working_set
    assert ws == 101 * MiB
    clock.t += 120  # two minutes later it faulted 0.1% of its working set back in
    u = mem.use["a"]
    pages = ws // 1000 // 4096
    mem.use["a"] = replace(u, major_faults=u.major_faults + pages)
    r.state["a"].last, r.state["a"].read_at = mem.use["a"], clock.t
    rate = r.refault_rate()
    assert rate == pytest.approx(pages * 4096 / ws * 100 / 2)  # ~0.1% over 2 min
    assert 0.045 < (rate or 0) < 0.05


def test_reclaim_now_and_unsupported_backend(tmp_path: Path) -> None:
    r, mem, _clock = make(tmp_path, [])
    mem.add("p", 3 * MiB)
    assert asyncio.run(r.reclaim_now("p")) == 3 * MiB
    assert r.state["p"].reclaimed
    plain = Reclaimer(ReclaimConfig(), types.SimpleNamespace(can_reclaim=False), lambda: [])
    assert not plain.supported and asyncio.run(plain.reclaim_now("x")) == 0
    assert asyncio.run(plain.pass_once()).reclaimed == []


def test_a_paused_sandbox_keeps_its_reclaim_state(tmp_path: Path) -> None:
    """A pause pages the sandbox out (reclaim_now); the passes that follow neither reclaim
    it again nor forget it (they had: its resume then counted no wake)."""
    recs = [Rec("p", last_active=0.0, paused=True)]
    r, mem, clock = make(tmp_path, recs)
    mem.add("p", 8 * MiB)
    assert asyncio.run(r.reclaim_now("p")) == 8 * MiB
    assert run(r, mem, clock, 300) == []
    assert r.state["p"].reclaimed and mem.reclaims == ["p"]
    recs[0].paused = False
    assert r.woke("p") is True and r.state["p"].wakes == 1


def test_no_reclaim_into_a_swap_without_room(tmp_path: Path) -> None:
    """A sandbox whose anonymous memory does not fit in the room swap has left is not paged
    out (a zram device at its RAM limit fails each write; the pages stay resident): the pass
    counts it, the ones that fit are reclaimed and use the room up, and once room comes
    back (at its recheck) the rest goes too. A pause's reclaim is held back the same way."""
    recs = [Rec("a", last_active=1000.0), Rec("b", last_active=1000.0),
            Rec("c", last_active=1000.0)]
    r, mem, clock = make(tmp_path, recs)
    for rec, mib in zip(recs, (40, 30, 20), strict=True):
        mem.add(rec.id, mib * MiB)
    room = [60 * MiB]
    ensured: list[int] = []
    r.swap_room = lambda: room[0]
    r.ensure_swap = lambda: bool(ensured.append(1)) or True
    results = []
    for _ in range(40):
        clock.t += 2.0
        mem.tick(2.0)
        results.append(asyncio.run(r.pass_once()))
    done = [sid for p in results for sid in p.reclaimed]
    assert done == ["a", "c"]  # 40 fit in 60, then 30 did not fit in 20, then 20 did
    assert mem.use["b"].anon_bytes == 30 * MiB and mem.use["b"].swap_bytes == 0
    assert max(p.swap_full for p in results) == 1 and r.swap_full == 0
    assert ensured  # the swap is set up before its room is read
    room[0] = 100 * MiB
    assert run(r, mem, clock, 70) == ["b"]
    mem.add("d", 8 * MiB)  # paused: paged out only if it fits
    room[0] = MiB
    assert asyncio.run(r.reclaim_now("d")) == 0 and "d" not in mem.reclaims
    room[0] = 8 * MiB
    assert asyncio.run(r.reclaim_now("d")) == 8 * MiB and mem.reclaims[-1] == "d"


def test_a_full_swap_is_watched_not_the_sandboxes(tmp_path: Path) -> None:
    """Swap with no room (a zram device at its RAM limit: each reclaim into it compressed
    pages only to fail them, and the daemon spent a whole core so): 40 idle sandboxes due,
    20 minutes. The first pass that finds none fits reads each once and reclaims none; then
    no sandbox is read nor reclaimed, and the room is read ever less often (before: each
    sandbox read every minute, 20 reads each, and the room every time one was due). Once a
    sandbox is deleted the room is read at the next pass; once it has room, they go."""
    recs = [Rec(f"s{i}", last_active=1000.0) for i in range(40)]
    r, mem, clock = make(tmp_path, recs, recheck_max_s=600.0)
    for rec in recs:
        mem.add(rec.id, 50 * MiB)
    room = [8 * MiB]
    looks: list[float] = []
    r.swap_room = lambda: bool(looks.append(clock.t)) or room[0]
    r.budget = r.cfg.rate_bytes = 10**12
    assert run(r, mem, clock, 62) == []  # idle 30 s, CPU window 30 s: due, none fits
    assert set(mem.reads.values()) == {2}
    mem.reads.clear()
    looks.clear()
    passes = r.passes
    assert run(r, mem, clock, 1200) == []
    assert r.passes - passes == 600 and not mem.reads and not mem.reclaims
    assert 4 <= len(looks) <= 9, looks  # after 4, 8, 16, ... s, then every 600 s
    assert r.swap_full == 40  # still reported while it waits
    # a sandbox deleted: its swap is free, the room is read at once (and is still short)
    recs.pop()
    r.forget("s39")
    looks.clear()
    run(r, mem, clock, 2)
    assert len(looks) == 1 and not mem.reads
    # room again: read at the next look, and the sandboxes are reclaimed
    room[0] = 10 * 1024 * MiB
    r.forget("gone")
    done = run(r, mem, clock, 130)
    assert sorted(done) == sorted(x.id for x in recs)


def test_idle_reclaimed_sandboxes_are_read_ever_less_often(tmp_path: Path) -> None:
    """50 idle sandboxes, reclaimed, then 30 minutes of nothing: each is read (its cgroup's
    memory and CPU files) after 60 s, then after twice as long each time it is found as it
    was, up to 10 minutes: 5 reads each in those 30 minutes, not one a minute (30) as
    before. A request starts it over; one whose memory grew back is reclaimed again."""
    recs = [Rec(f"s{i}", last_active=1000.0) for i in range(50)]
    r, mem, clock = make(tmp_path, recs, recheck_max_s=600.0)
    for rec in recs:
        mem.add(rec.id, 4 * MiB)
    r.budget = r.cfg.rate_bytes = 10**12
    assert sorted(run(r, mem, clock, 62)) == sorted(x.id for x in recs)
    mem.reads.clear()
    assert run(r, mem, clock, 1800, step=10.0) == []
    per = sorted(set(mem.reads.values()))
    assert per == [5], per  # at +60, +180, +420, +900, +1500 s
    assert r.state["s0"].recheck_every == 600.0
    # a request: checked again from the start (its idle window, then 60 s after a reclaim)
    recs[0].last_active = clock.t
    assert r.woke("s0") and r.state["s0"].recheck_every == 0.0
    mem.reads.clear()
    assert run(r, mem, clock, 64) == ["s0"]  # idle 30 s, CPU window 30 s: reclaimed again
    assert mem.reads["s0"] >= 2 and set(mem.reads) == {"s0"}
    # memory grown back in the background while backed off: reclaimed again at its check
    mem.use["s1"] = replace(mem.use["s1"], resident_bytes=mem.use["s1"].resident_bytes
                            + 8 * MiB, anon_bytes=8 * MiB)
    assert run(r, mem, clock, 600) == ["s1"]


def test_idle_sooner_when_memory_is_short(tmp_path: Path) -> None:
    """With MemAvailable below low_bytes a sandbox quiet for 3 s, then 3 s of CPU window,
    is reclaimed at the pass after (8 s after its last request, not 20 as before, nor
    60); with memory to spare it waits the 30 + 30 s."""
    meminfo = tmp_path / "meminfo"
    for avail_mib, first in ((512, 8.0), (8192, 60.0)):
        meminfo.write_text(f"MemTotal: {16 << 20} kB\nMemAvailable: {avail_mib << 10} kB\n")
        recs = [Rec("a", last_active=1000.0)]
        r, mem, clock = make(tmp_path, recs, low_bytes=1 << 30)
        r.meminfo_path = str(meminfo)
        mem.add("a", 12 * MiB)
        clock.t = 1000.0
        assert run(r, mem, clock, first - 2.0) == []
        assert run(r, mem, clock, 2.0) == ["a"], avail_mib


def short_of_memory(tmp_path: Path, r: Reclaimer, avail: int) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {16 << 20} kB\nMemAvailable: {avail >> 10} kB\n")
    r.meminfo_path = str(meminfo)


def stall(tmp_path: Path, some_s: float) -> None:
    (tmp_path / "memory").write_text(
        f"some avg10=50.00 avg60=0.00 avg300=0.00 total={int(some_s * 1e6)}\n"
        f"full avg10=50.00 avg60=0.00 avg300=0.00 total={int(some_s * 1e6)}\n")


def test_a_shortage_budget_is_the_deficit_whatever_the_pressure(tmp_path: Path) -> None:
    """Short of memory by 400 MiB, with the host stalled half the time: a pass reclaims at
    least the deficit (before: the budget halved on the stall, 16 MiB a pass at the
    floor, and reclaim slowed down exactly when it was needed); with memory to spare the
    same stall halves the budget."""
    for deficit, want in ((400 * MiB, 400 * MiB), (0, 0)):
        recs = [Rec(f"s{i}", last_active=0.0) for i in range(200)]
        r, mem, clock = make(tmp_path, recs, rate_bytes=512 * MiB, low_bytes=2 << 30)
        short_of_memory(tmp_path, r, (2 << 30) - deficit if deficit else 8 << 30)
        for rec in recs:
            mem.add(rec.id, 10 * MiB)
        stall(tmp_path, 0.0)
        run(r, mem, clock, 6)  # CPU windows start (and end: 3 s under a shortage)
        before = len(mem.reclaims)
        r.budget = 32 * MiB  # the pace had come down
        spent = 0.0
        for _ in range(3):  # each pass: half of its 2 s stalled, not by us
            spent += 1.0
            stall(tmp_path, spent)
            clock.t += 2.0
            mem.tick(2.0)
            res = asyncio.run(r.pass_once())
            assert res.stall_pct == pytest.approx(50.0, abs=1.0)
            if deficit:
                assert res.budget >= want
                # whole sandboxes (11 MiB resident each) up to the deficit
                assert len(res.reclaimed) >= want // (11 * MiB)
        if not deficit:
            assert r.budget == 16 * MiB  # halved twice to the floor, then held
            assert len(mem.reclaims) - before <= 3 * 2
        else:
            assert len(mem.reclaims) - before >= 3 * (want // (11 * MiB))


def test_a_busy_sandbox_is_looked_at_again_soon_when_memory_is_short(tmp_path: Path) -> None:
    """A sandbox still starting (CPU in its window) under a shortage is judged again after
    the short idle time, not after idle_after_s (30 s)."""
    recs = [Rec("a", last_active=1000.0)]
    r, mem, clock = make(tmp_path, recs, low_bytes=1 << 30)
    short_of_memory(tmp_path, r, 512 * MiB)
    mem.add("a", 12 * MiB)
    clock.t = 1000.0
    mem.cpu_rate["a"] = 0.5  # python importing
    assert run(r, mem, clock, 8.0) == []
    mem.cpu_rate["a"] = 0.0  # asleep now
    assert run(r, mem, clock, 8.0) == ["a"]


def test_rate_is_bytes_freed_lately(tmp_path: Path) -> None:
    recs = [Rec(f"s{i}", last_active=0.0) for i in range(4)]
    r, mem, clock = make(tmp_path, recs)
    for rec in recs:
        mem.add(rec.id, 15 * MiB)
    assert r.rate() == 0.0
    run(r, mem, clock, 62)
    assert len(mem.reclaims) == 4
    assert r.rate(window_s=30.0) == pytest.approx(60 * MiB / 30.0)
    clock.t += 31
    assert r.rate(window_s=30.0) == 0.0
