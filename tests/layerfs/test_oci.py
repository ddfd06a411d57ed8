"""layerfs.sources.oci: index → manifest → verified layer blobs → trees."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest
import zstandard

from layerfs.errors import ImageFormatError, InvalidSourceError
from layerfs.sources.oci import load_oci
from layerfs.sources.tar import load_tar
from layerfs.writer import write_image
from tests.layerfs.conftest import fsck_erofs

OCI = "application/vnd.oci.image"
TAR, TGZ, TZST = f"{OCI}.layer.v1.tar", f"{OCI}.layer.v1.tar+gzip", f"{OCI}.layer.v1.tar+zstd"
MANIFEST, INDEX = f"{OCI}.manifest.v1+json", f"{OCI}.index.v1+json"

# An entry: (path, content) for a file, (path, None) for a directory,
# (path, "->target") for a symlink, (path, "=>target") for a hardlink.
Spec = list[tuple[str, str | None]]


def make_tar(entries: Spec, *, mtime: float = 1_700_000_000.25, uid: int = 0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, content in entries:
            info = tarfile.TarInfo(path)
            info.mtime = mtime  # type: ignore[assignment]  # a float makes a pax mtime
            info.uid = info.gid = uid
            data = b""
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif content.startswith("->"):
                info.type, info.linkname = tarfile.SYMTYPE, content[2:]
            elif content.startswith("=>"):
                info.type, info.linkname = tarfile.LNKTYPE, content[2:]
            else:
                data = content.encode()
                info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def compress(data: bytes, media_type: str) -> bytes:
    if media_type.endswith("gzip"):
        return gzip.compress(data, mtime=0)
    if media_type.endswith("zstd"):
        return zstandard.ZstdCompressor().compress(data)
    return data


def put_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def put_json(layout: Path, doc: dict[str, Any], media_type: str) -> dict[str, Any]:
    return {"mediaType": media_type,
            **put_blob(layout, json.dumps(doc, sort_keys=True).encode())}


def make_layout(layout: Path, layers: list[tuple[bytes, str]], *, ref: str | None = "v1",
                nested: bool = False, extra_manifests: int = 0) -> dict[str, Any]:
    """Write an OCI layout holding one image of ``layers`` (tar bytes, media type).
    Returns the manifest document (to let tests spoil it)."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    config = put_json(layout, {"architecture": "amd64", "os": "linux"},
                      f"{OCI}.config.v1+json")
    descs = [{"mediaType": mt, **put_blob(layout, compress(data, mt))} for data, mt in layers]
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": config, "layers": descs}
    top = put_json(layout, manifest, MANIFEST)
    if nested:
        other = put_json(layout, {**manifest, "layers": []}, MANIFEST)
        sub = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [
            {**other, "platform": {"os": "linux", "architecture": "arm64"}},
            {**top, "platform": {"os": "linux", "architecture": "amd64"}},
        ]}
        top = put_json(layout, sub, INDEX)
    if ref is not None:
        top["annotations"] = {"org.opencontainers.image.ref.name": ref}
    entries = [top] + [
        {**put_json(layout, {**manifest, "layers": []}, MANIFEST),
         "annotations": {"org.opencontainers.image.ref.name": f"other{i}"}}
        for i in range(extra_manifests)
    ]
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": entries}))
    return manifest


def rewrite_index(layout: Path, manifest: dict[str, Any]) -> None:
    """Store a changed manifest and point index.json at it."""
    desc = put_json(layout, manifest, MANIFEST)
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


BASE: Spec = [("etc", None), ("etc/passwd", "root"), ("etc/hosts", "h"), ("bin", None),
              ("bin/sh", "sh"), ("bin/ash", "=>bin/sh")]
TOP: Spec = [("etc", None), ("etc/.wh.hosts", ""), ("bin", None), ("bin/.wh..wh..opq", ""),
             ("bin/bash", "bash"), ("sh", "->bin/bash")]


def test_layers_per_layer_with_whiteouts(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE), TAR), (make_tar(TOP), TGZ),
                         (make_tar([("z", "zz")]), TZST)])
    layers = load_oci(layout, "v1", workdir=workdir)
    assert [lay.index for lay in layers] == [0, 1, 2]
    assert [lay.media_type for lay in layers] == [TAR, TGZ, TZST]
    base, top, third = (lay.tree for lay in layers)
    sh = base.get("bin/sh")
    assert sh is not None and sh.data is not None and base.get("bin/ash") is sh
    # The plain layer is read in place from its (verified) blob.
    assert sh.data.path == str(layout / "blobs" / "sha256" / layers[0].blob_digest[7:])
    assert sh.mtime_ns == 1_700_000_000_250_000_000
    hosts = top.get("etc/hosts")
    assert hosts is not None and hosts.is_whiteout
    assert top.get("etc").xattrs[b"trusted.overlay.origin"] == b""  # type: ignore[union-attr]
    assert top.get("bin").xattrs[b"trusted.overlay.opaque"] == b"y"  # type: ignore[union-attr]
    assert top.get("bin/.wh..wh..opq") is None
    assert third.get("z") is not None
    assert sorted(p.suffix for p in workdir.iterdir()) == [".spool", ".spool"]


def test_flatten(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE), TGZ), (make_tar(TOP), TZST)], ref=None)
    (merged,) = load_oci(layout, workdir=workdir, flatten=True)
    assert merged.media_type == MANIFEST and merged.index == 0 and len(merged.blobs) == 2
    paths = {b"/".join(p).decode() for p, _ in merged.tree.walk()}
    assert paths == {"", "etc", "etc/passwd", "bin", "bin/bash", "sh"}
    for _, node in merged.tree.walk():
        assert not node.is_whiteout and not node.xattrs


def test_whiteout_of_a_255_byte_name(tmp_path: Path, workdir: Path, scratch: Path) -> None:
    # Its marker is 259 bytes (".wh." + 255); docker writes and applies such markers, and
    # they were once refused as "component longer than 255 bytes".
    name = "n" * 255
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar([("d", None), (f"d/{name}", "x"), ("d/keep", "k")]), TAR),
                         (make_tar([("d", None), (f"d/.wh.{name}", "")]), TGZ)])
    _, upper = load_oci(layout, "v1", workdir=workdir)
    ghost = upper.tree.get(f"d/{name}")
    assert ghost is not None and ghost.is_whiteout
    assert upper.tree.get("d").children.keys() == {name.encode()}  # type: ignore[union-attr]
    write_image(upper.tree, scratch / "upper.erofs")
    fsck_erofs(scratch / "upper.erofs")
    (flat,) = load_oci(layout, "v1", workdir=workdir, flatten=True)
    assert flat.tree.get("d").children.keys() == {b"keep"}  # type: ignore[union-attr]


def test_long_marker_outside_an_oci_layer_is_refused_at_write(workdir: Path,
                                                              scratch: Path) -> None:
    # A plain tar's ".wh." files are ordinary names: one over 255 bytes cannot be stored.
    tree = load_tar(io.BytesIO(make_tar([(".wh." + "n" * 255, "")])), workdir=workdir)
    with pytest.raises(ImageFormatError, match=r"name length 259 not in 1\.\.255"):
        write_image(tree, scratch / "img.erofs")
    with pytest.raises(InvalidSourceError, match="longer than 255"):
        load_tar(io.BytesIO(make_tar([(".wh." + "n" * 256, "")])), workdir=workdir)
    with pytest.raises(InvalidSourceError, match="longer than 255"):
        load_tar(io.BytesIO(make_tar([(".wh." + "n" * 255 + "/x", "")])), workdir=workdir)


def test_nested_index_picks_linux_amd64(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE), TAR)], nested=True)
    (layer,) = load_oci(layout, "v1", workdir=workdir)
    assert layer.tree.get("etc/passwd") is not None


def test_ref_selection(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE), TAR)], extra_manifests=2)
    assert len(load_oci(layout, "v1", workdir=workdir)) == 1
    assert load_oci(layout, "other1", workdir=workdir) == []
    with pytest.raises(InvalidSourceError, match=r"3 manifests \['other0', 'other1', 'v1'\]"):
        load_oci(layout, workdir=workdir)
    with pytest.raises(InvalidSourceError, match="0 manifests named 'nope'"):
        load_oci(layout, "nope", workdir=workdir)


def _spoil_layer(layout: Path, manifest: dict[str, Any], **changes: Any) -> None:
    manifest["layers"][-1].update(changes)
    rewrite_index(layout, manifest)


@pytest.mark.parametrize(("changes", "match"), [
    ({"digest": "sha256:../../../etc/passwd"}, "bad digest"),
    ({"digest": "sha256:" + "0" * 64}, "blob missing"),
    ({"digest": "md5:" + "0" * 32}, "bad digest"),
    ({"digest": "sha256:" + "A" * 64}, "bad digest"),
    ({"size": 3}, "size differs"),
    ({"size": -1}, "bad size"),
    ({"size": True}, "bad size"),
    ({"urls": ["https://example.com/x"]}, "foreign blob"),
    ({"mediaType": "application/x-tar+lz4"}, "unsupported media type"),
])
def test_bad_layer_descriptors_rejected(tmp_path: Path, workdir: Path,
                                        changes: dict[str, Any], match: str) -> None:
    layout = tmp_path / "img"
    manifest = make_layout(layout, [(make_tar(BASE), TGZ), (make_tar(TOP), TGZ)])
    _spoil_layer(layout, manifest, **changes)
    with pytest.raises(InvalidSourceError, match=f"layer 1.*{match}"):
        load_oci(layout, workdir=workdir)
    assert list(workdir.iterdir()) == []  # layer 0's spool file is gone too


def test_blob_content_verified_before_use(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE), TAR)])
    (layer,) = load_oci(layout, "v1", workdir=workdir)
    blob = layout / "blobs" / "sha256" / layer.blob_digest[7:]
    data = bytearray(blob.read_bytes())
    data[600] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(InvalidSourceError, match="does not match its digest"):
        load_oci(layout, "v1", workdir=workdir)


def test_blob_symlink_out_of_layout_rejected(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE), TAR)])
    (layer,) = load_oci(layout, "v1", workdir=workdir)
    blob = layout / "blobs" / "sha256" / layer.blob_digest[7:]
    outside = tmp_path / "outside"
    blob.rename(outside)
    blob.symlink_to(outside)
    with pytest.raises(InvalidSourceError, match="outside the layout"):
        load_oci(layout, "v1", workdir=workdir)


def test_hostile_layer_names_layer_and_entry(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    evil = make_tar([("a", "->/etc"), ("a/passwd", "x")])
    make_layout(layout, [(make_tar(BASE), TGZ), (evil, TGZ)])
    with pytest.raises(InvalidSourceError, match=r"layer 1 sha256:.*a/passwd.*symlink"):
        load_oci(layout, workdir=workdir)
    assert list(workdir.iterdir()) == []


def test_odd_whiteout_rejected_and_spools_removed(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar([("d", None), ("d/.wh.x", "data")]), TGZ)])
    for flat in (False, True):
        with pytest.raises(InvalidSourceError, match=r"layer 0 .*/d/\.wh\.x.*empty regular"):
            load_oci(layout, workdir=workdir, flatten=flat)
        assert list(workdir.iterdir()) == []


def test_compression_detected_from_bytes(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    manifest = make_layout(layout, [(make_tar(BASE), TGZ)])
    manifest["layers"][0]["mediaType"] = TAR  # mislabelled: gzip bytes, plain type
    rewrite_index(layout, manifest)
    (layer,) = load_oci(layout, workdir=workdir)
    assert layer.tree.get("bin/sh") is not None


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: (d / "oci-layout").unlink(), "oci-layout missing"),
    (lambda d: (d / "oci-layout").write_text("{}"), "imageLayoutVersion"),
    (lambda d: (d / "index.json").write_text("{"), "not valid JSON"),
    (lambda d: (d / "index.json").write_text("[]"), "not a JSON object"),
    (lambda d: (d / "index.json").write_text('{"manifests": 3}'), "not a list"),
    (lambda d: (d / "index.json").write_text("[" * 100000 + "]" * 100000), "JSON"),
])
def test_bad_layout_files_rejected(tmp_path: Path, workdir: Path, mutate: Any,
                                   match: str) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [(make_tar(BASE), TAR)])
    mutate(layout)
    with pytest.raises(InvalidSourceError, match=match):
        load_oci(layout, workdir=workdir)


def test_manifest_must_be_a_manifest(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    make_layout(layout, [])
    desc = put_json(layout, {"schemaVersion": 2, "mediaType": INDEX, "manifests": [
        {**put_json(layout, {"layers": []}, MANIFEST),
         "platform": {"os": "linux", "architecture": "arm64"}}]}, INDEX)
    (layout / "index.json").write_text(json.dumps({"manifests": [desc]}))
    with pytest.raises(InvalidSourceError, match="no linux/amd64"):
        load_oci(layout, workdir=workdir)
    desc = put_json(layout, {"layers": []}, "application/vnd.example+json")
    (layout / "index.json").write_text(json.dumps({"manifests": [desc]}))
    with pytest.raises(InvalidSourceError, match="unsupported media type"):
        load_oci(layout, workdir=workdir)


def test_docker_media_types(tmp_path: Path, workdir: Path) -> None:
    layout = tmp_path / "img"
    manifest = make_layout(layout, [(make_tar(BASE), TGZ)])
    manifest["mediaType"] = "application/vnd.docker.distribution.manifest.v2+json"
    manifest["layers"][0]["mediaType"] = "application/vnd.docker.image.rootfs.diff.tar.gzip"
    desc = put_json(layout, manifest, manifest["mediaType"])
    (layout / "index.json").write_text(json.dumps({"manifests": [desc]}))
    (layer,) = load_oci(layout, workdir=workdir)
    assert stat.S_ISREG(layer.tree.get("etc/passwd").mode)  # type: ignore[union-attr]
    assert os.listdir(workdir)
