"""A node's exec stream cut before its end event says the node is unavailable (or its
sandbox lost), over the HTTP relay and straight to a daemon on this host alike.

Found at load: ``test_a_node_whose_relay_dies_is_dead_and_its_sandboxes_lost`` got a bare
``SandboxError`` ("exec stream ended without an end event") from an exec through an HTTP
relay that was going away, where the cluster client says ``NodeUnavailableError`` or
``SandboxLostError``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the cluster client needs Ray (pip install edged[test])")

from edged.client import Sandbox
from edged.client.errors import SandboxError
from edged.cluster.errors import NodeUnavailableError
from edged.cluster.transport import DirectTransport, HttpRelayTransport
from tests.edged.client.test_stream_cut import serving

SEEN: list[tuple[str, BaseException]] = []


def on_fail(node: str, e: BaseException) -> SandboxError:
    SEEN.append((node, e))
    return NodeUnavailableError(f"node {node}: {e}")


@pytest.mark.parametrize("how", ["clean", "abort", "truncated"])
@pytest.mark.parametrize("route", ["http", "direct"])
def test_a_cut_exec_stream_is_the_node_unavailable(tmp_path: Path, how: str, route: str) -> None:
    sock = str(tmp_path / "d.sock")
    SEEN.clear()
    with serving(how, sock) as port:
        if route == "http":
            t: DirectTransport | HttpRelayTransport = HttpRelayTransport(
                "n1", f"http://127.0.0.1:{port}", "token", relay=None,  # type: ignore[arg-type]
                on_fail=on_fail)
        else:
            t = DirectTransport("n1", sock, on_fail)
        sbx = Sandbox({"id": "n1.x", "state": "running"}, t)
        with pytest.raises(NodeUnavailableError, match="end event"):
            sbx.exec("echo hi")
        assert [n for n, _ in SEEN] == ["n1"]
        if isinstance(t, HttpRelayTransport):
            t.close()
