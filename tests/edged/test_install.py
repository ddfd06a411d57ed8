"""edged as installed software, not as a checkout: a wheel built from a clean copy of the
source tree (no prebuilt ``_native``, ``edged/_bin`` or ``build/``), installed into a fresh
virtualenv outside the checkout, runs a confined sandbox (create, exec with output, delete)
with the daemon started by the systemd unit's ``ExecStart``.

Before the fix, such an install failed every create: ``task profile
.../site-packages/profiles/tasks/default.toml: No such file or directory`` (the policy data
was looked up next to the checkout and was not in the wheel).

The fast variant builds the wheel without build isolation and installs it with ``--no-deps``;
the fresh venv gets edged's dependencies through a ``.pth`` naming the test interpreter's
site-packages (no registry needed; edged itself is imported from the new venv, which the test
checks). The ``slow``/``network`` variant is the real thing: ``pip install`` of the clean tree
and of an sdist built from it, build dependencies and dependencies from the package index.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.edged.backends.container.conftest import busybox_tree  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "edged.service"
#: Where the unit expects the venv (its ExecStart is ``/opt/edged/bin/edged serve``).
UNIT_PREFIX = "/opt/edged"


def _exec_start() -> list[str]:
    """The unit's ExecStart, split (it has no quoting or specifiers)."""
    (line,) = [x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=").split()


def _clean_tree(dest: Path) -> Path:
    """A copy of the checkout as a clean clone has it, with uncommitted edits: the files git
    tracks or would track (not ignored), nothing built."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: cannot tell source files from built ones")
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, check=True).stdout
    for name in names.decode().split("\0"):
        if name and (ROOT / name).is_file():  # a tracked file deleted in the work tree: skip
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name, follow_symlinks=False)
    for built in ("layerfs/_native.abi3.so", "edged/_bin", "edged/_profiles", "build"):
        assert not (dest / built).exists(), f"{built} is a built file, not a source"
    return dest


def _venv(path: Path, *, with_pip: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]),
                    str(path)], check=True)
    return path


def _site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def _installed_env(venv: Path) -> dict[str, str]:
    """The environment a node's service has: the venv's bin first, nothing of the checkout's
    (no .venv on PATH, no EDGED_PROFILES, no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("EDGED_PROFILES", "PYTHONPATH", "VIRTUAL_ENV", "EDGED_SOCKET")}
    env["PATH"] = ":".join([str(venv / "bin"), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    return env


def _cgroup_parents(runtime_dir: Path) -> list[Path]:
    import hashlib

    h = hashlib.sha256(str(runtime_dir.resolve()).encode()).hexdigest()[:10]
    out = []
    for dirpath, dirnames, _ in os.walk("/sys/fs/cgroup"):
        if f"edged-{h}" in dirnames:
            out.append(Path(dirpath) / f"edged-{h}")
        if dirpath.count("/") > 6:
            dirnames.clear()
    return out


def _check_installed(venv: Path, work: Path, rootfs: Path) -> None:
    """From ``venv`` alone: the packages and policy data are the venv's; a layer built with
    its ``layerfs``; the daemon started as the unit starts it; one confined sandbox created,
    run (stdout, stderr, exit status), deleted; the daemon stopped by SIGTERM, leaving no
    sandbox, mount or cgroup."""
    env = _installed_env(venv)
    py = str(venv / "bin" / "python")
    where = json.loads(subprocess.run(
        [py, "-c", "import json, edged, layerfs._native as n, edged.security as s; "
                   "print(json.dumps([edged.__file__, n.__file__, str(s.PROFILES_DIR)]))"],
        cwd=work, env=env, capture_output=True, text=True, check=True).stdout)
    site = str(_site_packages(venv))
    assert all(p.startswith(site + "/") for p in where), (where, site)
    assert Path(where[2]) == Path(site) / "edged" / "_profiles"
    for f in ("edged/_bin/sbx-init", "edged/_bin/edged-spawner", "edged/_bin/fncall-spawn",
              "edged/api/openapi.json",
              "edged/_profiles/tasks/default.toml", "edged/_profiles/seccomp/default.json",
              "edged/_profiles/apparmor/sandbox.profile.in", "edged/_systemd/edged.service",
              "edged/_systemd/edged-cluster.service", "edged/_systemd/edged-ray.service"):
        assert (Path(site) / f).is_file(), f"{f} is not in the installed package"
    assert (Path(site) / "edged/_systemd/edged.service").read_text() == UNIT.read_text()

    store = work / "store"
    built = subprocess.run([str(venv / "bin" / "layerfs"), "build", str(rootfs), "--kind",
                            "base", "--store", str(store), "--json"], cwd=work, env=env,
                           capture_output=True, text=True, check=True)
    digest = json.loads(built.stdout)["digest"]

    argv = _exec_start()
    assert argv[0].startswith(UNIT_PREFIX + "/"), argv
    argv[0] = str(venv) + argv[0].removeprefix(UNIT_PREFIX)
    sockdir = Path(tempfile.mkdtemp(prefix="edged-wheel-", dir="/tmp"))
    runtime = Path(tempfile.mkdtemp(prefix="edged-wheel-", dir="/run"))
    sock = str(sockdir / "edged.sock")
    daemon = subprocess.Popen(
        [*argv, "--socket", sock, "--state-dir", str(work / "state"), "--runtime-dir",
         str(runtime), "--store-dir", str(store), "--log-level", "warning"],
        cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cli = [str(venv / "bin" / "edged")]
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([*cli, "node", "--socket", sock], env=env, cwd=work,
                             capture_output=True).returncode != 0:
            assert daemon.poll() is None, "daemon exited before it answered"
            assert time.monotonic() < deadline, "daemon did not answer in 60 s"
            time.sleep(0.2)
        r = subprocess.run(
            [*cli, "run", "--socket", sock, "--layer", digest, "--id", "wheel-1", "--rm",
             "--env", "PATH=/bin", "--",
             "sh", "-c", "echo out; grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status; "
                         "echo err >&2; exit 3"],
            env=env, cwd=work, capture_output=True, text=True, timeout=60)
        assert r.returncode == 3, (r.stdout, r.stderr)
        assert r.stderr == "err\n"
        lines = r.stdout.splitlines()
        assert lines[0] == "out"
        status = dict(re.split(r":\s+", x, maxsplit=1) for x in lines[1:])
        assert status == {"Seccomp": "2", "NoNewPrivs": "1"}, "the sandbox is not confined"
        ps = subprocess.run([*cli, "ps", "--socket", sock, "--json"], env=env, cwd=work,
                            capture_output=True, text=True, check=True)
        assert json.loads(ps.stdout) == [], "the sandbox was not deleted"
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            _, err = daemon.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            daemon.kill()
            _, err = daemon.communicate()
        code = daemon.returncode
        mounts = Path("/proc/mounts").read_text()
        parents = _cgroup_parents(runtime)
        left = [str(p) for cg in parents for p in cg.iterdir() if p.is_dir()]
        for cg in parents:
            for p in sorted(cg.iterdir(), reverse=True):
                if p.is_dir():
                    p.rmdir()
            cg.rmdir()
        if str(runtime) not in mounts:
            shutil.rmtree(runtime)
        shutil.rmtree(sockdir, ignore_errors=True)
    assert code == 0, f"daemon exited {code}: {err}"
    assert str(runtime) not in mounts, "mounts left behind"
    assert not left, f"sandbox cgroups left behind: {left}"


@pytest.fixture
def workdir() -> Iterator[Path]:
    # outside the checkout and outside pytest's tmp (which may be under it)
    d = Path(tempfile.mkdtemp(prefix="edged-wheel-test-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _need_build_tools() -> None:
    for mod in ("setuptools", "wheel", "cffi"):
        try:
            __import__(mod)
        except ImportError:
            pytest.skip(f"needs {mod} in the test interpreter (scripts/install.sh installs it)")


@pytest.mark.root
@pytest.mark.mount
def test_wheel_from_clean_tree_runs_confined_sandbox(workdir: Path,
                                                     busybox_tree: Path) -> None:  # noqa: F811
    _need_build_tools()
    src = _clean_tree(workdir / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(workdir / "dist"), str(src)],
                   check=True, stdout=subprocess.DEVNULL)
    (wheel,) = (workdir / "dist").glob("edged-*.whl")
    venv = _venv(workdir / "venv", with_pip=False)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # edged's dependencies (aiohttp, cffi, ...) from the test interpreter's site-packages,
    # after the venv's own (which holds edged): no package index needed
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (_site_packages(venv) / "zz-test-deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    shutil.rmtree(src)  # nothing may come from the source tree any more
    _check_installed(venv, workdir, busybox_tree)


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.network
@pytest.mark.slow
@pytest.mark.parametrize("form", ["tree", "sdist"])
def test_pip_install_from_index_runs_confined_sandbox(form: str, workdir: Path,
                                                      busybox_tree: Path) -> None:  # noqa: F811
    """``pip install .`` of a clean tree, and of an sdist made from it (MANIFEST.in must carry
    the C sources, the profiles and the unit), into a fresh venv with pip: build isolation,
    every dependency from the package index."""
    _need_build_tools()
    src = _clean_tree(workdir / "src")
    target = str(src)
    if form == "sdist":
        out = workdir / "sdist"
        subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta;"
                        f" build_meta.build_sdist({str(out)!r})"], cwd=src, check=True,
                       stdout=subprocess.DEVNULL)
        (sdist,) = out.glob("edged-*.tar.gz")
        target = str(sdist)
    venv = _venv(workdir / "venv", with_pip=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", target], check=True,
                   cwd=workdir, env=_installed_env(venv))
    shutil.rmtree(src)
    _check_installed(venv, workdir, busybox_tree)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_verifies_against_a_venv_install(workdir: Path) -> None:
    """``systemd-analyze verify`` of the unit as installed (its ExecStart in the venv prefix
    it documents): a wrong ExecStart or a bad directive fails it."""
    fake = workdir / "opt-edged"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "edged").write_text("#!/bin/sh\n")
    (fake / "bin" / "edged").chmod(0o755)
    unit = workdir / "edged.service"
    unit.write_text(UNIT.read_text().replace(f"ExecStart={UNIT_PREFIX}/",
                                             f"ExecStart={fake}/"))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    (fake / "bin" / "edged").unlink()
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "not executable" in r.stderr, "verify cannot fail"
