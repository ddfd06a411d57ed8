"""The node VM's disks: the cached base image (Debian 12 with systemd, the cloud kernel, the
packages a node has, a virtualenv holding edged's dependencies) and each run's payload disk
(the wheel built from this checkout, the tests, the guest's run script).

The base image is made once per set of inputs with ``mmdebstrap`` into a directory, its
kernel and initramfs copied out (QEMU boots them directly), and the directory written into an
ext4 image file with ``mkfs.ext4 -d`` (no loop device, no mount). It is named by a digest of
what went into it (:func:`base_key`), kept under the cache directory (default
``/var/cache/edged-nodevm``, ``$NODEVM_CACHE``), and never written afterwards: a run boots a
qcow2 overlay of it. The kernel is the one the microVM guests use: the package the guest kit
was made from (``edged.backends.microvm.guestkit``, unpacked at install by
``scripts/install.sh``), installed here the ordinary way, so that its modules and an
initramfs (initramfs-tools) come with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("nodevm")

HERE = Path(__file__).resolve().parent
GUEST = HERE / "guest"
DEFAULT_CACHE = Path("/var/cache/edged-nodevm")
SUITE = "bookworm"

#: The base image's Debian packages beyond minbase, each with why a node (or the tests run
#: on it) needs it. The kernel package is added by :func:`build_base`.
APT_PACKAGES = (
    "systemd", "systemd-sysv", "udev", "dbus",  # the init of production nodes: cgroup v2
    "initramfs-tools",        # the kernel's initramfs (virtio_pci and virtio_blk are modules)
    "kmod",                   # modprobe: erofs, overlay, fuse, loop, zram are modules in 6.1
    "apparmor",               # apparmor_parser: edged loads each sandbox's profile with it
    "python3", "python3-venv",  # edged's virtualenv (/opt/edged)
    "fuse3",                  # libfuse3 (the lazy layer server) and fusermount3
    "libseccomp2",            # edged._native links libseccomp
    "libbpf1",                # cgroup BPF programs (loaded through cffi)
    "util-linux", "mount", "e2fsprogs", "procps", "iproute2",  # losetup, mount, ip
    "nftables",               # NAT of networked sandboxes (edged/net)
    "busybox-static",         # the tests' busybox rootfs
    "gcc", "libc6-dev",       # the red-team suite builds its static attack tool
    "erofs-utils",            # fsck.erofs: the tests' cross-check of every image
    "xfsprogs", "xfslibs-dev",  # the XFS scratch and extent tests
    "attr", "zstd", "tar", "gzip",  # tests: xattrs, compressed tars
)

#: Test tools left out of the guest: linters run on the host, and the FnCall client is for
#: tests not selected here.
_NOT_IN_GUEST = {"ruff", "mypy", "sandbox-fusion"}


class ImageError(RuntimeError):
    """A disk could not be made; the message names the step and its output."""


@dataclass(frozen=True)
class BaseImage:
    """A made base image: ``disk`` (raw ext4), ``kernel`` and ``initrd`` (from its /boot),
    ``release`` (the kernel's ``uname -r``), ``key`` (the digest of its inputs)."""

    root: Path
    disk: Path
    kernel: Path
    initrd: Path
    release: str
    key: str


def cache_dir() -> Path:
    """``$NODEVM_CACHE`` or :data:`DEFAULT_CACHE`."""
    return Path(os.environ.get("NODEVM_CACHE") or DEFAULT_CACHE)


def requirements(pyproject: Path) -> list[str]:
    """edged's dependencies and its ``test`` extra, less :data:`_NOT_IN_GUEST`, as
    requirement strings from ``pyproject`` (a pyproject.toml)."""
    doc = tomllib.loads(pyproject.read_text())
    proj = doc["project"]
    reqs = list(proj.get("dependencies", []))
    reqs += proj.get("optional-dependencies", {}).get("test", [])
    out = []
    for r in reqs:
        name = r.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        if name.strip().lower() not in _NOT_IN_GUEST:
            out.append(r)
    return out


def base_key(kernel_package: str, reqs: Sequence[str]) -> str:
    """The digest naming a base image: the packages, the kernel package, the requirements
    and the guest files that go into the image (this module's inputs, not its code)."""
    h = hashlib.sha256()
    h.update(json.dumps([SUITE, sorted(APT_PACKAGES), kernel_package, sorted(reqs)]).encode())
    for name in ("setup.sh", "nodevm-boot", "nodevm.service"):
        h.update(name.encode() + b"\0" + (GUEST / name).read_bytes())
    return h.hexdigest()[:16]


def _run(argv: Sequence[str], what: str, timeout: float) -> None:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as e:
        raise ImageError(f"{what}: no end within {timeout:.0f} s") from e
    except FileNotFoundError as e:
        raise ImageError(f"{what}: {argv[0]} is not installed (scripts/install.sh)") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise ImageError(f"{what}: exit {proc.returncode}:\n{tail}")
    log.info("%s: %.1f s", what, time.monotonic() - t0)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (made if missing), so that two runs build one image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_base(root: Path) -> BaseImage | None:
    """The base image made in ``root``, or None if it is not (completely) there."""
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    img = BaseImage(root, root / "disk.img", root / "vmlinuz", root / "initrd.img",
                    meta["release"], meta["key"])
    if not all(p.is_file() for p in (img.disk, img.kernel, img.initrd)):
        return None
    return img


def build_base(kernel_package: str, pyproject: Path, cache: Path | None = None,
               disk_gib: int = 16) -> BaseImage:
    """The base image for these inputs: the cached one, or made now (mmdebstrap, a few
    minutes). Older base images in the cache are removed once the new one is made.
    Raises ImageError naming the step that failed."""
    cache = cache or cache_dir()
    reqs = requirements(pyproject)
    key = base_key(kernel_package, reqs)
    root = cache / f"base-{key}"
    with _locked(cache / ".lock"):
        made = load_base(root)
        if made is not None:
            return made
        log.info("node VM: making base image %s (mmdebstrap %s, %s)", key, SUITE,
                 kernel_package)
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp_s:
            tmp = Path(tmp_s)
            tree = tmp / "tree"
            wheels = tmp / "wheels"
            wheels.mkdir()
            (wheels / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
            # On the host, whose pip is set up for the package index (certificates,
            # mirrors); the chroot installs from these files alone.
            _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                  "-d", str(wheels), "-r", str(wheels / "requirements.txt")],
                 "pip download (the guest's requirements)", timeout=1800)
            # Before the kernel package is installed: its initramfs holds only what boots a
            # virtio disk (initramfs-tools' "most" would take minutes to compress here).
            early = (
                'mkdir -p "$1/etc/initramfs-tools/conf.d" '
                '"$1/usr/share/initramfs-tools/modules.d" && '
                'echo MODULES=list > "$1/etc/initramfs-tools/conf.d/nodevm" && '
                'printf "virtio_pci\\nvirtio_blk\\n" '
                '> "$1/usr/share/initramfs-tools/modules.d/nodevm"'
            )
            argv = [
                "mmdebstrap", "--quiet", "--mode=root", "--variant=minbase",
                f"--include={','.join((*APT_PACKAGES, kernel_package))}",
                f"--essential-hook={early}",
                f"--customize-hook=upload {GUEST / 'nodevm-boot'} /usr/local/sbin/nodevm-boot",
                '--customize-hook=chmod 0755 "$1/usr/local/sbin/nodevm-boot"',
                f"--customize-hook=upload {GUEST / 'nodevm.service'} "
                "/etc/systemd/system/nodevm.service",
                '--customize-hook=mkdir -p "$1/tmp/nodevm-wheels"',
                f"--customize-hook=sync-in {wheels} /tmp/nodevm-wheels",
                f"--customize-hook=upload {GUEST / 'setup.sh'} /tmp/nodevm-setup.sh",
                '--customize-hook=chroot "$1" /bin/sh /tmp/nodevm-setup.sh',
                '--customize-hook=rm -f "$1/tmp/nodevm-setup.sh"',
                SUITE, str(tree),
            ]
            _run(argv, "mmdebstrap", timeout=3600)
            boot = tree / "boot"
            kernels = sorted(boot.glob("vmlinuz-*"))
            initrds = sorted(boot.glob("initrd.img-*"))
            if not kernels or not initrds:
                raise ImageError(f"base image: no kernel/initrd in {boot}: "
                                 f"{sorted(p.name for p in boot.iterdir())}")
            release = kernels[-1].name.removeprefix("vmlinuz-")
            stage = tmp / "stage"
            stage.mkdir()
            shutil.copy2(kernels[-1], stage / "vmlinuz")
            shutil.copy2(initrds[-1], stage / "initrd.img")
            _run(["mkfs.ext4", "-F", "-q", "-L", "nodevm-root", "-E", "root_owner=0:0",
                  "-d", str(tree), str(stage / "disk.img"), f"{disk_gib}G"],
                 "mkfs.ext4 -d (base image)", timeout=1800)
            (stage / "meta.json").write_text(json.dumps(
                {"key": key, "release": release, "kernel_package": kernel_package,
                 "packages": list(APT_PACKAGES), "requirements": reqs,
                 "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
            os.replace(stage, root)
        for old in cache.glob("base-*"):
            if old != root:
                shutil.rmtree(old, ignore_errors=True)
    made = load_base(root)
    if made is None:
        raise ImageError(f"base image {root}: incomplete after build")
    return made


def make_payload(src: Path, out: Path) -> None:
    """Write directory ``src`` into a new ext4 image ``out`` (label ``nodevm-payload``),
    sized for its contents. Raises ImageError."""
    total = 0
    for dirpath, _dirs, files in os.walk(src):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    size_mib = int(total * 1.25 / (1 << 20)) + 64
    _run(["mkfs.ext4", "-F", "-q", "-L", "nodevm-payload", "-E", "root_owner=0:0",
          "-d", str(src), str(out), f"{size_mib}M"], "mkfs.ext4 -d (payload)", timeout=600)
