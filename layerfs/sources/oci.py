"""OCI image layouts as layer trees: ``index.json`` → manifest → layer blobs.

Facts from the OCI image-spec v1.1 (``image-layout.md``, ``image-index.md``,
``manifest.md``, ``descriptor.md``, ``layer.md``) and Docker's registry schema 2 media
types, which image tools still write into layouts.

- The layout must have an ``oci-layout`` file with an ``imageLayoutVersion``.
- ``ref`` selects the ``index.json`` entry whose ``org.opencontainers.image.ref.name``
  annotation equals it; without ``ref`` the index must hold exactly one entry.
- That entry is a manifest, or an image index (one level of nesting) from which the
  ``linux``/``amd64`` manifest is taken.
- Every blob is named by its digest, ``sha256:<64 hex>`` or ``sha512:<128 hex>``, and
  found at ``blobs/<alg>/<hex>``; any other digest shape is refused, so no descriptor
  can name a path outside the layout, and a blob that resolves (through symlinks) outside
  the layout is refused too. A blob's size must equal its descriptor's and its hash is
  verified before anything in it is used. Descriptors with ``urls`` (foreign layers) are
  refused: they cannot be read from the layout.
- Layers: media types ``...layer.v1.tar`` (``+gzip``, ``+zstd``, also the
  ``nondistributable`` variants) and Docker's ``...rootfs.diff.tar[.gzip]``. The
  compression actually used is detected from the blob's bytes (:func:`load_tar`), since
  tools do mislabel; any other media type is refused.

Each layer becomes a tree with :func:`~layerfs.sources.tar.load_tar`; its whiteouts are
converted per layer (:func:`~layerfs.sources.whiteout.convert_layer`) or, with
``flatten=True``, all layers are applied in order into one tree
(:func:`~layerfs.sources.whiteout.flatten`). Problems raise
:class:`~layerfs.errors.InvalidSourceError` naming the file or descriptor; on error every
spool file this call made in ``workdir`` is removed and nothing is returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from layerfs.errors import InvalidSourceError
from layerfs.sources.tar import load_tar
from layerfs.sources.whiteout import LowerDirs, convert_layer
from layerfs.sources.whiteout import flatten as flatten_trees
from layerfs.tree import Tree

REF_ANNOTATION = "org.opencontainers.image.ref.name"
MAX_JSON = 4 << 20  # index and manifest blobs; real ones are a few KiB

MANIFEST_TYPES = frozenset({
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
})
INDEX_TYPES = frozenset({
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
})
LAYER_TYPES = frozenset({
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
})
_DIGEST = re.compile(r"(sha256):([0-9a-f]{64})|(sha512):([0-9a-f]{128})")


@dataclass
class OciLayer:
    """One layer read from a layout.

    ``tree`` is the layer's tree (overlay whiteouts per layer, or none when flattened).
    ``blob_digest`` is the layer blob's digest (``sha256:<hex>``); for a flattened result
    it is the manifest's digest. ``media_type`` is the blob's media type (the manifest's
    for a flattened result). ``index`` is the layer's position in the manifest, bottom
    first (0 for a flattened result). ``blobs`` lists the layer digests that went in.
    """

    tree: Tree
    blob_digest: str
    media_type: str
    index: int
    blobs: tuple[str, ...] = ()


class _Layout:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.label = root

    def fail(self, msg: str) -> InvalidSourceError:
        return InvalidSourceError(f"OCI layout {self.label}: {msg}")

    def blob_path(self, desc: Any, what: str) -> tuple[str, str, int]:
        """(path, digest, size) of the blob a descriptor names, checked for shape."""
        if not isinstance(desc, dict):
            raise self.fail(f"{what}: descriptor is not an object")
        digest = desc.get("digest")
        size = desc.get("size")
        if not isinstance(digest, str) or _DIGEST.fullmatch(digest) is None:
            raise self.fail(f"{what}: bad digest {digest!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise self.fail(f"{what} {digest}: bad size {size!r}")
        if desc.get("urls"):
            raise self.fail(f"{what} {digest}: foreign blob (urls) is not in the layout")
        alg, hexdigest = digest.split(":", 1)
        path = os.path.join(self.root, "blobs", alg, hexdigest)
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.root]) != self.root:
            raise self.fail(f"{what} {digest}: blob resolves outside the layout")
        return real, digest, size

    def verify(self, path: str, digest: str, size: int, what: str) -> None:
        """Check the blob's size and hash, streaming (no whole-blob buffer)."""
        alg, want = digest.split(":", 1)
        h = hashlib.new(alg)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != size:
                    raise self.fail(f"{what} {digest}: size differs from the descriptor's "
                                    f"{size}")
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except FileNotFoundError:
            raise self.fail(f"{what} {digest}: blob missing") from None
        except IsADirectoryError:
            raise self.fail(f"{what} {digest}: blob is a directory") from None
        if h.hexdigest() != want:
            raise self.fail(f"{what} {digest}: content does not match its digest")

    def json_file(self, path: str, what: str) -> Any:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_JSON + 1)
        except FileNotFoundError:
            raise self.fail(f"{what} missing") from None
        except IsADirectoryError:
            raise self.fail(f"{what} is a directory") from None
        if len(raw) > MAX_JSON:
            raise self.fail(f"{what} larger than {MAX_JSON} bytes")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise self.fail(f"{what}: not valid JSON ({exc})") from None

    def json_blob(self, desc: Any, what: str) -> tuple[Any, str]:
        path, digest, size = self.blob_path(desc, what)
        if size > MAX_JSON:
            raise self.fail(f"{what} {digest}: larger than {MAX_JSON} bytes")
        self.verify(path, digest, size, what)
        doc = self.json_file(path, f"{what} {digest}")
        if not isinstance(doc, dict):
            raise self.fail(f"{what} {digest}: not a JSON object")
        return doc, digest


def _media_type(desc: dict[str, Any], doc: dict[str, Any] | None = None) -> str:
    mt = desc.get("mediaType")
    if not isinstance(mt, str) and doc is not None:
        mt = doc.get("mediaType")
    return mt if isinstance(mt, str) else ""


def _select(layout: _Layout, index: dict[str, Any], ref: str | None) -> dict[str, Any]:
    entries = index.get("manifests")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise layout.fail("index.json: 'manifests' is not a list of descriptors")
    if ref is None:
        if len(entries) != 1:
            names = sorted(str((e.get("annotations") or {}).get(REF_ANNOTATION, "?"))
                           for e in entries)
            raise layout.fail(f"index.json holds {len(entries)} manifests {names}; "
                              "name one with ref")
        found: dict[str, Any] = entries[0]
        return found
    matches = [e for e in entries
               if isinstance(e.get("annotations"), dict)
               and e["annotations"].get(REF_ANNOTATION) == ref]
    if len(matches) != 1:
        raise layout.fail(f"index.json: {len(matches)} manifests named {ref!r}")
    match: dict[str, Any] = matches[0]
    return match


def _is_linux_amd64(desc: dict[str, Any]) -> bool:
    platform = desc.get("platform")
    return (isinstance(platform, dict) and platform.get("os") == "linux"
            and platform.get("architecture") == "amd64")


def _manifest(layout: _Layout, desc: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    doc, digest = layout.json_blob(desc, "manifest")
    mt = _media_type(desc, doc)
    if mt in INDEX_TYPES:
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise layout.fail(f"image index {digest}: 'manifests' is not a list")
        picks = [e for e in entries if isinstance(e, dict) and _is_linux_amd64(e)]
        if not picks:
            raise layout.fail(f"image index {digest}: no linux/amd64 manifest")
        desc = picks[0]
        doc, digest = layout.json_blob(desc, "manifest")
        mt = _media_type(desc, doc)
        if mt in INDEX_TYPES:
            raise layout.fail(f"image index {digest}: indexes nested more than one level")
    if mt not in MANIFEST_TYPES:
        raise layout.fail(f"manifest {digest}: unsupported media type {mt!r}")
    return doc, digest, mt


def load_oci(layout: str | os.PathLike[str], ref: str | None = None, *,
             workdir: str | os.PathLike[str], flatten: bool = False) -> list[OciLayer]:
    """Read the image ``ref`` of the OCI image layout directory ``layout``.

    Returns one :class:`OciLayer` per layer of the manifest, bottom first, each with its
    whiteouts in overlayfs form; with ``flatten=True``, one :class:`OciLayer` holding all
    layers applied in order (no whiteouts left). ``workdir`` receives the spool files of
    compressed layers (one per layer, see :func:`~layerfs.sources.tar.load_tar`); keep it
    until the images are written. Uncompressed layer blobs are referenced in place.

    Raises :class:`~layerfs.errors.InvalidSourceError` (a ``ValueError``) naming the file,
    descriptor or entry for a malformed or hostile layout (rules: module docstring);
    nothing is left in ``workdir`` then.
    """
    lay = _Layout(os.fspath(layout))
    wd = os.fspath(workdir)
    marker = lay.json_file(os.path.join(lay.root, "oci-layout"), "oci-layout")
    if not isinstance(marker, dict) or not isinstance(marker.get("imageLayoutVersion"), str):
        raise lay.fail("oci-layout has no imageLayoutVersion")
    index = lay.json_file(os.path.join(lay.root, "index.json"), "index.json")
    if not isinstance(index, dict):
        raise lay.fail("index.json is not a JSON object")
    manifest, mdigest, mtype = _manifest(lay, _select(lay, index, ref))
    descs = manifest.get("layers")
    if not isinstance(descs, list):
        raise lay.fail(f"manifest {mdigest}: 'layers' is not a list")

    layers: list[OciLayer] = []
    lower_dirs = LowerDirs()
    try:
        for i, desc in enumerate(descs):
            what = f"layer {i}"
            path, digest, size = lay.blob_path(desc, what)
            mt = _media_type(desc)
            if mt not in LAYER_TYPES:
                raise lay.fail(f"{what} {digest}: unsupported media type {mt!r}")
            lay.verify(path, digest, size, what)
            label = f"{lay.label} {what} {digest}"
            try:
                tree = load_tar(path, workdir=wd, name=label)
            except IsADirectoryError:
                raise lay.fail(f"{what} {digest}: blob is a directory") from None
            layers.append(OciLayer(tree=tree, blob_digest=digest, media_type=mt, index=i,
                                   blobs=(digest,)))
            if not flatten:
                convert_layer(tree, label=label)
                lower_dirs.apply(tree)
        if not flatten:
            return layers
        merged = _flatten_layers(layers)
        return [OciLayer(tree=merged, blob_digest=mdigest, media_type=mtype, index=0,
                         blobs=tuple(layer.blob_digest for layer in layers))]
    except BaseException:
        _discard_spools(layers, wd)
        raise


def _discard_spools(layers: list[OciLayer], workdir: str) -> None:
    """Remove the spool files that the trees of ``layers`` reference in ``workdir`` (a
    failing load_tar has already removed its own)."""
    real = os.path.realpath(workdir)
    paths = {inode.data.path for layer in layers for _, inode in layer.tree.walk()
             if inode.data is not None}
    for path in paths:
        if os.path.dirname(os.path.realpath(path)) == real and path.endswith(".spool"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _flatten_layers(layers: list[OciLayer]) -> Tree:
    return flatten_trees((layer.tree for layer in layers),
                   labels=(f"layer {layer.index} {layer.blob_digest}" for layer in layers))
