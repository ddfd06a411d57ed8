"""Task profiles, the grader's tamper check, and AppArmor generation + compile check."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from edged.security import apparmor, tasks
from edged.security.profile import ProfileError


def test_default_task_profile() -> None:
    t = tasks.load()
    assert "/usr" in t.protected and "/bin/bash" in t.all_protected()
    assert t.tcp_bind is None and t.seccomp == "default"


def test_bad_task_profiles(tmp_path: Path) -> None:
    for body, needle in (('protectd = ["/usr"]', "unknown keys"),
                         ('protected = ["usr"]', "absolute"),
                         ('protected = ["/usr/../etc"]', "absolute"),
                         ("tcp_bind = [70000]", "ports")):
        p = tmp_path / "t.toml"
        p.write_text(body)
        with pytest.raises(ProfileError, match=needle):
            tasks.load(str(p))


def test_tampered_finds_shadowing_entries_in_the_upper(tmp_path: Path) -> None:
    up = tmp_path / "upper"
    (up / "usr" / "local").mkdir(parents=True)  # copy-up of a parent: fine
    (up / "etc").mkdir()
    protected = ["/bin/bash", "/usr/bin", "/etc/passwd", "/lib"]
    assert tasks.tampered(up, protected) == []
    (up / "bin").mkdir()
    (up / "bin" / "bash").write_text("evil")
    os.mknod(up / "lib", 0o600)  # stands in for a whiteout (char 0:0 needs CAP_MKNOD)
    (up / "usr" / "bin").mkdir()
    assert tasks.tampered(up, protected) == ["/bin/bash", "/lib", "/usr/bin"]


@pytest.mark.skipif(not shutil.which("apparmor_parser")
                    and not os.path.exists("/usr/sbin/apparmor_parser"),
                    reason="apparmor_parser missing (scripts/install.sh installs apparmor)")
def test_every_generated_profile_compiles() -> None:
    t = tasks.load()
    for name in apparmor.template_names():
        text = apparmor.render("sb-1", t.all_protected(), hidden=["/answers"], template=name)
        workload, grader = text.split("\nprofile edged-grader-sb-1 ", 1)
        assert "profile edged-sbx-sb-1 " in workload and "deny /usr/** wl," in workload
        # audited (a bare deny is quiet: no denial would reach the ledger), and the
        # directory itself ("/answers/": else it could be listed)
        assert "audit deny /answers/** rwlkmx," in workload
        assert "audit deny /answers/ rwlkmx," in workload and "audit deny /usr/ wl," in workload
        # the grader: the protected paths too, the hidden ones readable, its own label
        assert "deny /usr/** wl," in grader and "/answers" not in grader
        assert "signal (send, receive) peer=edged-grader-sb-1," in grader
        assert "signal (receive) peer=unconfined," in workload
        apparmor.check(text)
    with pytest.raises(ProfileError, match="apparmor_parser refused"):
        apparmor.check("profile broken { this is not a rule }")


def test_render_refuses_bad_input() -> None:
    with pytest.raises(ProfileError):
        apparmor.render("Bad Id", ["/usr"])
    with pytest.raises(ProfileError):
        apparmor.render("ok", ["/usr/*"])
    with pytest.raises(ProfileError, match="hidden"):
        apparmor.render("ok", ["/usr"], hidden=["/answers/*.txt"])
    for foreign in ("unconfined", "edged-sbx-x//grader", "sbx-x", "edged-sbx-Bad Id"):
        with pytest.raises(ProfileError):
            apparmor.unload(foreign)


def test_hidden_paths_in_task_profiles(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text('hidden = ["/answers/", "/opt/ref/solution.py", "/answers"]\n')
    assert tasks.load(str(p)).hidden == ("/answers", "/opt/ref/solution.py")
    assert tasks.load().hidden == ()
    p.write_text('hidden = ["answers"]\n')
    with pytest.raises(ProfileError, match="hidden"):
        tasks.load(str(p))


@pytest.mark.root
def test_load_and_unload_or_a_notice_without_kernel_support(
        caplog: pytest.LogCaptureFixture) -> None:
    """Where the kernel has AppArmor (the node VM), both profiles are loaded in enforce mode
    and removed again; elsewhere loading is a logged no-op."""
    text = apparmor.render("load-t", ["/usr"], hidden=["/answers"])
    if not apparmor.probe()["kernel"]:
        with caplog.at_level("INFO", logger="edged.security.apparmor"):
            assert apparmor.load(text) is False
        assert "not in this kernel" in caplog.text
        return
    listing = Path(apparmor.SECURITYFS) / "profiles"
    try:
        assert apparmor.load(text) is True
        loaded = listing.read_text().splitlines()
        assert "edged-sbx-load-t (enforce)" in loaded
        assert "edged-grader-load-t (enforce)" in loaded
    finally:
        for name in apparmor.profile_names("load-t"):
            apparmor.unload(name)
    assert "load-t" not in listing.read_text()
    apparmor.unload("edged-sbx-load-t")  # not loaded: a no-op
