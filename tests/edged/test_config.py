"""Configuration: defaults, TOML, flags, environment; unknown keys refused."""

from __future__ import annotations

import argparse

import pytest

from edged import config
from edged.errors import BadRequest


def test_defaults_work(monkeypatch) -> None:
    monkeypatch.delenv("EDGED_SOCKET", raising=False)
    monkeypatch.delenv("EDGED_CONFIG", raising=False)
    c = config.Config()
    c.validate()
    assert c.socket == "/run/edged/edged.sock" and c.capacity_cpus() >= 1
    assert c.capacity_memory() > 1 << 20


def test_file_flags_env_precedence(tmp_path, monkeypatch) -> None:
    f = tmp_path / "edged.toml"
    f.write_text('socket = "/tmp/file.sock"\ncpu_overcommit = 4\nstate_dir = "/x"\n')
    monkeypatch.delenv("EDGED_SOCKET", raising=False)
    c = config.load(str(f))
    assert (c.socket, c.cpu_overcommit, c.state_dir) == ("/tmp/file.sock", 4.0, "/x")
    monkeypatch.setenv("EDGED_SOCKET", "/tmp/env.sock")
    assert config.load(str(f)).socket == "/tmp/env.sock"
    p = argparse.ArgumentParser()
    config.add_flags(p)
    ns = p.parse_args(["--config", str(f), "--socket", "/tmp/flag.sock", "--max-sandboxes", "7"])
    c = config.from_args(ns)
    assert (c.socket, c.max_sandboxes, c.cpu_overcommit) == ("/tmp/flag.sock", 7, 4.0)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("sockett = 'x'", "unknown key 'sockett'"),
        ("cpus = 'two'", "expected float"),
        ("on_shutdown = 'maybe'", "on_shutdown"),
        ("cpu_overcommit = -1", "cpu_overcommit"),
        ("swap = 'disk'", "swap"),
        ("not toml [", "config"),
    ],
)
def test_bad_config(tmp_path, text, match) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(BadRequest, match=match):
        config.load(str(f))


def test_every_flag_of_serve_is_described() -> None:
    """``edged serve --help`` says what each knob does, not only its default."""
    import argparse

    from edged import config as config_mod

    p = argparse.ArgumentParser()
    config_mod.add_flags(p)
    for action in p._actions:
        if action.dest in ("help",):
            continue
        assert action.help and not action.help.startswith("(default"), action.dest
