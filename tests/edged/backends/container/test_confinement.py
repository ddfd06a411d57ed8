"""The container backend's confinement glue: limit counters, the policy files handed to the
spawner, and failing closed when a policy cannot be applied (an AppArmor profile on a kernel
without AppArmor)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from edged.backends.base import ExecSpec, Resources, SandboxSpec
from edged.backends.container import ContainerBackend, confinement
from edged.errors import EdgedError


def test_spawner_args_write_policy_files(tmp_path: Path, busybox_tree: Path) -> None:
    spec = SandboxSpec(id="p1", lowers=(str(busybox_tree),), resources=Resources(), env={},
                       hostname="h")
    pol = confinement.prepare(spec)
    confinement.release("p1")  # (where the kernel has AppArmor, prepare loaded its profiles)
    assert pol is not None
    args = confinement.spawner_args(dataclasses.replace(pol, apparmor_profile="edged-sbx-p1"),
                                    tmp_path / "policies")
    sc = Path(args[args.index("--seccomp") + 1])
    assert sc.parent == tmp_path / "policies" and sc.read_bytes() == pol.seccomp_prog
    assert (tmp_path / "policies").stat().st_mode & 0o777 == 0o700
    # written once, shared by every sandbox with the same policy
    again = confinement.spawner_args(pol, tmp_path / "policies")
    assert again[again.index("--seccomp") + 1] == str(sc)
    assert len(list((tmp_path / "policies").iterdir())) == (2 if pol.landlock_blob else 1)
    assert args[args.index("--apparmor") + 1] == "edged-sbx-p1"
    assert args.count("--protect") == len(pol.protected) and "/bin" in pol.protected
    assert confinement.prepare(dataclasses.replace(spec, task_profile=None)) is None
    with pytest.raises(EdgedError):
        confinement.prepare(dataclasses.replace(spec, task_profile="no-such-profile"))


@pytest.mark.root
@pytest.mark.mount
def test_exec_fails_closed_when_apparmor_cannot_apply(
        backend: ContainerBackend, busybox_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox told to use an AppArmor profile never runs an exec without it: with no
    AppArmor in the kernel sbx-init cannot set it, and with AppArmor a profile that is not
    loaded cannot be changed to; either way the exec is refused."""
    real = confinement.prepare

    def with_aa(spec: SandboxSpec) -> Any:
        pol = real(spec)
        return (dataclasses.replace(pol, apparmor_profile="edged-sbx-never-loaded")
                if pol else None)

    monkeypatch.setattr(confinement, "prepare", with_aa)
    spec = SandboxSpec(id="aa", lowers=(str(busybox_tree),), resources=Resources(),
                       env={"PATH": "/bin"}, hostname="aa")

    async def body() -> None:
        await backend.create(spec)
        try:
            with pytest.raises(EdgedError, match="apparmor"):
                await backend.exec("aa", ExecSpec(argv=("true",), env={"PATH": "/bin"}))
        finally:
            await backend.destroy("aa")

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_profile_the_kernel_cannot_enforce_is_refused(
        tmp_path: Path, busybox_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TCP port rules without Landlock ABI 4 (Linux 6.1 has ABI 2), hidden paths without
    AppArmor: refused at create, naming what is missing (they were dropped silently)."""
    from edged.security import apparmor, landlock
    from edged.security.profile import PROFILES_DIR, ProfileError

    default = (PROFILES_DIR / "tasks" / "default.toml").read_text()
    tcp = tmp_path / "tcp.toml"
    tcp.write_text(default + "\ntcp_connect = [443]\n")
    hidden = tmp_path / "hidden.toml"
    hidden.write_text(default + '\nhidden = ["/answers"]\n')
    spec = SandboxSpec(id="nope", lowers=(str(busybox_tree),), resources=Resources(), env={},
                       hostname="h")
    monkeypatch.setattr(landlock, "abi", lambda: 2)
    with pytest.raises(ProfileError, match=r"need Landlock ABI 4 .* this kernel has ABI 2"):
        confinement.prepare(dataclasses.replace(spec, task_profile=str(tcp)))
    monkeypatch.setattr(apparmor, "probe", lambda: {"kernel": False, "parser": None})
    with pytest.raises(ProfileError, match="hidden paths need AppArmor"):
        confinement.prepare(dataclasses.replace(spec, task_profile=str(hidden)))
    monkeypatch.setattr(landlock, "abi", lambda: 4)
    pol = confinement.prepare(dataclasses.replace(spec, task_profile=str(tcp)))
    assert pol is not None and pol.task.tcp_connect == (443,)


def test_prepare_cache_follows_profile_and_layers(tmp_path: Path) -> None:
    """A cached policy is reused while nothing it was built from changed, and rebuilt when a
    layer directory the Landlock ruleset lists gains an entry."""
    root = tmp_path / "root"
    for d in ("bin", "etc", "usr/bin"):
        (root / d).mkdir(parents=True)
    spec = SandboxSpec(id="c1", lowers=(str(root),), resources=Resources(), env={},
                       hostname="h", task_profile="default")
    a = confinement.prepare(spec)
    b = confinement.prepare(dataclasses.replace(spec, id="c2"))
    assert a is not None and b is not None
    assert b.seccomp_prog is a.seccomp_prog and b.landlock_blob is a.landlock_blob
    (root / "data").mkdir()  # a new top-level directory: the ruleset must grant it
    c = confinement.prepare(spec)
    assert c is not None and c.seccomp_prog == a.seccomp_prog
    if a.landlock_blob is not None:
        assert c.landlock_blob != a.landlock_blob
    (root / "etc" / "new").mkdir()  # /etc holds protected files: its listing is read too
    d = confinement.prepare(spec)
    assert d is not None and d.landlock_blob is not c.landlock_blob
    other = confinement.prepare(dataclasses.replace(spec, seccomp_profile="default",
                                                    lowers=(str(root), str(tmp_path))))
    assert other is not None and other.landlock_blob is not d.landlock_blob
