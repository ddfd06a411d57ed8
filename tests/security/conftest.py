"""Fixtures of the red-team suite: a static attack tool (attack.c) inside a busybox rootfs,
container backends whose security events go to a real :class:`Ledger`, and helpers to run
an attack and read its per-attempt results.

Every sandbox is a real one (edged-spawner + sbx-init, the default task profile); every
fixture checks that nothing was left behind (sandboxes, cgroups).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edged.backends.base import ExecEnd, ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend
from edged.security.ledger import Ledger, SecurityEvent
from tests.busybox import install_busybox
from tests.edged.backends.container.conftest import assert_left_clean

HERE = Path(__file__).resolve().parent
ENV = {"PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="session")
def attack_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/security/attack.c, linked statically (the rootfs has no libc)."""
    return build_attack(tmp_path_factory.mktemp("attack") / "attack")


def build_attack(out: Path) -> Path:
    """Build tests/security/attack.c statically as ``out``; skips the test without a C
    compiler or a static libc."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the attack tool")
    proc = subprocess.run([cc, "-static", "-O1", "-o", str(out), str(HERE / "attack.c")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot build the static attack tool: {proc.stderr[-500:]}")
    return out


def make_rootfs(root: Path, attack: Path) -> Path:
    """A rootfs: busybox in /bin (an applet symlink each, /bin/sh among them), the attack
    tool as /usr/bin/attack, /lib a symlink into /usr (merged-/usr style: protected by
    Landlock alone, since a symlink cannot be a read-only mount), /etc/passwd, /work."""
    install_busybox(root)
    for d in ("usr/bin", "usr/lib", "etc", "work"):
        (root / d).mkdir(parents=True)
    shutil.copy2(attack, root / "usr" / "bin" / "attack")
    (root / "usr" / "lib" / "libc.so").write_text("a protected library\n")
    (root / "lib").symlink_to("usr/lib")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\n")
    (root / "etc" / "hostname").write_text("layer\n")
    os.chmod(root, 0o755)
    return root


@pytest.fixture(scope="session")
def rootfs(tmp_path_factory: pytest.TempPathFactory, attack_bin: Path) -> Path:
    return make_rootfs(tmp_path_factory.mktemp("redteam-root"), attack_bin)


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(None, rate_per_s=100_000)


@dataclass
class Node:
    backend: ContainerBackend
    ledger: Ledger


@pytest.fixture
def node_factory(tmp_path: Path, ledger: Ledger) -> Iterator[Callable[..., Node]]:
    """``make(**backend_kwargs)``: a backend on a private state dir feeding ``ledger``."""
    made: list[ContainerBackend] = []

    def make(**kw: Any) -> Node:
        b = ContainerBackend(tmp_path / f"state{len(made)}", on_event=ledger.record, **kw)
        if not (b.bin_dir / "edged-spawner").exists():
            pytest.skip("edged/_bin not built: run `pip install -e .`")
        made.append(b)
        return Node(b, ledger)

    yield make
    for b in made:
        assert_left_clean(b)


@pytest.fixture
def node(node_factory: Callable[..., Node]) -> Node:
    return node_factory()


def spec(rootfs: Path | str, sid: str, **res: Any) -> SandboxSpec:
    return SandboxSpec(id=sid, lowers=(str(rootfs),), resources=Resources(**res), env=ENV,
                       hostname=f"host-{sid}")


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 120) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout))  # type: ignore[arg-type]


async def sh(b: ContainerBackend, sid: str, script: str,
             **kw: Any) -> tuple[str, str, ExecEnd]:
    """Run ``sh -c script`` in the sandbox; (stdout, stderr, end)."""
    return await execv(b, sid, ("/bin/sh", "-c", script), **kw)


async def execv(b: ContainerBackend, sid: str, argv: tuple[str, ...],
                **kw: Any) -> tuple[str, str, ExecEnd]:
    h = await b.exec(sid, ExecSpec(argv=argv, env=ENV, **kw))
    out, err = bytearray(), bytearray()
    async for ev in h.events():
        if isinstance(ev, ExecEnd):
            return out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), ev
        (out if ev[0] == "stdout" else err).extend(ev[1])
    raise AssertionError("no ExecEnd")


def results(out: str) -> dict[str, str]:
    """The attack tool's ``LABEL RESULT`` lines as a dict."""
    res = {}
    for line in out.splitlines():
        label, _, result = line.partition(" ")
        res[label] = result
    return res


def assert_all_failed(res: dict[str, str], expected: set[str]) -> None:
    """Every attempt in ``expected`` was made and failed; nothing at all succeeded."""
    assert expected <= set(res), f"attempts missing from the output: {expected - set(res)}"
    won = {k: v for k, v in res.items() if v == "SUCCEEDED"}
    assert not won, f"attacks that succeeded: {won}"


def denied(ledger: Ledger, sid: str) -> list[SecurityEvent]:
    return [e for e in ledger.events(sid, limit=100_000) if e.kind == "seccomp_denied"]


def denied_syscalls(ledger: Ledger, sid: str) -> set[str]:
    return {e.syscall or "" for e in denied(ledger, sid)}


def kinds(ledger: Ledger, sid: str) -> set[str]:
    return {e.kind for e in ledger.events(sid, limit=100_000)}
