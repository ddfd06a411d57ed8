"""Landlock: protected-path ruleset construction, blob validation, and enforcement in real
children (write/truncate/rename/unlink of a protected file, signals to the parent, abstract
unix sockets outside the domain, TCP connect rules)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edged.security import landlock as L
from tests.edged.security.confined import run_confined

pytestmark = pytest.mark.skipif(L.abi() < 6, reason="needs Landlock ABI >= 6 (scopes)")


def test_protected_ruleset_spells_everything_but_the_protected_paths() -> None:
    with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as top:
        for d in ("usr/bin", "usr/local/bin", "usr/local/share", "etc", "root", "opt"):
            Path(base, d).mkdir(parents=True)
        os.symlink("usr/bin", Path(base, "bin"))
        Path(top, "workspace").mkdir()
        r = L.protected_ruleset([base, top], ["/usr/local/bin", "/bin", "/etc/"])
        grants = {p.path: p.access for p in r.paths}
        assert grants.pop("/") == L.FS_READ_EXEC
        for p in ("/usr/bin", "/usr/local/share", "/root", "/opt", "/workspace", "/tmp", "/dev",
                  "/proc", "/sys", "/run"):
            assert grants.pop(p) == L.FS_ALL, p
        assert grants == {}  # nothing for /usr/local/bin, /etc, the /bin symlink, ancestors
        assert r.serialize()[:4] == b"LFLL"


def test_bad_rules_and_blobs_are_refused() -> None:
    with pytest.raises(ValueError, match="absolute"):
        L.LandlockRuleset(paths=(L.PathRule("rel", L.FS_ALL),)).serialize()
    with pytest.raises(ValueError, match="not handled"):
        L.LandlockRuleset(handled_fs=L.FS_READ_FILE,
                          paths=(L.PathRule("/x", L.FS_ALL),)).serialize()
    with pytest.raises(ValueError, match="port"):
        L.LandlockRuleset(handled_net=L.NET_ALL, ports=((70000, L.NET_CONNECT_TCP),)).serialize()
    good = L.LandlockRuleset(paths=(L.PathRule("/", L.FS_READ_EXEC),)).serialize()
    from edged.security import confine

    for bad in (good[:-3], b"XXXX" + good[4:], good + b"\0" * 8, b""):
        with pytest.raises(ValueError):
            confine.apply_landlock(bad)


def test_a_bad_blob_is_an_edged_error() -> None:
    """Confinement's C errors are edged's (edged.native), not layerfs's: a blob the C check
    refuses is a BadRequest (it was layerfs's ImageFormatError)."""
    from edged.errors import BadRequest, EdgedError
    from edged.security import confine

    good = L.LandlockRuleset(paths=(L.PathRule("/", L.FS_READ_EXEC),)).serialize()
    with pytest.raises(BadRequest, match="landlock") as exc:
        confine.apply_landlock(good[:-3])
    assert isinstance(exc.value, EdgedError)
    assert "layerfs" not in type(exc.value).__module__


@pytest.fixture()
def tree() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ll-"))
    (d / "prot").mkdir()
    (d / "work").mkdir()
    shutil.copy("/bin/true", d / "prot" / "bash")
    (d / "work" / "evil").write_text("#!/bin/sh\necho pwned\n")
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _ruleset(tree: Path, **kw: object) -> bytes:
    return L.LandlockRuleset(
        paths=(L.PathRule("/", L.FS_READ_EXEC, optional=False),
               L.PathRule(str(tree / "work"), L.FS_ALL, optional=False)),
        **kw,  # type: ignore[arg-type]
    ).serialize()


def _try(fn: object) -> int:
    try:
        fn()  # type: ignore[operator]
        return 0
    except OSError as e:
        return e.errno or -1


def test_protected_file_cannot_be_changed_but_runs(tree: Path) -> None:
    bash, evil = str(tree / "prot" / "bash"), str(tree / "work" / "evil")

    def attacks() -> dict[str, int]:
        return {
            "write": _try(lambda: open(bash, "r+b").close()),
            "truncate": _try(lambda: os.truncate(bash, 0)),
            "rename_over": _try(lambda: os.rename(evil, bash)),
            "unlink": _try(lambda: os.unlink(bash)),
            "create_beside": _try(lambda: open(str(tree / "prot" / "x"), "w").close()),
            "write_work": _try(lambda: Path(tree / "work" / "ok").write_text("fine")),
            "exec": subprocess.run([bash]).returncode,
        }

    got = run_confined(attacks, landlock=_ruleset(tree))
    assert got["write"] == errno.EACCES and got["truncate"] == errno.EACCES
    assert got["rename_over"] in (errno.EACCES, errno.EXDEV)
    assert got["unlink"] == errno.EACCES and got["create_beside"] == errno.EACCES
    assert got["write_work"] == 0 and got["exec"] == 0
    assert (tree / "prot" / "bash").read_bytes() == Path("/bin/true").read_bytes()
    # Unconfined, the same calls succeed (so the test can fail).
    assert _try(lambda: os.truncate(tree / "work" / "evil", 0)) == 0


def test_scopes_block_signals_and_abstract_sockets_outside_the_domain(tree: Path) -> None:
    name = f"\0edged-test-{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen(1)
    try:
        def attacks() -> dict[str, int]:
            def connect() -> None:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.connect(name)

            return {"signal_parent": _try(lambda: os.kill(os.getppid(), 0)),
                    "connect": _try(connect),
                    "signal_self": _try(lambda: os.kill(os.getpid(), 0))}

        assert run_confined(attacks) == {"signal_parent": 0, "connect": 0, "signal_self": 0}
        srv.settimeout(1)
        srv.accept()[0].close()
        got = run_confined(attacks, landlock=_ruleset(tree))
        assert got == {"signal_parent": errno.EPERM, "connect": errno.EPERM, "signal_self": 0}
    finally:
        srv.close()


def test_tcp_connect_rules(tree: Path) -> None:
    a, b = socket.socket(), socket.socket()
    for s in (a, b):
        s.bind(("127.0.0.1", 0))
        s.listen(4)
    pa, pb = a.getsockname()[1], b.getsockname()[1]
    try:
        def attempts() -> dict[str, int]:
            def conn(port: int) -> None:
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    pass

            return {"allowed": _try(lambda: conn(pa)), "other": _try(lambda: conn(pb))}

        blob = _ruleset(tree, handled_net=L.NET_ALL, ports=((pa, L.NET_CONNECT_TCP),))
        got = run_confined(attempts, landlock=blob)
        assert got == {"allowed": 0, "other": errno.EACCES}
    finally:
        a.close()
        b.close()
