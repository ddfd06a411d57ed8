"""The cluster clients' ``create`` take every argument of the SDK's ``create`` (the issue:
"same arguments as ``Sandbox.create``"), so a field added to the SDK is not silently missing
from the cluster."""

from __future__ import annotations

import inspect

import pytest

from edged.client import AsyncSandbox, Sandbox
from edged.cluster import AsyncClusterClient, ClusterClient

#: the SDK's arguments that name one node's daemon: the cluster picks the node instead (and a
#: full node's 503 is retried on another node by the placement, not by the SDK's ``retry``)
NODE_ONLY = {"cls", "socket", "retry"}
PLACEMENT = {"self", "node", "node_labels"}


@pytest.mark.parametrize("sdk, ours", [(Sandbox.create, ClusterClient.create),
                                          (AsyncSandbox.create, AsyncClusterClient.create)])
def test_create_takes_the_sdks_arguments(sdk: object, ours: object) -> None:
    want = set(inspect.signature(sdk).parameters) - NODE_ONLY  # type: ignore[arg-type]
    got = set(inspect.signature(ours).parameters)  # type: ignore[arg-type]
    assert want - got == set(), "missing from the cluster's create"
    assert got - want == PLACEMENT
