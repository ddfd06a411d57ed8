"""The keys file of edged's TCP listeners: format, permissions, reload, constant-time check."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from edged.security import apikeys
from edged.security.apikeys import ApiKeyError, ApiKeys, presented_key

K1 = "k1-0123456789abcdef"
K2 = "k2-fedcba9876543210"


def _write(p: Path, text: str, mode: int = 0o600) -> Path:
    p.write_text(text)
    os.chmod(p, mode)
    return p


def test_named_and_unnamed_keys(tmp_path: Path) -> None:
    keys = ApiKeys(_write(tmp_path / "keys", f"# comment\n\ntrainer {K1}  # trailing\n{K2}\n"))
    assert keys.check(K1) == "trainer"
    assert keys.check(K2) is not None and keys.check(K2).startswith("key-")
    assert K2 not in keys.check(K2)  # the id never shows the key
    for wrong in (None, "", K1[:-1], K1 + "x", K1.upper(), "trainer"):
        assert keys.check(wrong) is None, wrong


@pytest.mark.parametrize(("text", "match"), [
    ("", "no key"),
    ("# only comments\n", "no key"),
    ("short\n", ":1: a key is 16"),
    (f"a b {K1}\n", ":1: expected 'KEY' or 'NAME KEY'"),
    (f"bad/name {K1}\n", ":1: name 'bad/name'"),
    (f"x {K1}\ny {K1}\n", ":2: duplicate key"),
    (f"x {K1}\nx {K2}\n", ":2: duplicate name"),
])
def test_bad_files_refused(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ApiKeyError, match=match):
        ApiKeys(_write(tmp_path / "keys", text))


def test_missing_or_world_readable_file_refused(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError, match="No such file"):
        ApiKeys(tmp_path / "absent")
    with pytest.raises(ApiKeyError, match="readable by others"):
        ApiKeys(_write(tmp_path / "keys", f"{K1}\n", 0o644))
    ApiKeys(_write(tmp_path / "keys", f"{K1}\n", 0o640))  # group-readable is fine


def test_reload_on_change_keeps_last_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apikeys, "RECHECK_S", 0.0)
    p = _write(tmp_path / "keys", f"a {K1}\n")
    keys = ApiKeys(p)
    assert keys.check(K1) == "a" and keys.check(K2) is None
    time.sleep(0.01)
    _write(p, f"b {K2}\n")
    assert keys.check(K2) == "b" and keys.check(K1) is None  # rotated without a restart
    _write(p, "garbage\n")
    assert keys.check(K2) == "b"  # a broken file keeps the last good keys
    p.unlink()
    assert keys.check(K2) == "b"


def test_presented_key_headers() -> None:
    assert presented_key({"X-API-Key": f" {K1} "}) == K1
    assert presented_key({"Authorization": f"Bearer {K2}"}) == K2
    assert presented_key({"Authorization": f"Basic {K2}"}) is None
    assert presented_key({}) is None
    assert presented_key({"X-Other": K1}, header="X-Other") == K1


def test_in_memory_keys() -> None:
    keys = ApiKeys.from_mapping({"t": K1})
    assert keys.check(K1) == "t" and keys.ids == ["t"]
    with pytest.raises(ApiKeyError):
        ApiKeys.from_mapping({})
