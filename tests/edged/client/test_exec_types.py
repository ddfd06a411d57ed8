"""The SDK's ``exec`` keeps exact types for its callers under ``mypy --strict`` with its options
written once (:class:`edged.client._common.ExecOptions`, ``**opts: Unpack[...]``): the result
type follows ``background``, each option is checked by type, and an unknown one is refused, by
mypy and at run time."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from mypy import api

from edged.client._common import ExecOptions, exec_request

ROOT = Path(__file__).resolve().parents[3]

CALLER = textwrap.dedent('''
    from typing import assert_type

    from edged.client import AsyncSandbox, ExecResult, Sandbox
    from edged.client.process import ProcessHandle


    def sync(s: Sandbox) -> None:
        assert_type(s.exec("true"), ExecResult)
        assert_type(s.exec(["true"], timeout=1.0, env={"A": "1"}, check=True), ExecResult)
        assert_type(s.exec("cat", background=True, on_stdout=print), ProcessHandle)
        assert_type(s.exec("true", background=False, user="root"), ExecResult)
        s.exec("true", timeout="1")  # line 13: a str for a float
        s.exec("true", bogus=1)  # line 14: no such option


    async def asy(s: AsyncSandbox) -> None:
        assert_type(await s.exec("true", cwd="/", kill_leftovers=True), ExecResult)
        await s.exec("true", background=True)  # line 19: not in the asyncio SDK
        await s.exec("true", output_limit="big")  # line 20
''')


def test_mypy_strict_sees_the_exact_types_of_exec(tmp_path: Path) -> None:
    caller = tmp_path / "caller.py"
    caller.write_text(CALLER)
    out, err, status = api.run(["--strict", "--no-error-summary", "--cache-dir",
                                str(ROOT / ".mypy_cache"), str(caller)])
    assert status == 1, out + err
    lines = sorted({int(m.group(1)) for m in re.finditer(r"caller\.py:(\d+): error", out)})
    assert lines == [13, 14, 19, 20], out


def test_an_unknown_option_is_refused_at_run_time_too() -> None:
    assert exec_request("true", ExecOptions(timeout=2.0)) == {
        "cmd": "true", "encoding": "base64", "timeout_s": 2.0}
    assert exec_request(["cat"], ExecOptions(), background=True)["stdin"] is True
    with pytest.raises(TypeError, match="'bogus'"):
        exec_request("true", {"bogus": 1})  # type: ignore[typeddict-unknown-key]
