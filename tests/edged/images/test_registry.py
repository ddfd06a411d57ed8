"""The image registry: validation and atomic persistence."""

from __future__ import annotations

import pytest

from edged.errors import BadRequest, NotFound
from edged.images.registry import ImageRegistry
from tests.edged.fakes import digest


def test_put_get_delete_persist(tmp_path) -> None:
    p = tmp_path / "images.json"
    r = ImageRegistry(p, has_layer={digest(1), digest(2)}.__contains__)
    r.put("base/py:3.11", [digest(1), digest(2)])
    assert ImageRegistry(p).get("base/py:3.11")["layers"] == [digest(1), digest(2)]
    with pytest.raises(BadRequest, match="not in the layer store"):
        r.put("x:1", [digest(3)])
    for bad in ("noTag", "UPPER:1", "a:", ":b", "a b:1"):
        with pytest.raises(BadRequest):
            r.put(bad, [digest(1)])
    with pytest.raises(BadRequest):
        r.put("x:1", [])
    r.delete("base/py:3.11")
    with pytest.raises(NotFound):
        ImageRegistry(p).get("base/py:3.11")
    assert [x.name for x in tmp_path.iterdir()] == ["images.json"]  # no temp files left


def test_corrupt_registry_is_a_clear_error(tmp_path) -> None:
    p = tmp_path / "images.json"
    p.write_text("{broken")
    with pytest.raises(BadRequest, match="unreadable"):
        ImageRegistry(p)
