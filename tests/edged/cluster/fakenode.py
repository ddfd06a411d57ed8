"""A daemon process over the test doubles (``python -m tests.edged.cluster.fakenode``): the
real edged Server (API, records, admission with its ``max_sandboxes``) whose backend makes a
directory per sandbox and runs execs as host subprocesses (tests/edged/fakes.py: NOT a
sandbox). Cheap enough for hundreds of creates, and a process of its own, so a test can
kill -9 it. SIGTERM stops it cleanly."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from edged.config import Config
from edged.daemon import Server
from tests.edged.fakes import FakeBackend, digest, fake_layers

#: the layers every fake node has
LAYERS = {digest(i) for i in range(1, 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--max-sandboxes", type=int, required=True)
    p.add_argument("--create-delay", type=float, default=0.0)
    a = p.parse_args()
    d = Path(a.dir)
    cfg = Config(socket=a.socket, state_dir=str(d / "state"), runtime_dir=str(d / "run"),
                 cpus=64.0, memory_bytes=64 << 30, max_sandboxes=a.max_sandboxes,
                 reaper_interval_s=0.2, default_ttl_s=0.0, layer_linger_s=0.0,
                 swap="off", reclaim=False, log_level="warning")
    be = FakeBackend(d / "sandboxes")
    be.create_delay = a.create_delay
    layers, _ = fake_layers(d, LAYERS)
    asyncio.run(Server(cfg, backend=be, layers=layers).serve())


if __name__ == "__main__":
    main()
