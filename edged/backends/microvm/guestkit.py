"""The microVM guest's boot files: Debian's cloud kernel, the modules its init loads, and an
initramfs whose ``/init`` is sbx-init in guest mode.

Made at install time (``scripts/install.sh`` runs ``python -m edged.backends.microvm.guestkit
install``) into a kit directory (default :data:`DEFAULT_DIR`, or ``$EDGED_GUEST_DIR``)::

    <kit>/<release>/vmlinuz            the kernel (bzImage) from linux-image-<release>
    <kit>/<release>/modules/NAME.ko    only the modules the guest loads, and their dependencies
    <kit>/<release>/modules.early      load order of those loaded while the template boots
    <kit>/<release>/modules.late       load order of those loaded after a clone is restored
    <kit>/<release>/kit.json           package, version, release, and the two lists
    <kit>/current                      symlink to the release in use

The kernel package is fetched with ``apt-get download`` and unpacked, **not installed**:
installing it would put a kernel into the host's ``/boot`` and run the host's initramfs and
bootloader hooks. In Debian's cloud kernel (6.1), ``virtio_mmio``, ``virtio_blk``,
``virtio_console``, ``erofs`` and ``overlay`` are modules and the package ships no
``modules.dep``, so dependencies are read from each module's ``depends`` field with
``modinfo`` (kmod) and the init loads them itself with ``finit_module(2)`` in the order
written here (``../shared/reference/host.md``).

Why two lists: the *early* modules are loaded while the template boots (virtio_blk too: the
template's guest probes placeholder disks, and a clone's guest finds its own disks behind the
same devices, see :mod:`edged.backends.microvm.template`); a *late* module is loaded with the
virtio bus's autoprobe off and binds its devices only in a clone (none now).

The initramfs is written here in the kernel's ``newc`` cpio format (uncompressed: under TCG
decompression would cost boot time, and the template's RAM holding it is shared by every
clone), deterministically (sorted entries, mtime 0, uid/gid 0), so its sha256 names a template
(:func:`build_initramfs`). It holds sbx-init as ``/init``, the module files and lists, and a
``/dev/console`` node (the kernel opens it for init's stdio before ``/dev`` is mounted).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("edged.microvm")

DEFAULT_DIR = Path("/var/cache/edged-guest")
#: The meta package whose dependency names the current cloud kernel package.
META_PACKAGE = "linux-image-cloud-amd64"

#: Loaded by the init while the template boots: the virtio-mmio transport, the control
#: channel (virtio-serial), free page reporting (virtio-balloon), the filesystems of the
#: sandbox's rootfs. ext4 (the upper disk) is built into this kernel.
EARLY_MODULES = ("virtio_mmio", "virtio_console", "virtio_balloon", "virtio_blk", "erofs",
                 "overlay")
#: Loaded in the template with the virtio bus's autoprobe off, and bound to their devices
#: only in a clone (none now: see :mod:`.template` for why the disks need not wait).
LATE_MODULES: tuple[str, ...] = ()


class GuestKitError(RuntimeError):
    """The guest kit cannot be made or read (missing package, module, tool); the message
    names what and where."""


@dataclass(frozen=True)
class GuestKit:
    """A made kit: ``kernel`` (bzImage path), ``release`` (``uname -r`` of the guest),
    ``early``/``late``: module files in load order (dependencies first)."""

    root: Path
    release: str
    kernel: Path
    early: tuple[Path, ...]
    late: tuple[Path, ...]
    package: str = ""
    version: str = ""


def kit_dir() -> Path:
    """The kit directory: ``$EDGED_GUEST_DIR`` or :data:`DEFAULT_DIR`."""
    return Path(os.environ.get("EDGED_GUEST_DIR") or DEFAULT_DIR)


def _run(argv: Sequence[str], cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise GuestKitError(f"{argv[0]}: not installed (scripts/install.sh installs it)") from e
    if proc.returncode != 0:
        raise GuestKitError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def module_depends(ko: Path) -> list[str]:
    """Names of the modules ``ko`` depends on (its ``depends`` modinfo field), e.g.
    ``virtio_blk.ko`` -> ``["virtio", "virtio_ring"]``. Raises GuestKitError if modinfo
    fails."""
    out = _run(["modinfo", "-F", "depends", str(ko)]).strip()
    return [d for d in out.split(",") if d]


def _module_index(moddir: Path) -> dict[str, Path]:
    """name -> .ko path for every module under ``moddir`` (names use ``_``, as the kernel
    does: ``virtio-rng`` and ``virtio_rng`` are one module)."""
    index: dict[str, Path] = {}
    for ko in sorted(moddir.rglob("*.ko")):
        index[ko.name[:-3].replace("-", "_")] = ko
    return index


def module_closure(
    moddir: Path, names: Iterable[str], loaded: Iterable[str] = ()
) -> list[Path]:
    """The .ko files to load for ``names``, dependencies first (a depth-first topological
    order), leaving out those in ``loaded`` and those built into the kernel
    (``moddir/../modules.builtin`` when ``moddir`` is a release's ``kernel/`` tree).
    Raises GuestKitError naming a module that is neither present nor built in, or a
    dependency cycle."""
    index = _module_index(moddir)
    builtin: set[str] = set()
    for candidate in (moddir / "modules.builtin", moddir.parent / "modules.builtin"):
        if candidate.is_file():
            builtin = {
                Path(line.strip()).name[:-3].replace("-", "_")
                for line in candidate.read_text().splitlines()
                if line.strip().endswith(".ko")
            }
            break
    done = {n.replace("-", "_") for n in loaded}
    order: list[Path] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in done or name in builtin:
            return
        if name in visiting:
            raise GuestKitError(f"module dependency cycle through {name}")
        ko = index.get(name)
        if ko is None:
            raise GuestKitError(f"module {name}: not in {moddir} and not built in")
        visiting.add(name)
        for dep in module_depends(ko):
            visit(dep)
        visiting.discard(name)
        done.add(name)
        order.append(ko)

    for n in names:
        visit(n)
    return order


def _current_package() -> str:
    out = _run(["apt-cache", "depends", META_PACKAGE])
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split()[1]
    raise GuestKitError(f"apt-cache depends {META_PACKAGE}: no linux-image dependency")


def install(root: Path | None = None, package: str | None = None) -> GuestKit:
    """Fetch the cloud kernel package (``apt-get download``; ``package`` defaults to what
    :data:`META_PACKAGE` depends on), unpack it, keep the kernel and the modules of
    :data:`EARLY_MODULES` + :data:`LATE_MODULES` with their dependencies, write the lists and
    point ``current`` at it. Idempotent: a release already made for these module lists is
    only re-pointed.
    Raises GuestKitError (apt, dpkg-deb or modinfo failing, a module missing)."""
    root = root or kit_dir()
    pkg = package or _current_package()
    release = pkg.removeprefix("linux-image-").removesuffix("-unsigned")
    dest = root / release
    if _wanted(dest) != _WANTED:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp_s:
            tmp = Path(tmp_s)
            os.chmod(tmp, 0o755)  # apt's download sandbox user (_apt) writes here
            _run(["apt-get", "download", "-q", pkg], cwd=tmp)
            debs = sorted(tmp.glob("*.deb"))
            if not debs:
                raise GuestKitError(f"apt-get download {pkg}: no .deb written")
            version = _run(["dpkg-deb", "-f", str(debs[0]), "Version"]).strip()
            _run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "x")])
            staged = tmp / "kit"
            _stage(tmp / "x", release, staged, pkg, version)
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(staged, dest)
    cur = root / "current"
    tmp_link = root / ".current.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp_link.unlink()
    tmp_link.symlink_to(release)
    os.replace(tmp_link, cur)
    return load(root)


def _stage(unpacked: Path, release: str, out: Path, pkg: str, version: str) -> None:
    boot = unpacked / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    if not kernels:
        raise GuestKitError(f"{pkg}: no /boot/vmlinuz-* in the package")
    rel_dir = unpacked / "lib" / "modules"
    rels = sorted(p for p in rel_dir.iterdir() if p.is_dir())
    if not rels:
        raise GuestKitError(f"{pkg}: no /lib/modules/<release> in the package")
    moddir = rels[0]
    early = module_closure(moddir / "kernel", EARLY_MODULES)
    late = module_closure(moddir / "kernel", LATE_MODULES, loaded=[_name(p) for p in early])
    (out / "modules").mkdir(parents=True)
    shutil.copy2(kernels[0], out / "vmlinuz")
    for cfg in boot.glob("config-*"):
        shutil.copy2(cfg, out / "config")
    for ko in (*early, *late):
        shutil.copy2(ko, out / "modules" / f"{_name(ko)}.ko")
    (out / "modules.early").write_text("".join(f"{_name(p)}\n" for p in early))
    (out / "modules.late").write_text("".join(f"{_name(p)}\n" for p in late))
    meta = {
        "wanted": _WANTED,
        "package": pkg,
        "version": version,
        "release": moddir.name,
        "early": [_name(p) for p in early],
        "late": [_name(p) for p in late],
    }
    (out / "kit.json").write_text(json.dumps(meta, indent=1) + "\n")
    log.info("guest kit %s: early %s, late %s", release, meta["early"], meta["late"])


#: What a kit was made for: a kit made for other module lists is made again.
_WANTED = {"early": list(EARLY_MODULES), "late": list(LATE_MODULES)}


def _wanted(dest: Path) -> object:
    try:
        return json.loads((dest / "kit.json").read_text()).get("wanted")
    except (OSError, ValueError):
        return None


def _name(ko: Path) -> str:
    return ko.name[:-3].replace("-", "_")


def load(root: Path | None = None) -> GuestKit:
    """The kit ``root/current`` points at. Raises GuestKitError if none was made (run
    ``scripts/install.sh``) or a listed module file is missing."""
    root = root or kit_dir()
    cur = root / "current"
    meta_path = cur / "kit.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise GuestKitError(
            f"no guest kit at {cur} ({e}); make it with "
            "`python -m edged.backends.microvm.guestkit install` (scripts/install.sh does)"
        ) from e
    real = cur.resolve()
    mods = real / "modules"
    early = tuple(mods / f"{n}.ko" for n in meta["early"])
    late = tuple(mods / f"{n}.ko" for n in meta["late"])
    for ko in (*early, *late):
        if not ko.is_file():
            raise GuestKitError(f"guest kit {real}: module file {ko} missing")
    kernel = real / "vmlinuz"
    if not kernel.is_file():
        raise GuestKitError(f"guest kit {real}: no vmlinuz")
    return GuestKit(real, meta["release"], kernel, early, late, meta["package"], meta["version"])


# ---- initramfs (newc cpio) ----------------------------------------------------------

_S_IFDIR, _S_IFREG, _S_IFCHR = 0o040000, 0o100000, 0o020000


def _newc(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0),
          ino: int = 0) -> bytes:
    """One newc entry: a 110-byte ASCII header (``070701`` and 13 8-digit hex fields: ino,
    mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor, rdevminor,
    namesize, check), the NUL-terminated name and the data, each padded to 4 bytes
    (Linux ``Documentation/driver-api/early-userspace/buffer-format.rst``)."""
    nb = name.encode() + b"\0"
    nlink = 2 if mode & _S_IFDIR else 1
    fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(nb), 0)
    hdr = b"070701" + b"".join(b"%08X" % f for f in fields)
    out = hdr + nb
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
    return out


def initramfs_bytes(kit: GuestKit, sbx_init: Path) -> bytes:
    """The initramfs image for ``kit`` with ``sbx_init`` (a static binary) as ``/init``.
    Deterministic: equal inputs give equal bytes."""
    entries: list[tuple[str, int, bytes, tuple[int, int]]] = []
    for d in ("dev", "etc", "etc/sbx", "lib", "lib/modules", "proc", "run", "sys"):
        entries.append((d, _S_IFDIR | 0o755, b"", (0, 0)))
    entries.append(("dev/console", _S_IFCHR | 0o600, b"", (5, 1)))
    entries.append(("init", _S_IFREG | 0o755, sbx_init.read_bytes(), (0, 0)))
    for ko in (*kit.early, *kit.late):
        entries.append((f"lib/modules/{ko.name}", _S_IFREG | 0o644, ko.read_bytes(), (0, 0)))
    lists = {
        "etc/sbx/modules.early": "".join(f"/lib/modules/{p.name}\n" for p in kit.early),
        "etc/sbx/modules.late": "".join(f"/lib/modules/{p.name}\n" for p in kit.late),
    }
    for name, text in lists.items():
        entries.append((name, _S_IFREG | 0o644, text.encode(), (0, 0)))
    entries.sort(key=lambda e: e[0])
    out = bytearray()
    for ino, (name, mode, data, rdev) in enumerate(entries, start=1):
        out += _newc(name, mode, data, rdev, ino)
    out += _newc("TRAILER!!!", 0)
    return bytes(out)


def build_initramfs(kit: GuestKit, sbx_init: Path, out_dir: Path) -> Path:
    """Write the initramfs to ``out_dir/initramfs-<sha256 prefix>.cpio`` (kept if it already
    exists) and return its path; the digest in the name is what templates are keyed by."""
    data = initramfs_bytes(kit, sbx_init)
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = out_dir / f"initramfs-{digest}.cpio"
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def host_tsc_khz() -> int:
    """The host's TSC frequency in kHz (``/proc/cpuinfo`` "cpu MHz" of the first CPU), for
    the guest's ``tsc_early_khz``: without it ~5% of TCG boots here hang at TSC calibration
    (``../shared/reference/host.md``). 0 if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return 0


def cmdline(tsc_khz: int | None = None) -> str:
    """The guest kernel's command line: the console on the ISA serial port, ``quiet`` (a
    panic's message still shows: it is KERN_EMERG), ``panic=-1`` (reboot at once, which ends
    the VMM under ``-no-reboot``) by a triple fault (``reboot=t``: the default tries ACPI,
    then the keyboard controller microvm lacks, waiting on it for seconds: under load a
    crashed guest's VMM was seen still running a minute later), the TSC frequency, sbx-init
    as the initramfs's init in guest mode (``-- -g``). Not ``acpi=off`` (microvm lists its
    virtio-mmio devices in ACPI) nor ``pit=off`` (host.md)."""
    khz = host_tsc_khz() if tsc_khz is None else tsc_khz
    parts = ["console=ttyS0", "quiet", "panic=-1", "reboot=t", "rdinit=/init",
             "random.trust_cpu=on", "8250.nr_uarts=1", "rcupdate.rcu_expedited=1"]
    if khz:
        parts.append(f"tsc_early_khz={khz}")
    return " ".join(parts) + " -- -g"


def main(argv: Sequence[str] | None = None) -> int:
    """``install [--dir DIR] [--package linux-image-...]`` (fetch and unpack the kernel,
    resolve the modules) and ``show`` (print the current kit as JSON)."""
    ap = argparse.ArgumentParser(prog="python -m edged.backends.microvm.guestkit")
    ap.add_argument("action", choices=["install", "show"])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--package", default=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        kit = install(ns.dir, ns.package) if ns.action == "install" else load(ns.dir)
    except GuestKitError as e:
        print(f"guestkit: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"root": str(kit.root), "release": kit.release, "package": kit.package,
                      "version": kit.version, "kernel": str(kit.kernel),
                      "early": [p.name for p in kit.early], "late": [p.name for p in kit.late]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
