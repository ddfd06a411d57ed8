"""Processes a test starts, each the leader of a session of its own, and a local Ray
cluster made of them.

Everything a test starts here is stopped by it, and only that: a process is signalled by
the pid it was started with; what is left of its session afterwards (Ray's workers and
agents, which leave the process group of ``ray start`` but not its session) is found by
its session id, the pid of a leader this module started, and killed. Never ``ray stop``:
it kills every Ray process on the host by name, another session's too.

Ray listens on 127.0.0.2-127.0.0.4 (the loopback range): Ray replaces 127.0.0.1 and
"localhost" with the host's own external address, which no test may talk to.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent


def free_port(host: str = "127.0.0.2") -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def session_of(pid: int) -> int | None:
    """The session id of process ``pid`` (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[4])


def in_session(sid: int) -> list[int]:
    """Pids of the processes in session ``sid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and session_of(int(d)) == sid:
            out.append(int(d))
    return out


class Proc:
    """One process started by a test, leader of its own session; output to ``log``."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path = ROOT) -> None:
        self.argv = list(argv)
        self.log = log
        self._f = open(log, "ab")  # noqa: SIM115 (held while the process runs)
        self.p = subprocess.Popen(self.argv, stdout=self._f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True,
                                  env={**os.environ, **(env or {})})
        self.pid = self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int | None:
        """``sig``, up to ``timeout`` s for it to end, then SIGKILL; then whatever is left of
        its session is killed. Returns its exit status."""
        self.send(sig)
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.p.wait(10)
        self.kill_session()
        self._f.close()
        return self.p.returncode

    def kill_session(self, timeout: float = 10.0) -> None:
        """SIGKILL every process left in this leader's session, until none is."""
        deadline = time.monotonic() + timeout
        while (left := [p for p in in_session(self.pid) if p != os.getpid()]):
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise AssertionError(f"processes {left} of session {self.pid} survive SIGKILL")
            time.sleep(0.05)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    """Poll ``pred()`` until it is truthy (returned) or ``timeout`` s pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


class RayCluster:
    """``ray start --head`` on ``ips[0]`` and one worker node per further address, each its
    own session; every port Ray would take by default is given a free one, so that two test
    runs (or another session's Ray) never collide."""

    def __init__(self, tmp: Path, ips: Sequence[str] = ("127.0.0.2",)) -> None:
        self.tmp = tmp
        self.ips = list(ips)
        self.port = free_port(self.ips[0])
        self.address = f"{self.ips[0]}:{self.port}"
        self.procs: list[Proc] = []

    def _node(self, ip: str, head: bool) -> Proc:
        argv = [str(VENV_BIN / "ray"), "start", "--block", "--disable-usage-stats",
                f"--node-ip-address={ip}", "--num-cpus=1",
                "--object-store-memory=80000000",
                f"--node-manager-port={free_port(ip)}",
                f"--object-manager-port={free_port(ip)}",
                f"--metrics-export-port={free_port(ip)}",
                f"--dashboard-agent-listen-port={free_port(ip)}",
                f"--dashboard-agent-grpc-port={free_port(ip)}",
                f"--runtime-env-agent-port={free_port(ip)}"]
        if head:
            argv += ["--head", f"--port={self.port}", "--include-dashboard=false",
                     f"--dashboard-port={free_port(ip)}",
                     f"--temp-dir={self.tmp / 'ray'}"]
        else:
            argv += [f"--address={self.address}"]
        # SIGTERM ends a node at once (Ray drains one for 30 s first, by default)
        # and a loaded machine (load average 40 seen) gets 2 minutes to start one, not 30 s
        env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
               "RAY_raylet_start_wait_time_s": "120"}
        return Proc(argv, self.tmp / f"ray-{ip}.log", env=env)

    def start(self, timeout: float = 180.0) -> RayCluster:
        """Start the head, then each worker node once the one before is up."""
        head = self._node(self.ips[0], True)
        self.procs.append(head)
        self._wait_started(head, timeout)
        for ip in self.ips[1:]:
            p = self._node(ip, False)
            self.procs.append(p)
            self._wait_started(p, timeout)
        return self

    def _wait_started(self, p: Proc, timeout: float) -> None:
        def up() -> bool:
            if not p.alive():
                raise AssertionError(f"ray start ended:\n{p.text()}")
            return "Ray runtime started" in p.text()
        wait_for(up, timeout, f"ray start ({p.log.name})", step=0.2)

    def wait_nodes(self, timeout: float = 90.0) -> list[dict[str, Any]]:
        """Once every node has joined (from a connected driver): Ray's node table."""
        import ray

        def all_up() -> list[dict[str, Any]] | None:
            for p in self.procs:
                if not p.alive():
                    raise AssertionError(f"a Ray node ended:\n{p.text()}")
            alive = [n for n in ray.nodes() if n["Alive"]]
            return alive if len(alive) == len(self.ips) else None
        return wait_for(all_up, timeout, "the Ray nodes", step=0.2)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop(30)
