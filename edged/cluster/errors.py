"""Errors of the cluster client, beside the node SDK's (:mod:`edged.client.errors`), which
it raises as they are for what a node said."""

from __future__ import annotations

from edged.client.errors import DaemonUnavailableError, SandboxError


class ClusterError(SandboxError, RuntimeError):
    """The cluster cannot serve the call: no node has joined its Ray cluster, or none meets
    the placement's constraints."""

    code = "cluster"


class SandboxLostError(SandboxError, LookupError):
    """``sandbox_lost``: the sandbox's node is not up (its daemon does not answer, its relay
    stopped reporting, or it left): the sandbox may be gone with it. ``node``: its node;
    ``cause``: what the registry knows (when and why the node stopped). Not a
    :class:`~edged.client.NotFoundError`: a kill of a lost sandbox is not silently done."""

    code = "sandbox_lost"

    def __init__(self, message: str, *, node: str, cause: str = "") -> None:
        super().__init__(message, code=self.code)
        self.node = node
        self.cause = cause


class NodeUnavailableError(DaemonUnavailableError):
    """``node_unavailable``: a node's relay (Ray actor) or daemon did not answer, and the
    registry still counts the node as up (it may be restarting)."""

    code = "node_unavailable"


class RelayUnreachableError(DaemonUnavailableError):
    """A node's HTTP relay could not be connected to, or refused this client's token (it
    restarted with another): nothing reached the daemon, so the call may go through the
    node's relay actor instead (the cluster client does so)."""

    code = "relay_unreachable"
