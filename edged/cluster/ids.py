"""Node names and the sandbox ids that name their node.

A sandbox placed through the cluster gets the id ``<node>.<name>``: ``<node>`` is the name
the node joined with, ``<name>`` the caller's id or 12 random hex digits. So any client,
however new, finds a sandbox's node from its id alone, with no lookup in shared state (DSec
§3.2: the sandbox id encodes the edge that owns it, so the stateless API servers route
without per-sandbox state).

Node names are ``[a-z0-9][a-z0-9_-]{0,31}``: no ``.``, so the first ``.`` of an id ends the
node's part; together they stay within the daemon's id rule ``[a-z0-9][a-z0-9_.-]{0,62}``.
"""

from __future__ import annotations

import re
import secrets
import socket

from edged.client.errors import BadRequestError

NODE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
#: the daemon's sandbox id rule (``edged.api.requests``)
SANDBOX_ID = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")


def check_node_name(name: str) -> str:
    """``name`` if it is a valid node name; :class:`BadRequestError` otherwise."""
    if not isinstance(name, str) or not NODE_NAME.fullmatch(name):
        raise BadRequestError(f"node name {name!r}: must match {NODE_NAME.pattern}",
                              status=400)
    return name


def default_node_name(hostname: str | None = None) -> str:
    """A node name from the host name: lower case, other characters than ``[a-z0-9_-]``
    as ``-``, the first label only, at most 32 characters (``node`` if nothing is left)."""
    host = (hostname if hostname is not None else socket.gethostname()).split(".")[0].lower()
    name = re.sub(r"[^a-z0-9_-]", "-", host).lstrip("-_")[:32]
    return name or "node"


def make_id(node: str, name: str | None = None) -> str:
    """The id of a sandbox on ``node``: ``<node>.<name>`` (``name`` random if None).
    Raises :class:`BadRequestError` if the result is no valid sandbox id."""
    check_node_name(node)
    sid = f"{node}.{name if name is not None else secrets.token_hex(6)}"
    if not SANDBOX_ID.fullmatch(sid):
        raise BadRequestError(f"id {name!r}: {sid!r} is no valid sandbox id (at most 63 "
                              f"characters of [a-z0-9_.-], the node's name included)",
                              status=400)
    return sid


def node_of(sandbox_id: str) -> str | None:
    """The node a cluster sandbox id names, or None for an id without one (a sandbox made
    on its node directly, not through the cluster)."""
    node, sep, rest = sandbox_id.partition(".")
    if not sep or not rest or not NODE_NAME.fullmatch(node):
        return None
    return node
