"""sbx-init's exec deadline saturates: a timeout of 18446744074 s (timeout_ms * 10^6 past
2^64) once wrapped to a deadline in the past and killed the exec at once. The API bounds
timeout_s to a year (tests/edged/api); sbx-init must hold without that bound too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.conftest import Node, run, sh, spec

pytestmark = [pytest.mark.root, pytest.mark.mount]


def test_huge_timeout_does_not_wrap(node: Node, rootfs: Path) -> None:
    b = node.backend

    async def body() -> None:
        await b.create(spec(rootfs, "tmo"))
        try:
            for t in (18446744074.0, 1.8e16):
                out, _, end = await sh(b, "tmo", "sleep 0.5; echo ok", timeout_s=t)
                assert (end.reason, out) == ("exited", "ok\n"), (t, end)
            _, _, end = await sh(b, "tmo", "sleep 5", timeout_s=0.3)
            assert end.reason == "timeout" and end.duration_s < 3, end  # still enforced
        finally:
            await b.destroy("tmo")

    run(body)
