"""Red team: a grader exec (``trusted``) sees the system trees as the layers hold them.

The workload may write in /etc, /root or a toolkit directory (they are not all protected),
and a grader's interpreter or tool would run what it wrote: a ``sitecustomize.py`` in
/etc/python3.11 (reached from /usr/lib/python3.11 by a symlink on Debian), a ``.pth`` file in
``~/.local``, a changed tool under /opt/toolkit. The grader's own view (a mount namespace of
its own with the task profile's ``grader_view`` trees cloned from the lowers) must show none
of it, while the workload's own view keeps its changes and the workspace stays shared.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from edged.backends.base import Resources, SandboxSpec
from tests.security.conftest import ENV, Node, make_rootfs, run, sh

pytestmark = [pytest.mark.root, pytest.mark.mount]

TAMPER = """
set -e
mkdir -p /etc/python3.11 /root/.local/lib/python3.11/site-packages /opt/extra
echo 'print("INJECTED")' > /etc/python3.11/sitecustomize.py
echo 'import evil' > /root/.local/lib/python3.11/site-packages/evil.pth
printf '#!/bin/sh\\necho tampered tool\\n' > /opt/toolkit/run-tests
echo agent > /opt/extra/file
echo answer > /work/answer
echo done
"""

GRADER = """
cat /etc/python3.11/sitecustomize.py 2>&1
ls -A /root
/opt/toolkit/run-tests
ls /opt/extra 2>&1 | wc -l
cat /work/answer
echo graded > /work/grade
"""


@pytest.fixture
def toolkit_root(tmp_path: Path, attack_bin: Path) -> Path:
    root = make_rootfs(tmp_path / "root", attack_bin)
    (root / "etc" / "python3.11").mkdir()
    (root / "etc" / "python3.11" / "sitecustomize.py").write_text("# from the layer\n")
    (root / "root").mkdir(mode=0o700)
    tool = root / "opt" / "toolkit" / "run-tests"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho pristine tool\n")
    tool.chmod(0o755)
    (root / "opt" / "extra").mkdir()
    return root


@pytest.fixture
def shared_toolkit_root(toolkit_root: Path) -> Iterator[Path]:
    """``toolkit_root`` as a mount of its own with shared propagation, as a systemd host's
    mounts are (the node VM's): a sandbox's mounts must never propagate back onto it."""
    subprocess.run(["mount", "--bind", str(toolkit_root), str(toolkit_root)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(toolkit_root)], check=True)
        yield toolkit_root
    finally:
        for _ in range(8):  # whatever was stacked on it too (the bug this guards against)
            if not _mounts_at(toolkit_root):
                break
            subprocess.run(["umount", "-l", str(toolkit_root)], check=True)


def _mounts_at(path: Path) -> list[str]:
    return [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if ln.split()[4] == str(path)]


@pytest.mark.parametrize("staged", [False, True], ids=["detached", "staged"])
def test_grader_sees_the_layers(node: Node, shared_toolkit_root: Path, staged: bool,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``staged``: the layers the way kernels before 6.15 need them (the 6.1 node VM):
    attached beneath the sandbox's /proc, the grader's overlay made from their paths."""
    if staged:
        monkeypatch.setenv("EDGED_SPAWNER_STAGED", "1")
    toolkit_root = shared_toolkit_root
    b = node.backend
    env = {**ENV, "PYTHONPATH": "/opt/evil", "LD_PRELOAD": "/opt/evil.so"}

    async def body() -> None:
        await b.create(SandboxSpec(id="gview", lowers=(str(toolkit_root),),
                                   resources=Resources(), env=env, hostname="gview"))
        try:
            out, err, end = await sh(b, "gview", TAMPER)
            assert out == "done\n", (out, err)
            # (the env a trusted exec gets is the daemon's to set: see the test below)
            h_out, h_err, end = await sh(b, "gview", GRADER, trusted=True)
            lines = h_out.splitlines()
            assert end.reason == "exited" and end.exit_code == 0, (end, h_out, h_err)
            assert lines[0] == "# from the layer", h_out  # not the injected sitecustomize
            assert lines[1] == "pristine tool", h_out  # /root empty: no .pth; tool from layer
            assert lines[2] == "1", h_out  # /opt/extra is outside the view: shared
            assert lines[3] == "answer", h_out  # the workspace is shared
            # the workload's own view still has its changes: the grader's was private
            out, _, _ = await sh(b, "gview", "cat /etc/python3.11/sitecustomize.py "
                                 "/opt/toolkit/run-tests /work/grade; ls /root/.local")
            assert out == ('print("INJECTED")\n#!/bin/sh\necho tampered tool\ngraded\nlib\n'), out
            # whatever the layers' mounts are under, the workload's /proc is proc's
            out, _, _ = await sh(b, "gview", "stat -f -c %T /proc; ls /proc/self/ns | wc -l; "
                                 "grep -c '^[^ ]* [^ ]* [^ ]* [^ ]* /proc ' /proc/self/mountinfo")
            kind, n_ns, at_proc = out.split()
            assert kind == "proc" and int(n_ns) > 3, out
            # staged (forced, or a kernel before 6.15, which stages every rootfs): the
            # scratch mount and the one lower beneath proc; else proc alone
            release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
            assert int(at_proc) == (3 if staged or release < (6, 15) else 1), out
            # nothing of the sandbox's came back onto the layer's (shared) host directory
            assert _mounts_at(toolkit_root) == [str(toolkit_root)]
            assert not (toolkit_root / "self").exists()
        finally:
            await b.destroy("gview")

    run(body)


def test_grader_env_from_the_daemon() -> None:
    """The daemon's exec body → spec: a trusted exec drops PYTHON*/LD_* of the sandbox env,
    sets PYTHONNOUSERSITE=1 and HOME=/root; what the request gives explicitly wins."""
    from edged.api.requests import parse_exec
    from edged.node.manager import SandboxManager

    class Rec:
        env: ClassVar[dict[str, str]] = {
            "PYTHONPATH": "/evil", "LD_PRELOAD": "/evil.so", "PYTHONSTARTUP": "/x",
            "PATH": "/bin", "HOME": "/work"}

    m = SandboxManager.__new__(SandboxManager)
    m.get = lambda sid: Rec()  # type: ignore[method-assign]
    spec = m.exec_spec("x", parse_exec({"cmd": "true", "trusted": True}))
    assert dict(spec.env) == {"PATH": "/bin", "HOME": "/root", "PYTHONNOUSERSITE": "1"}
    spec = m.exec_spec("x", parse_exec({"cmd": "true", "trusted": True,
                                        "env": {"PYTHONPATH": "/opt/toolkit", "HOME": "/tmp"}}))
    assert spec.env["PYTHONPATH"] == "/opt/toolkit" and spec.env["HOME"] == "/tmp"
    spec = m.exec_spec("x", parse_exec({"cmd": "true"}))
    assert spec.env["PYTHONPATH"] == "/evil"  # an ordinary exec keeps the sandbox env
