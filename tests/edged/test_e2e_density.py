"""Density end to end through the real container backend (root): idle sandboxes reclaimed
into a zram device of the daemon's own and woken by the next request with their state
intact; pause that pages out and resume that reads back; the zram device gone after the
daemon stops; CPU QoS classes."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from edged.client import Sandbox
from tests.edged.test_e2e_container import layer_store, real_node  # noqa: F401  (fixtures)

pytestmark = [
    pytest.mark.root, pytest.mark.mount,
    pytest.mark.skipif(not Path("/sys/class/zram-control").exists(), reason="needs zram"),
]

MiB = 1 << 20
ENV = {"PATH": "/bin"}
# A process holding ~10 MiB of state in its heap (a shell variable of random hex) that,
# each time a line is written to the FIFO /tmp/ask, writes the state's checksum to /tmp/sum
# (blocked in open(2) meanwhile: no CPU; a signal from another exec would be refused, each
# exec runs in a Landlock domain of its own).
HOLDER = """x=$(head -c 5000000 /dev/urandom | od -An -tx1 | tr -d ' \\n')
mkfifo /tmp/ask
echo $$ > /tmp/pid
while :; do read line < /tmp/ask; echo ${#x} $(echo "$x" | md5sum) > /tmp/sum; done
"""


def _fast_reclaim(**kw: object) -> dict[str, object]:
    cfg: dict[str, object] = dict(swap="zram", zram_bytes=512 * MiB, idle_after_s=0.5,
                                  idle_cpu=0.05, reclaim_interval_s=0.2)
    cfg.update(kw)
    return cfg


def _start_holder(sbx: Sandbox) -> str:
    sbx.files.write("/tmp/holder.sh", HOLDER)
    sbx.exec("sh /tmp/holder.sh > /dev/null 2>&1 &")
    for _ in range(200):  # the state is built once the pid file is there
        if sbx.exec("cat /tmp/pid 2>/dev/null").stdout.strip():
            break
        time.sleep(0.05)
    return _checksum(sbx)


def _checksum(sbx: Sandbox) -> str:
    sbx.exec("rm -f /tmp/sum; echo > /tmp/ask")
    for _ in range(200):
        out = sbx.exec("cat /tmp/sum 2>/dev/null").stdout
        if out.strip():
            return out
        time.sleep(0.05)
    raise AssertionError("the holder did not answer")


def _zram_devices() -> set[str]:
    return {d for d in os.listdir("/sys/block") if d.startswith("zram")}


def test_idle_sandbox_reclaimed_then_woken_intact(real_node, layer_store) -> None:  # noqa: F811
    _, digest = layer_store
    before = _zram_devices()
    node = real_node(**_fast_reclaim())
    m = node.server.manager
    sbx = Sandbox.create(layers=[digest], id="idle-1", env=ENV, socket=node.socket)
    state = _start_holder(sbx)
    assert state.startswith("10000000 ")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # idle: no exec, no request, no CPU
        st = m.reclaimer.state.get("idle-1")
        if st is not None and st.reclaimed:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the idle sandbox was not reclaimed")
    use = st.last
    assert use.swap_bytes >= 8 * MiB, use  # the holder's heap went to swap
    assert st.working_set - use.resident_bytes >= 8 * MiB
    feats = m.swap.features() if m.swap else {}
    assert feats["zram_device"] and f"{feats['zram_device']}" not in before
    # the next request wakes it: bounded, and every byte of its state is as it was
    t0 = time.monotonic()
    assert sbx.exec("echo awake").stdout == "awake\n"
    wake = time.monotonic() - t0
    assert wake < 2.0, f"wake took {wake:.3f} s"
    assert m.reclaimer.state["idle-1"].wakes == 1 and not st.reclaimed
    assert _checksum(sbx) == state
    assert node.server.manager.metrics.wake_seconds._sum.get() > 0  # observed
    sbx.kill()
    node.stop()
    assert _zram_devices() == before  # nothing left after the daemon stops
    assert not Path(node.server.config.state_dir, "swap.json").exists()


def test_pause_pages_out_and_resume_reads_back(real_node, layer_store) -> None:  # noqa: F811
    _, digest = layer_store
    before = _zram_devices()
    node = real_node(**_fast_reclaim(idle_after_s=3600.0))  # no idle reclaim: pause only
    m = node.server.manager
    sbx = Sandbox.create(layers=[digest], id="p-1", env=ENV, socket=node.socket)
    state = _start_holder(sbx)
    def mem():
        return asyncio.run_coroutine_threadsafe(m.backend_of("p-1").memory("p-1"),
                                                node.thread.loop).result(10)

    resident0 = mem().resident_bytes
    sbx.pause()
    paused = mem()
    assert paused.swap_bytes >= 8 * MiB and resident0 - paused.resident_bytes >= 8 * MiB
    sbx.resume()
    assert sbx.state == "running"
    assert _checksum(sbx) == state
    # a request to a paused sandbox resumes it transparently
    sbx.pause()
    assert sbx.exec("echo hi").stdout == "hi\n" and sbx.state == "running"
    assert _checksum(sbx) == state
    sbx.kill()
    node.stop()
    assert _zram_devices() == before


def test_kept_sandboxes_keep_the_zram_for_the_next_daemon(real_node, layer_store) -> None:  # noqa: F811
    _, digest = layer_store
    before = _zram_devices()
    node = real_node(**_fast_reclaim(idle_after_s=3600.0, on_shutdown="keep"))
    sbx = Sandbox.create(layers=[digest], id="keep-1", env=ENV, socket=node.socket)
    state = _start_holder(sbx)
    sbx.pause()  # its pages are in our zram device now
    dev = node.server.manager.swap.features()["zram_device"]
    node.stop()
    assert dev in _zram_devices()  # still holding a live sandbox's pages
    node2 = real_node(**_fast_reclaim(idle_after_s=3600.0, on_shutdown="stop"))
    assert node2.server.recovered["adopted"] == ["keep-1"]
    assert node2.server.manager.swap.features()["adopted"]
    again = Sandbox.connect("keep-1", socket=node2.socket)
    assert again.exec("echo ok").stdout == "ok\n"  # resumed by the request
    assert _checksum(again) == state
    node2.stop()
    assert _zram_devices() == before


def _cpu_ns(node, sid: str) -> int:
    return asyncio.run_coroutine_threadsafe(node.server.manager.backend_of(sid).memory(sid),
                                            node.thread.loop).result(10).cpu_usage_ns


def test_qos_best_effort_yields_cpu_to_latency_sensitive(real_node, layer_store) -> None:  # noqa: F811
    """Two busy loops per core in each class: the latency-sensitive sandbox gets nearly all
    of the CPU (best-effort runs as SCHED_IDLE: cpu.idle of its cgroup)."""
    _, digest = layer_store
    node = real_node(swap="off", reclaim=False)
    cores = len(os.sched_getaffinity(0))
    be = Sandbox.create(layers=[digest], id="be", env=ENV, socket=node.socket,
                        cpus=float(cores), qos="best_effort")
    ls = Sandbox.create(layers=[digest], id="ls", env=ENV, socket=node.socket,
                        cpus=float(cores), qos="latency_sensitive")
    assert be.info["qos"] == "best_effort" and ls.info["qos"] == "latency_sensitive"
    backend = node.server.manager.backend_of("be")
    for sid, want in (("be", "1"), ("ls", "0")):
        cg = backend._sandboxes[sid].cg
        d = cg.dirs.get("cpu") or cg.dirs.get("v2")
        # idle by its own cpu.idle, or (v1) by its parent's: all best-effort work is one
        # idle group beside the daemon and the latency-sensitive sandboxes
        idle = "1" in {(d / "cpu.idle").read_text().strip(),
                       (d.parent / "cpu.idle").read_text().strip()}
        assert idle == (want == "1"), (sid, d)
    loops = " ".join(["while :; do :; done &"] * cores)
    be.exec(f"sh -c '{loops}' > /dev/null 2>&1 &")
    time.sleep(0.5)
    b0, l0 = _cpu_ns(node, "be"), _cpu_ns(node, "ls")
    ls.exec(f"sh -c '{loops}' > /dev/null 2>&1 &")
    time.sleep(2.0)
    b1, l1 = _cpu_ns(node, "be"), _cpu_ns(node, "ls")
    # both classes hold `cores` loops: the latency-sensitive one takes the CPU
    assert (l1 - l0) > 5 * (b1 - b0), (l1 - l0, b1 - b0)
    be.kill()
    ls.kill()
