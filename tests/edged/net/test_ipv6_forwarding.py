"""IPv6 forwarding of networked sandboxes by kernel: per-interface ``force_forwarding`` from
Linux 6.17 on, before it only the host's own switch (the 6.1 node VM). Where the host
forwards no IPv6, sandboxes get none (no address whose default route leads nowhere)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.net import manager, netns


def _conf(tmp_path: Path, *, force: bool, all_forwarding: str | None) -> Path:
    conf = tmp_path / "conf"
    (conf / "all").mkdir(parents=True)
    if force:
        (conf / "all" / "force_forwarding").write_text("0\n")
    if all_forwarding is not None:
        (conf / "all" / "forwarding").write_text(all_forwarding + "\n")
    return conf


@pytest.mark.parametrize(("force", "all_forwarding", "ok", "said"), [
    (True, "0", True, "force_forwarding"),
    (False, "1", True, "all.forwarding=1"),
    (False, "0", False, "sandboxes get no IPv6"),
    (False, None, False, "no IPv6 sysctls"),
], ids=["6.17", "before-6.17-router", "before-6.17", "no-ipv6"])
def test_ipv6_forwarding_by_kernel(tmp_path: Path, force: bool, all_forwarding: str | None,
                                   ok: bool, said: str) -> None:
    got, why = netns.ipv6_forwarding(_conf(tmp_path, force=force,
                                           all_forwarding=all_forwarding))
    assert got is ok and said in why, why


def test_this_hosts_ipv6_forwarding() -> None:
    """From 6.17 on (this dev host's 6.18) always; before (the node VM's 6.1) as the host's
    own switch says (the node VM's guest turns it on)."""
    conf = Path("/proc/sys/net/ipv6/conf/all")
    want = (conf / "force_forwarding").exists() or \
        (conf / "forwarding").read_text().strip() == "1"
    assert netns.ipv6_forwarding()[0] is want


@pytest.mark.parametrize("forwarded", [True, False])
def test_no_ipv6_pool_without_forwarding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         forwarded: bool) -> None:
    monkeypatch.setattr(netns, "ipv6_forwarding", lambda: (forwarded, "because"))
    m = manager.NetworkManager(manager.Settings(state_dir=tmp_path))
    try:
        feats: dict[str, object] = {"pool6": str(m.pool6)}
        m._check_ipv6(feats)
        assert feats["ipv6"] is forwarded and feats["ipv6_reason"] == "because"
        if forwarded:
            assert m.pool6 is not None and m.gw6 == m.pool6[1] == m.plumber.gw6
            assert feats["pool6"] == str(m.pool6)
        else:
            assert m.pool6 is None and m.gw6 is None and m.plumber.gw6 is None
            assert feats["pool6"] is None
            assert m._addr6(2) is None  # no sandbox address either
    finally:
        m.plumber.close()
