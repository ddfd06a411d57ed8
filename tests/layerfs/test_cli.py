"""Tests of the ``layerfs`` command, run as a subprocess like a user would."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from layerfs.store import DEFAULT_CHUNK_SIZE

MiB = 1 << 20


def layerfs(*args: str, store: Path | None, stdin: bytes | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "LAYERFS_STORE"}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "layerfs.cli", *args]
    if store is not None:
        cmd[3:3] = ["--store", str(store)]
    return subprocess.run(cmd, input=stdin.decode("latin-1") if stdin is not None else None,
                          capture_output=True, text=True, env=full_env, timeout=300)


def ok_json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no progress bar: stderr is not a TTY
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON object per command
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def failed(proc: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    if code == 1:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def make_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), 1_600_000_000, 0o644
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture()
def tarball(tmp_path: Path) -> Path:
    p = tmp_path / "layer.tar.gz"
    p.write_bytes(gzip.compress(make_tar({"etc/os-release": b"ID=test\n",
                                          "usr/bin/tool": os.urandom(3 * MiB + 5)})))
    return p


def test_build_tar_then_inspect_ls_verify_export_rm_gc(tmp_path: Path, tarball: Path) -> None:
    store = tmp_path / "store"
    out = tmp_path / "img.erofs"
    built = ok_json(layerfs("build", str(tarball), "--kind", "toolkit", "-o", str(out),
                            "--json", store=store))
    digest = built["digest"]
    image = out.read_bytes()
    assert digest == "sha256:" + hashlib.sha256(image).hexdigest()
    assert built["size"] == len(image) and built["kind"] == "toolkit"
    assert built["chunks"] == -(-len(image) // DEFAULT_CHUNK_SIZE)
    assert built["store"] == str(store)

    info = ok_json(layerfs("inspect", digest, "--json", store=store))
    assert info["digest"] == digest and info["size"] == len(image)
    assert info["source"] == f"tar:{tarball}" and len(info["chunks"]) == built["chunks"]
    assert ok_json(layerfs("inspect", digest[:15], "--json", store=store))["digest"] == digest

    finfo = ok_json(layerfs("inspect", str(out), "--json", store=store))
    assert finfo["digest"] == digest and finfo["size"] == len(image) and finfo["in_store"]
    sb = finfo["superblock"]
    assert sb["block_size"] == 4096 and sb["checksum_ok"] is True and sb["inodes"] >= 5
    assert "sb_chksum" in sb["features"]
    human = layerfs("inspect", str(out), store=store)
    assert human.returncode == 0 and "block size:  4096" in human.stdout

    listing = ok_json(layerfs("ls", "--json", store=store))
    assert [la["digest"] for la in listing["layers"]] == [digest]
    assert listing["layers"][0]["kind"] == "toolkit"
    human = layerfs("ls", store=store)
    assert human.returncode == 0 and digest[:19] in human.stdout and "toolkit" in human.stdout

    ver = ok_json(layerfs("verify", "--json", store=store))
    assert ver["ok"] and ver["layers_checked"] == 1

    exp = tmp_path / "exported.erofs"
    ok_json(layerfs("export", digest, "-o", str(exp), "--json", store=store))
    assert exp.read_bytes() == image

    assert ok_json(layerfs("gc", "--json", store=store))["chunks_removed"] == 0
    assert ok_json(layerfs("rm", digest, "--json", store=store)) == {"removed": digest}
    assert ok_json(layerfs("ls", "--json", store=store))["layers"] == []
    dry = ok_json(layerfs("gc", "--dry-run", "--json", store=store))
    assert dry["dry_run"] and dry["chunks_removed"] >= 1
    gc = ok_json(layerfs("gc", "--json", store=store))
    assert gc["chunks_removed"] == dry["chunks_removed"]
    assert ok_json(layerfs("gc", "--json", store=store))["chunks_removed"] == 0


def test_build_directory_human_output_and_env_store(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "motd").write_text("hi\n")
    store = tmp_path / "envstore"
    proc = layerfs("build", str(src), "--kind", "workspace", store=None,
                   env={"LAYERFS_STORE": str(store)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sha256:") and "workspace" in proc.stdout
    digest = proc.stdout.split()[0]
    listing = ok_json(layerfs("ls", "--json", store=store))
    assert [la["digest"] for la in listing["layers"]] == [digest]
    assert listing["layers"][0]["source"] == f"dir:{src}"


def test_build_clamp_mtime_is_asked_for(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    os.utime(src / "f", (1_650_000_000, 1_650_000_000))
    os.utime(src, (1_600_000_000, 1_600_000_000))
    store = tmp_path / "store"
    env = {"SOURCE_DATE_EPOCH": "1500000000"}
    plain = ok_json(layerfs("build", str(src), "--kind", "base", "--json", store=store,
                            env=env))
    clamped = ok_json(layerfs("build", str(src), "--kind", "base", "--json", "--clamp-mtime",
                              store=store, env=env))
    assert plain["digest"] != clamped["digest"]
    os.utime(src / "f", (1_550_000_000, 1_550_000_000))  # also after the epoch
    again = ok_json(layerfs("build", str(src), "--kind", "base", "--json", "--clamp-mtime",
                            store=store, env=env))
    assert again["digest"] == clamped["digest"]
    unset = layerfs("build", str(src), "--kind", "base", "--clamp-mtime", store=store,
                    env={"SOURCE_DATE_EPOCH": ""})
    assert unset.returncode != 0 and "SOURCE_DATE_EPOCH" in unset.stderr


def test_build_from_stdin_and_no_store(tmp_path: Path) -> None:
    raw = make_tar({"a": b"x" * 10_000})
    store = tmp_path / "store"
    built = ok_json(layerfs("build", "-", "--kind", "base", "--json", "--chunk-size", "64K",
                            store=store, stdin=raw))
    info = ok_json(layerfs("inspect", built["digest"], "--json", store=store))
    assert info["source"] == "tar:-" and info["chunk_size"] == 64 << 10
    out = tmp_path / "only.erofs"
    tarf = tmp_path / "a.tar"
    tarf.write_bytes(raw)
    other = tmp_path / "unused-store"
    nostore = ok_json(layerfs("build", str(tarf), "--kind", "base", "--no-store", "-o",
                              str(out), "--json", store=other))
    assert nostore["digest"] == built["digest"]  # same tree, same bytes
    assert not other.exists()
    assert "store" not in nostore


def test_errors_exit_codes_and_messages(tmp_path: Path, tarball: Path) -> None:
    store = tmp_path / "store"
    err = failed(layerfs("ls", store=store))
    assert "no layer store at" in err
    err = failed(layerfs("build", str(tmp_path / "nope"), "--kind", "base", store=store))
    assert "nope: no such file or directory" in err
    failed(layerfs("build", str(tarball), "--kind", "rootfs", store=store), code=2)
    failed(layerfs("build", str(tarball), store=store), code=2)
    failed(layerfs("build", str(tarball), "--kind", "base", "--chunk-size", "5000",
                   store=store), code=2)
    failed(layerfs("frobnicate", store=store), code=2)
    failed(layerfs("build", str(tarball), "--kind", "base", "--no-store", store=store),
           code=2)

    bad = tmp_path / "bad.tar"
    bad.write_bytes(make_tar({"x": os.urandom(9000)})[:2048])
    err = failed(layerfs("build", str(bad), "--kind", "base", store=store))
    assert "layerfs: " in err

    built = ok_json(layerfs("build", str(tarball), "--kind", "base", "--json", store=store))
    digest = built["digest"]
    missing = "sha256:" + "e" * 64
    assert "is not in store" in failed(layerfs("inspect", missing, store=store))
    assert "is not in store" in failed(layerfs("export", missing, "-o",
                                               str(tmp_path / "x"), store=store))
    assert "no such image file" in failed(layerfs("inspect", "not-a-thing", store=store))
    assert "is not in store" in failed(layerfs("rm", missing, store=store))

    # Corrupt one chunk: verify names it and fails, export refuses and writes nothing.
    first = ok_json(layerfs("inspect", digest, "--json", store=store))["chunks"][1]["digest"]
    cfile = store / "chunks" / first[7:9] / first[7:]
    raw = bytearray(cfile.read_bytes())
    raw[-10] ^= 0xFF
    cfile.write_bytes(bytes(raw))
    proc = layerfs("verify", "--json", store=store)
    assert proc.returncode == 1
    rep = json.loads(proc.stdout)
    assert list(rep["bad_chunks"]) == [first] and list(rep["bad_layers"]) == [digest]
    assert "bad chunks" in proc.stderr
    human = layerfs("verify", digest, store=store)
    assert human.returncode == 1 and f"chunk {first}" in human.stdout
    err = failed(layerfs("export", digest, "-o", str(tmp_path / "e.erofs"), store=store))
    assert first in err
    assert not (tmp_path / "e.erofs").exists()

    (store / "layout-version").write_text("9\n")
    assert "layout version '9'" in failed(layerfs("ls", store=store))
