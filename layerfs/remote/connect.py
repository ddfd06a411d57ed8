"""Which :class:`~layerfs.remote.base.Remote` a URL names: the one place that knows every
kind of remote (so the interface in :mod:`.base` knows none of them)."""

from __future__ import annotations

from layerfs.remote.base import Remote


def open_remote(url: str, **kwargs: object) -> Remote:
    """The :class:`Remote` for ``url``: ``http://HOST:PORT`` or ``https://...`` or
    ``unix:/path`` (a chunk server), ``file:/path`` or an absolute path (a shared
    directory holding a layerfs store). Keyword arguments go to the remote's constructor.

    Raises ``ValueError`` (:class:`~layerfs.manifest.InvalidArgumentError`) for anything
    else.
    """
    from layerfs.manifest import InvalidArgumentError

    # each kind imported only when asked for (aiohttp alone costs ~0.1 s of start-up)
    if url.startswith(("http://", "https://", "unix:")):
        from layerfs.remote.http import HttpRemote

        return HttpRemote(url, **kwargs)  # type: ignore[arg-type]
    if url.startswith("file:") or url.startswith("/"):
        from layerfs.remote.directory import DirRemote

        return DirRemote(url.removeprefix("file:"), **kwargs)  # type: ignore[arg-type]
    raise InvalidArgumentError(
        f"remote {url!r}: want http://HOST:PORT, unix:/PATH, file:/PATH or /PATH")
