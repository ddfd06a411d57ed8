"""Host-wide uid slot claims: two daemons on one host never map the same host ids, claims
survive a daemon's death while its sandbox runs, and stale ones are taken over."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edged.backends.container import ContainerBackend
from edged.backends.uidslots import UidSlots, starttime
from tests.edged.backends.container.conftest import assert_left_clean

GRID = {"uid_base": 1 << 30, "id_count": 65536, "max_slots": 64}


def _slots(tmp_path: Path, owner: str, **kw: int) -> UidSlots:
    return UidSlots(tmp_path / owner, directory=tmp_path / "claims", **{**GRID, **kw})


def test_two_owners_never_share_a_slot(tmp_path: Path) -> None:
    a, b = _slots(tmp_path, "a"), _slots(tmp_path, "b")
    got_a = {a.claim(set(), f"a{i}") for i in range(20)}
    got_b = {b.claim(set(), f"b{i}") for i in range(20)}
    assert len(got_a) == len(got_b) == 20 and not got_a & got_b
    # a release gives back only one's own claims
    for s in got_a:
        b.release(s)
        assert a.read(s) is not None and a.read(s)["owner"] == a.owner
    a.release(min(got_a))
    assert a.read(min(got_a)) is None


def test_concurrent_processes_claim_disjoint_slots(tmp_path: Path) -> None:
    prog = textwrap.dedent("""
        import json, sys
        from edged.backends.uidslots import UidSlots
        s = UidSlots(sys.argv[1], directory=sys.argv[2], uid_base=1 << 30, id_count=65536,
                     max_slots=400)
        s._next = 0  # every process starts at the same slot: the worst case
        got = [s.claim(set(), f"x{i}") for i in range(100)]
        print(json.dumps(got), flush=True)  # a pipe: block-buffered unless PYTHONUNBUFFERED
        sys.stdin.read()  # hold the claims (daemon alive) until told to go
    """)
    procs = [subprocess.Popen([sys.executable, "-c", prog, str(tmp_path / f"o{i}"),
                               str(tmp_path / "claims")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for i in range(4)]
    try:
        lists = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.communicate("")
    flat = [s for got in lists for s in got]
    assert len(flat) == 400 and len(set(flat)) == 400


def test_claims_of_a_killed_daemon_go_stale_unless_its_sandbox_runs(tmp_path: Path) -> None:
    prog = textwrap.dedent("""
        import sys
        from edged.backends.uidslots import UidSlots
        s = UidSlots(sys.argv[1], directory=sys.argv[2], uid_base=1 << 30, id_count=65536,
                     max_slots=4)
        s._next = 0
        a, b = s.claim(set(), "pooled"), s.claim(set(), "sb")
        s.bind(b, "sb", int(sys.argv[3]))  # slot b's sbx-init runs
        print(a, b, flush=True)
        sys.stdin.read()
    """)
    init = subprocess.Popen(["sleep", "60"])  # stands in for a sandbox's sbx-init
    try:
        d = subprocess.Popen([sys.executable, "-c", prog, str(tmp_path / "dead"),
                              str(tmp_path / "claims"), str(init.pid)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        a, b = map(int, d.stdout.readline().split())  # type: ignore[union-attr]
        other = _slots(tmp_path, "other", max_slots=4)
        other._next = 0
        # while the daemon lives, neither slot is free
        assert other.claim(set(), "o1") not in (a, b)
        d.send_signal(signal.SIGKILL)
        d.communicate()
        got = {other.claim(set(), f"o{i}") for i in range(2, 4)}
        assert a in got and b not in got  # the running sandbox keeps its range
        with pytest.raises(Exception, match="no free uid range"):
            other.claim(set(), "o9")
        init.kill()
        init.wait()
        assert other.claim(set(), "o9") == b  # its sandbox is gone: stale now
    finally:
        init.kill()
        init.wait()


def test_meta_of_the_owner_keeps_a_claim_live(tmp_path: Path) -> None:
    """The window between the spawner's report and the claim's update: the owner's
    meta.json names the slot and a live sbx-init."""
    owner = tmp_path / "owner"
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (owner / "sandboxes" / "sb").mkdir(parents=True)
        (owner / "sandboxes" / "sb" / "meta.json").write_text(json.dumps(
            {"slot": 0, "pid": sleeper.pid, "starttime": starttime(sleeper.pid)}))
        claims = tmp_path / "claims" / f"{GRID['uid_base']}+{GRID['id_count']}"
        claims.mkdir(parents=True)
        (claims / "0").write_text(json.dumps({"owner": str(owner.resolve()), "daemon": [1, -1],
                                              "slot": 0, "sandbox": "sb", "init": None}))
        (claims / "1").write_text("{torn")  # unreadable: stale
        s = _slots(tmp_path, "s", max_slots=2)
        s._next = 0
        assert s.claim(set(), "x") == 1
        with pytest.raises(Exception, match="no free uid range"):
            s.claim(set(), "y")
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.root
@pytest.mark.mount
def test_two_backends_map_disjoint_host_ids(tmp_path: Path, busybox_tree: Path) -> None:
    """Two daemons (their own state dirs, cgroup subtrees) creating at once: before the
    host-wide claims both gave their first sandbox slot 0, the same host uids."""
    from tests.edged.backends.container.test_container import spec

    one, two = ContainerBackend(tmp_path / "one"), ContainerBackend(tmp_path / "two")
    if not (one.bin_dir / "edged-spawner").exists():
        pytest.skip("edged/_bin not built: run `pip install -e .`")

    def uid_map(b: ContainerBackend) -> tuple[int, int]:
        pid = b._sandboxes["sb1"].pid
        _inside, host, count = map(int, Path(f"/proc/{pid}/uid_map").read_text().split())
        return host, host + count

    async def body() -> None:
        await asyncio.gather(one.create(spec((str(busybox_tree),))),
                             two.create(spec((str(busybox_tree),))))
        try:
            (a0, a1), (b0, b1) = uid_map(one), uid_map(two)
            assert a1 <= b0 or b1 <= a0, f"ranges overlap: {a0}-{a1} and {b0}-{b1}"
            slot = one._sandboxes["sb1"].slot
            claim = one.uid_slots.read(slot)
            assert claim is not None and claim["owner"] == str((tmp_path / "one").resolve())
            assert claim["init"][0] == one._sandboxes["sb1"].pid
        finally:
            await one.destroy("sb1")
            await two.destroy("sb1")
        assert one.uid_slots.read(slot) is None or not one.uid_slots.ours(
            one.uid_slots.read(slot))

    asyncio.run(body())
    for b in (one, two):
        assert_left_clean(ContainerBackend(b.state_dir))
