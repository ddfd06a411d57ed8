"""The cluster's systemd units verify as installed (ExecStart in the venv prefix they
document, the environment file they name)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.edged.cluster.procs import ROOT

PREFIX = "/opt/edged"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("unit, program", [("edged-cluster.service", "edged"),
                                           ("edged-ray.service", "ray")])
def test_unit_verifies(tmp_path: Path, unit: str, program: str) -> None:
    fake = tmp_path / "opt-edged"
    (fake / "bin").mkdir(parents=True)
    exe = fake / "bin" / program
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    env = tmp_path / "cluster.env"
    env.write_text("EDGED_RAY_ADDRESS=127.0.0.2:6379\n")
    text = (ROOT / "systemd" / unit).read_text()
    assert f"ExecStart={PREFIX}/bin/{program} " in text
    assert "EnvironmentFile=/etc/edged/cluster.env" in text
    path = tmp_path / unit
    path.write_text(text.replace(f"ExecStart={PREFIX}/", f"ExecStart={fake}/")
                    .replace("EnvironmentFile=/etc/edged/cluster.env", f"EnvironmentFile={env}"))
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                       text=True)
    # units it names but this machine lacks (edged.service, edged-ray.service) are only
    # warned about; a bad directive or an ExecStart that cannot run fails
    assert r.returncode == 0, r.stderr
    exe.unlink()
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "not executable" in r.stderr, "verify cannot fail"
