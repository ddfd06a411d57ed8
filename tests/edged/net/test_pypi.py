"""A task's setup phase against the real PyPI (``network``: needs the registry): allow
``pypi``, ``pip download`` a small package inside the sandbox, switch to ``none``, and the
same download fails at once.

The sandbox is the Debian rootfs (``scripts/rootfs.sh``) with pip (the test venv's own, pure
Python) and the host's CA bundle on top (this machine's egress re-signs TLS with its own CA).
Traffic goes sandbox -> SNI proxy -> PyPI: the proxy connects from the host, so the host's
uplink need not forward."""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from edged.client import Sandbox
from tests.edged.test_e2e_container import layer_store, real_node  # noqa: F401

pytestmark = [pytest.mark.root, pytest.mark.mount, pytest.mark.network]

ROOTFS_TAR = Path("/var/cache/edged-test/debian-rootfs.tar")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
       "PIP_NO_CACHE_DIR": "1", "PIP_CERT": str(CA_BUNDLE)}
# pip with its download command imported before the clock starts; prints download_s=SECONDS
TIMED = ("python3 -c \"import sys, time; from pip._internal.cli.main import main; "
         "from pip._internal.commands import create_command; create_command('download'); "
         "t = time.monotonic(); rc = main(sys.argv[1:]); "
         "print('download_s=%.3f' % (time.monotonic() - t), file=sys.stderr); sys.exit(rc)\" ")
PIP = ("python3 -m pip download --no-deps --only-binary=:all: --timeout 15 --retries 1 "
       "--index-url https://pypi.org/simple -d {dest} six==1.16.0")


@pytest.fixture(scope="module")
def debian_with_pip(layer_store, tmp_path_factory) -> list[str]:  # noqa: F811
    from layerfs.build import build_layer
    from layerfs.store import Store

    if not ROOTFS_TAR.exists():
        pytest.skip(f"{ROOTFS_TAR} missing: run scripts/rootfs.sh")
    store = Store(layer_store[0])
    base = build_layer(str(ROOTFS_TAR), kind="base", store=store).digest
    top = tmp_path_factory.mktemp("pip-layer")
    site = top / "usr/lib/python3/dist-packages"
    site.mkdir(parents=True)
    # (not imported, nor looked up with importlib: setuptools' distutils shim turns itself
    # off for the whole process when pip is, and later tests building sdists then fail)
    pip_pkg = Path(sysconfig.get_paths()["purelib"]) / "pip"
    assert (pip_pkg / "__main__.py").is_file(), pip_pkg
    shutil.copytree(pip_pkg, site / "pip", ignore=shutil.ignore_patterns("__pycache__"))
    (top / "etc/ssl/certs").mkdir(parents=True)
    shutil.copy(CA_BUNDLE, top / "etc/ssl/certs/ca-certificates.crt")
    return [base, build_layer(str(top), kind="workspace", store=store).digest]


def test_setup_phase_downloads_then_none_fails_fast(real_node, debian_with_pip,  # noqa: F811
                                                    tmp_path) -> None:
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:4]
    node = real_node(network_pool=f"10.215.{int(tag[:2], 16)}.0/24", network_pool6="",
                     network_prefix="p" + tag)
    feats = node.server.manager.net.features
    assert feats["enabled"] and feats["sni_check"], feats
    with Sandbox.create(layers=debian_with_pip, env=ENV, socket=node.socket,
                        network={"pypi": True, "npm": False}) as sbx:
        assert sbx.network()["policy"] == {"allow": ["pypi"]}
        r = sbx.exec(PIP.format(dest="/tmp/dl"), timeout=600)  # pip: minutes at load 100
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "six-1.16.0-py2.py3-none-any.whl" in sbx.exec("ls /tmp/dl").stdout
        assert sbx.set_network("none")["generation"] == 1
        t0 = time.monotonic()
        r = sbx.exec(TIMED + PIP.format(dest="/tmp/dl2").replace("--retries 1", "--retries 0")
                     .removeprefix("python3 -m pip "), timeout=600)
        wall = time.monotonic() - t0
        assert r.exit_code != 0 and "six-1.16.0" not in sbx.exec("ls /tmp/dl2; echo").stdout
        m = re.search(r"download_s=([0-9.]+)", r.stderr)
        assert m, (r.exit_code, r.reason, r.stdout[-500:], r.stderr[-500:])
        took = float(m.group(1))  # pip's start-up excluded: 10-50 s under a loaded machine
        assert took < 10, f"the refused download took {took:.1f} s: {r.stderr[-500:]}"
        assert sbx.events(kind="dns_denied"), "pypi.org is no longer resolved"
    print(f"refused download failed in {took:.2f} s ({wall:.2f} s with pip's start-up)",
          file=sys.stderr)
