"""The lazy server's start bound: 20 s, or ``LAYERFS_LAZY_START_WAIT_S`` (a slow machine's,
e.g. the emulated node VM's, where the server's interpreter alone may take longer)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(("env", "want"), [(None, 20.0), ("", 20.0), ("120", 120.0)])
def test_start_wait_from_the_environment(env: str | None, want: float) -> None:
    e = {k: v for k, v in os.environ.items() if k != "LAYERFS_LAZY_START_WAIT_S"}
    if env is not None:
        e["LAYERFS_LAZY_START_WAIT_S"] = env
    out = subprocess.run([sys.executable, "-c", "from layerfs.lazy import client; "
                          "print(client.START_WAIT_S)"], env=e, capture_output=True,
                         text=True, check=True).stdout
    assert float(out) == want
