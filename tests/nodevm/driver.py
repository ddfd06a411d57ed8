"""``scripts/node-vm.sh``: boot a production-like node under QEMU and run the selected tests in
it. Usage (as root, from the checkout, after ``scripts/install.sh``)::

    .venv/bin/python -m tests.nodevm.driver [--memory-mib 4096] [--vcpus 2] [--accel auto]
        [--timeout-min 70] [--out DIR] [--keep] [-- PYTEST ARGS]

Steps: the base image (cached, :mod:`tests.nodevm.image`), a wheel built from a copy of this
checkout's files, a payload disk (wheel, tests, ``guest/run.sh``), a qcow2 overlay of the base
image (the base is never written), then QEMU (``q35``, the cloud kernel and its initramfs
booted directly, virtio disks) with KVM when a bounded test boot of a microVM guest finds it
working (:func:`edged.backends.microvm.accel.probe`), TCG otherwise. The guest installs edged
from the wheel, enables ``edged.service``, runs the tests and writes its results (JUnit XML,
logs, journal) as a tar onto a results disk, then powers off. Every wait is bounded; on any
exit the QEMU process is asked to quit over QMP, then killed, and the run's disks removed
(``--keep`` keeps them), so no QEMU process is left behind. The last line printed is
:func:`tests.nodevm.report.summary_line`; the exit status is 0 only when
:func:`tests.nodevm.report.verdict` finds nothing wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from edged.backends.microvm import accel, guestkit
from edged.backends.microvm.qemu import QemuVmm
from edged.backends.microvm.qmp import Qmp, QmpError
from edged.backends.microvm.vmm import Machine
from tests.nodevm import image, report

log = logging.getLogger("nodevm")

REPO = Path(__file__).resolve().parents[2]
GUEST = Path(__file__).resolve().parent / "guest"

#: What runs inside (paths relative to the checkout; the markers below are applied too):
#: the container backend, the confinement and red-team suite, the cgroups room, sbx-init's
#: client, the sandbox lifecycle and recovery through the daemon, layer mounts (EROFS on a
#: loop device there), density's admission, reclaim and swap, the NOFILE limits, and this
#: node's own service test (edged.service as installed).
SELECTION = (
    "tests/nodevm/test_node_service.py",
    "tests/edged/backends/container",
    "tests/security",
    "tests/edged/cgroups",
    "tests/edged/security",
    "tests/edged/sbxinit",
    "tests/edged/test_e2e_container.py",
    "tests/edged/test_daemon.py",
    "tests/edged/node",
    "tests/edged/test_e2e_density.py",
    "tests/edged/images",
    "tests/edged/test_nofile_e2e.py",
    "tests/layerfs/test_mount.py",
    "tests/layerfs/test_overlay_stack.py",
    "tests/edged/net",
)
#: Not inside: long and benchmark tests, VMs in the VM, and anything needing the network.
MARKERS = "not slow and not bench and not vm and not network"

PR_SET_PDEATHSIG = 1


def guest_pytest_args(given: Sequence[str]) -> list[str]:
    """The guest's pytest arguments: the selection with :data:`MARKERS` when none are
    given; else the given ones (a file, ``-k``, ``-x``: ``node-vm.sh -- -k name tests/x.py``),
    with :data:`MARKERS` added unless they choose their own ``-m`` (as scripts/test.sh
    does), and the whole :data:`SELECTION` when they name no path of their own."""
    if not given:
        return ["-m", MARKERS, *SELECTION]
    out = list(given)
    if not any(a == "-m" or a.startswith("-m") for a in out):
        out = ["-m", MARKERS, *out]
    if not any(a.startswith("tests") for a in out):
        out += SELECTION
    return out


def _die_with_parent() -> None:
    """In QEMU's child before exec: SIGKILL when the driver dies (even by SIGKILL), so no
    QEMU outlives a killed run."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def build_wheel(out: Path) -> Path:
    """A wheel of this checkout's files (tracked and untracked but not ignored: what a clean
    clone of the working tree holds), built in a copy so the checkout's build state is not
    used; returns its path."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co",
                            "--exclude-standard"], capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="nodevm-src-") as src_s:
        src = Path(src_s)
        for rel in filter(None, files.decode().split("\0")):
            s = REPO / rel
            if not s.is_file() and not s.is_symlink():
                continue  # deleted in the working tree
            d = src / rel
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d, follow_symlinks=False)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                               "--no-build-isolation", "-w", str(out), str(src)],
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise image.ImageError(f"pip wheel: {proc.stderr[-3000:]}")
        log.info("wheel built in %.1f s", time.monotonic() - t0)
    wheels = sorted(out.glob("edged-*.whl"))
    if not wheels:
        raise image.ImageError(f"pip wheel wrote no edged-*.whl into {out}")
    return wheels[-1]


def stage_payload(work: Path, pytest_args: Sequence[str]) -> Path:
    """The payload directory: ``dist/`` (the wheel), ``suite/`` (tests/, profiles/ and
    pyproject.toml: the tests read the profiles' sources), ``run.sh``, ``selection`` (the
    pytest arguments, one line) and ``cache/`` (the Debian rootfs tarball the layer tests
    build from, linked from /var/cache/edged-test)."""
    p = work / "payload"
    (p / "dist").mkdir(parents=True)
    build_wheel(p / "dist")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    shutil.copytree(REPO / "tests", p / "suite" / "tests", ignore=ignore)
    shutil.copytree(REPO / "profiles", p / "suite" / "profiles", ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", p / "suite" / "pyproject.toml")
    shutil.copy2(GUEST / "run.sh", p / "run.sh")
    (p / "selection").write_text("".join(f"{a}\n" for a in pytest_args))
    (p / "cache").mkdir()
    test_cache = Path(os.environ.get("EDGED_TEST_CACHE", "/var/cache/edged-test"))
    tar = test_cache / "debian-rootfs.tar"
    if tar.is_file():
        try:
            os.link(tar, p / "cache" / tar.name)
        except OSError:
            shutil.copy2(tar, p / "cache" / tar.name)
    return p


async def choose_accel(work: Path, wanted: str) -> tuple[str, str]:
    """(``"kvm"`` or ``"tcg"``, why): ``wanted`` unless ``auto``; for ``auto`` the microVM
    backend's probe (a microVM guest under KVM must reach sbx-init within its bound)."""
    if wanted != "auto":
        return wanted, "asked for"
    kit = guestkit.load()
    sbx_init = REPO / "edged" / "_bin" / "sbx-init"
    initrd = guestkit.build_initramfs(kit, sbx_init, work / "probe-initrd")
    machine = Machine(str(kit.kernel), str(initrd), guestkit.cmdline(), memory_mib=128,
                      ndisks=1)
    verdict = await accel.probe(QemuVmm(), machine, work / "probe")
    return verdict.accel, verdict.reason


def qemu_argv(base: image.BaseImage, work: Path, accel_name: str, memory_mib: int,
              vcpus: int) -> list[str]:
    """QEMU's command line: q35, ``-cpu max`` under TCG (``host`` under KVM), the kernel and
    initramfs booted directly with ``root=/dev/vda``, systemd's unified cgroup hierarchy and
    AppArmor said explicitly, ``tsc_early_khz`` (without it ~5% of TCG boots hang at TSC
    calibration, ``../shared/reference/host.md``); disks: the overlay (serial ``root``), the
    payload (read-only) and the results disk; the console to ``console.log``; QMP on
    ``qmp.sock``; no network device."""
    khz = guestkit.host_tsc_khz()
    append = ["root=/dev/vda", "rw", "console=ttyS0", "panic=-1", "quiet",
              "systemd.unified_cgroup_hierarchy=1", "apparmor=1", "security=apparmor",
              "systemd.show_status=false", "random.trust_cpu=on"]
    if khz:
        append.append(f"tsc_early_khz={khz}")
    if accel_name == "tcg":
        acc = ["-accel", "tcg,thread=multi,tb-size=512", "-cpu", "max"]
    else:
        acc = ["-accel", "kvm", "-cpu", "host"]
    disks: list[str] = []
    for serial, path, fmt, ro in (("root", work / "root.qcow2", "qcow2", False),
                                  ("payload", work / "payload.img", "raw", True),
                                  ("results", work / "results.img", "raw", False)):
        node = f"d{serial}"
        disks += ["-drive", f"file={path},if=none,id={node},format={fmt},cache=unsafe,"
                            f"readonly={'on' if ro else 'off'}",
                  "-device", f"virtio-blk-pci,drive={node},serial={serial}"]
    return ["qemu-system-x86_64", "-M", "q35", *acc, "-smp", str(vcpus), "-m", str(memory_mib),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(base.kernel), "-initrd", str(base.initrd),
            "-append", " ".join(append), *disks,
            "-device", "virtio-rng-pci",
            "-chardev", f"file,id=con,path={work / 'console.log'}", "-serial", "chardev:con",
            "-qmp", f"unix:{work / 'qmp.sock'},server=on,wait=off"]


class Guest:
    """The running QEMU: :meth:`start`, :meth:`wait_line` / :meth:`wait_exit` (bounded),
    :meth:`stop` (QMP ``quit``, then SIGKILL; always safe to call)."""

    def __init__(self, work: Path, stream: Path | None = None) -> None:
        self.work = work
        self.stream = stream
        self.proc: subprocess.Popen[bytes] | None = None
        self._console_pos = 0
        self._partial = b""
        self.lines: list[str] = []

    def start(self, argv: Sequence[str]) -> None:
        (self.work / "console.log").touch()
        with open(self.work / "qemu.log", "wb") as qlog:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=qlog,
                                         stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.info("QEMU pid %d", self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll_console(self) -> list[str]:
        """New complete console lines since the last call (also echoed to stderr)."""
        try:
            with open(self.work / "console.log", "rb") as f:
                f.seek(self._console_pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self._console_pos += len(data)
        data = self._partial + data
        *whole, self._partial = data.split(b"\n")
        new = [w.decode(errors="replace").rstrip("\r") for w in whole]
        for line in new:
            print(f"guest| {line}", file=sys.stderr, flush=True)
        cases = [line for line in new
                 if report.STREAM_PREFIX in line or report.MEM_PREFIX in line]
        if cases and self.stream is not None:
            with open(self.stream, "a") as f:  # kept as it comes: a killed run keeps it
                f.write("".join(f"{line}\n" for line in cases))
        self.lines += new
        return new

    async def wait_line(self, marker: str, bound_s: float) -> str | None:
        """The first console line holding ``marker`` within ``bound_s`` seconds (None if
        none came, or QEMU ended first). The guest's lines come prefixed by the kernel's
        time and the unit's name (journal+console)."""
        deadline = time.monotonic() + bound_s
        for line in self.lines:
            if marker in line:
                return line
        while time.monotonic() < deadline:
            for line in self.poll_console():
                if marker in line:
                    return line
            if not self.alive():
                self.poll_console()
                return None
            await asyncio.sleep(1.0)
        return None

    async def wait_exit(self, bound_s: float) -> int | None:
        """QEMU's exit status within ``bound_s`` seconds, else None (still running)."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            self.poll_console()
            if self.proc is not None and self.proc.poll() is not None:
                self.poll_console()
                return self.proc.returncode
            await asyncio.sleep(1.0)
        return None

    async def stop(self) -> None:
        """End QEMU: ``quit`` over QMP (a clean exit, disks flushed), then SIGKILL if it
        has not ended within 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(QmpError, OSError):
            qmp = await Qmp.connect(str(self.work / "qmp.sock"), timeout=5)
            try:
                with contextlib.suppress(QmpError):
                    await qmp.execute("quit")
            finally:
                qmp.close()
        if await self.wait_exit(10) is None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


async def run(ns: argparse.Namespace) -> int:
    t_start = time.monotonic()
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    kit = guestkit.load()
    base = await asyncio.to_thread(image.build_base, kit.package, REPO / "pyproject.toml")
    t_base = time.monotonic()
    log.info("base image %s (%s) ready after %.0f s", base.key, base.release, t_base - t_start)
    out = Path(ns.out) if ns.out else REPO / "build" / "nodevm" / time.strftime(
        "%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nodevm-", dir=ns.work_root))
    stream = out / "stream.txt"
    stream.unlink(missing_ok=True)
    guest = Guest(work, stream)
    facts: dict[str, str] = {}
    outcome: report.Outcome | None = None
    timing: dict[str, float] = {}
    try:
        pytest_args = guest_pytest_args(ns.pytest)
        payload = await asyncio.to_thread(stage_payload, work, pytest_args)
        await asyncio.to_thread(image.make_payload, payload, work / "payload.img")
        shutil.rmtree(payload)
        with open(work / "results.img", "wb") as f:
            f.truncate(512 << 20)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b",
                        str(base.disk), str(work / "root.qcow2")], check=True)
        accel_name, why = await choose_accel(work, ns.accel)
        log.info("accelerator: %s (%s)", accel_name, why)
        timing["prepare_s"] = time.monotonic() - t_base
        t_boot = time.monotonic()
        guest.start(qemu_argv(base, work, accel_name, ns.memory_mib, ns.vcpus))
        started = await guest.wait_line("nodevm: started", ns.boot_timeout_s)
        if started is None:
            log.error("the guest did not come up within %.0f s (console: %s)",
                      ns.boot_timeout_s, work / "console.log")
        else:
            timing["boot_s"] = time.monotonic() - t_boot
            remaining = ns.timeout_min * 60 - (time.monotonic() - t_start)
            rc = await guest.wait_exit(max(60.0, remaining))
            if rc is None:
                log.error("the guest did not finish within %d min: stopping it",
                          ns.timeout_min)
            timing["guest_s"] = time.monotonic() - t_boot
    finally:
        await guest.stop()
        guest.poll_console()
        if (work / "console.log").exists():
            shutil.copy2(work / "console.log", out / "console.log")
        results = out / "results"
        results.mkdir(exist_ok=True)
        with contextlib.suppress(tarfile.TarError, OSError), \
                tarfile.open(work / "results.img", "r:") as tf:
            tf.extractall(results, filter="data")
        if ns.keep:
            log.info("kept the run's disks in %s", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        facts = report.read_facts(results / "node.txt")
    with contextlib.suppress(OSError, ValueError):
        outcome = report.parse_junit(results / "junit.xml")
    if outcome is None and stream.is_file():
        # no JUnit XML (the run was cut short): what the guest streamed while it ran
        outcome = report.parse_stream(stream.read_text().splitlines())
    timing["total_s"] = time.monotonic() - t_start
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    why_not = report.verdict(facts, outcome)
    if outcome is not None:
        slow = sorted(outcome.cases, key=lambda c: -c.seconds)[:10]
        print("node-vm: slowest inside: " + ", ".join(
            f"{c.nodeid.rsplit('::', 1)[-1]} {c.seconds:.0f}s" for c in slow), file=sys.stderr)
        mem = [line for line in guest.lines if report.MEM_PREFIX in line]
        if mem:
            print("node-vm: guest memory (MiB) after the last test: "
                  + mem[-1].split(report.MEM_PREFIX, 1)[1].strip(), file=sys.stderr)
        for n in outcome.unfinished:
            print(f"node-vm: UNFINISHED {n}", file=sys.stderr)
        for c in outcome.cases:
            if c.outcome in ("failed", "error"):
                print(f"node-vm: FAILED {c.nodeid}: {c.message[:300]}", file=sys.stderr)
    print(f"node-vm: results in {out}; " + ", ".join(f"{k} {v:.0f}" for k, v in timing.items())
          + f"; load average {' '.join(load0)} -> {' '.join(load1)}", file=sys.stderr)
    for w in why_not:
        print(f"node-vm: not green: {w}", file=sys.stderr)
    print(report.summary_line(facts, outcome), flush=True)
    return 0 if not why_not else 1


def cannot_boot(memory_mib: int, vcpus: int) -> str | None:
    """Why this machine cannot run the node VM now (None: it can): root, the tools (QEMU,
    mmdebstrap, mkfs.ext4, qemu-img), the guest kit's kernel package (scripts/install.sh),
    the CPUs and the free memory the guest is given. ``.ci/run`` runs the node VM only where
    this is None, and says why not otherwise."""
    if os.geteuid() != 0:
        return "needs root (mmdebstrap, QEMU disks)"
    for tool in ("qemu-system-x86_64", "qemu-img", "mmdebstrap", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install.sh)"
    try:
        guestkit.load()
    except (guestkit.GuestKitError, OSError) as e:
        return f"no guest kernel kit ({e})"
    if (os.cpu_count() or 1) < vcpus:
        return f"{vcpus} vCPUs wanted, the machine has {os.cpu_count()}"
    avail_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text()
                     .splitlines() if line.startswith("MemAvailable:"))
    if avail_kib < (memory_mib + 1024) * 1024:
        return f"{memory_mib} MiB for the guest (+1 GiB) wanted, {avail_kib >> 10} MiB available"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/node-vm.sh", description=__doc__.split("\n")[0])
    ap.add_argument("--memory-mib", type=int, default=int(os.environ.get("NODEVM_MEMORY_MIB",
                                                                         4096)))
    ap.add_argument("--vcpus", type=int, default=2)
    ap.add_argument("--accel", choices=["auto", "kvm", "tcg"], default="auto")
    ap.add_argument("--timeout-min", type=float, default=float(
        os.environ.get("NODEVM_TIMEOUT_MIN", 70)), help="the whole run's bound")
    ap.add_argument("--boot-timeout-s", type=float, default=900.0,
                    help="bound for the guest to reach its test run")
    ap.add_argument("--out", default=None, help="results directory (default build/nodevm/TS)")
    ap.add_argument("--work-root", default=None, help="where the run's disks go (default /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the run's disks")
    ap.add_argument("--can-boot", action="store_true",
                    help="only say whether this machine can run the node VM (exit 0: it can)")
    ap.add_argument("pytest", nargs="*", help="pytest arguments instead of the selection")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="node-vm: %(message)s", stream=sys.stderr)
    why = cannot_boot(ns.memory_mib, ns.vcpus)
    if why is not None or ns.can_boot:
        print(f"node-vm: cannot run here: {why}" if why else "node-vm: can run here",
              file=sys.stderr)
        return 2 if why else 0
    loop = asyncio.new_event_loop()
    task = loop.create_task(run(ns))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return loop.run_until_complete(task)
    except asyncio.CancelledError:
        print("node-vm: interrupted; the guest was stopped", file=sys.stderr)
        return 130
    except image.ImageError as e:
        print(f"node-vm: {e}", file=sys.stderr)
        return 1
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
