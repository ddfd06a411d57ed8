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
        text = apparmor.render("sb-1", t.all_protected(), template=name)
        assert "deny /usr/** wl," in text and "profile edged-sbx-sb-1" in text
        apparmor.check(text)
    with pytest.raises(ProfileError, match="apparmor_parser refused"):
        apparmor.check("profile broken { this is not a rule }")


def test_render_refuses_bad_input() -> None:
    with pytest.raises(ProfileError):
        apparmor.render("Bad Id", ["/usr"])
    with pytest.raises(ProfileError):
        apparmor.render("ok", ["/usr/*"])


def test_load_skips_with_a_notice_without_kernel_support(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    if apparmor.probe()["kernel"]:
        pytest.skip("this kernel has AppArmor; loading is exercised on production hosts")
    with caplog.at_level("INFO", logger="edged.security.apparmor"):
        assert apparmor.load(apparmor.render("x", ["/usr"])) is False
    assert "not in this kernel" in caplog.text
