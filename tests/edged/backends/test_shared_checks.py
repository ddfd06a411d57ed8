"""What the container and microVM backends share from ``edged.backends.base``: the exec-spec
check and the per-instance cgroup subdirectory (each was written once per backend)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.backends.base import ExecSpec, instance_subdir
from edged.backends.uidslots import UidSlots
from edged.errors import BadRequest


def spec(**kw: object) -> ExecSpec:
    return ExecSpec(argv=("true",), env={}, **kw)  # type: ignore[arg-type]


def test_exec_spec_check_refuses_what_no_backend_can_run() -> None:
    spec(uid=0, gid=65535, timeout_s=1.0, output_limit=1).check(65536)
    for bad in (dict(uid=65536), dict(gid=-1), dict(timeout_s=0.0), dict(timeout_s=-1.0),
                dict(output_limit=0)):
        with pytest.raises(BadRequest):
            spec(**bad).check(65536)
    with pytest.raises(BadRequest, match=r"id range 0\.\.9"):
        spec(uid=10).check(10)


def test_instance_subdir_is_plain_for_the_system_daemon_and_hashed_elsewhere(
        tmp_path: Path) -> None:
    assert instance_subdir("edged", tmp_path, tmp_path.resolve()) == "edged"
    a = instance_subdir("edged", tmp_path / "a", Path("/run/edged"))
    b = instance_subdir("edged", tmp_path / "b", Path("/run/edged"))
    assert a.startswith("edged-") and len(a) == len("edged-") + 10 and a != b
    assert a == instance_subdir("edged", tmp_path / "a", Path("/run/edged"))


def test_uid_slots_default_to_the_whole_grid(tmp_path: Path) -> None:
    s = UidSlots(tmp_path, uid_base=1 << 30, id_count=65536, directory=tmp_path / "slots")
    assert s.max_slots == ((1 << 32) - 2 - (1 << 30)) // 65536
    assert UidSlots(tmp_path, uid_base=0, id_count=10, max_slots=3,
                    directory=tmp_path / "s2").max_slots == 3
