"""Fuzzing the tar parser: the kept corpus, and hypothesis mutations of valid archives.

Property (see fuzz_tar.check_one): a Tree or InvalidSourceError, never another
exception, never more than one spool file, nothing left behind after an error, every
data reference inside the spool file. Bounded to a few seconds; the coverage-guided
harness for longer runs is ``tests/layerfs/fuzz_tar.py``.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.layerfs.fuzz_tar import check_one, corpus_items
from tests.layerfs.test_tar import BLOCK

CORPUS = Path(__file__).parent / "corpus"
EXPECTED: dict[str, str] = json.loads((CORPUS / "EXPECTED.json").read_text())
SEEDS = [data for data, _ in corpus_items().values()]
PLAIN_SEEDS = [s for s in SEEDS if s[:2] != b"\x1f\x8b" and s[:4] != b"\x28\xb5\x2f\xfd"]
FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def workdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="tar-fuzz-") as d:
        yield d


def test_corpus_is_complete() -> None:
    files = {p.name for p in CORPUS.iterdir()} - {"EXPECTED.json"}
    assert files == set(EXPECTED)
    assert {"ok", "error"} == set(EXPECTED.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_outcomes(name: str, workdir: str) -> None:
    assert check_one((CORPUS / name).read_bytes(), workdir) == EXPECTED[name]


def _fix_checksums(data: bytearray) -> None:
    """Recompute the checksum of every block that looks like a header, so that
    mutations reach the field parsers instead of stopping at the checksum."""
    for off in range(0, len(data) - BLOCK + 1, BLOCK):
        block = data[off:off + BLOCK]
        if block[257:262] == b"ustar":
            block[148:156] = b" " * 8
            block[148:156] = b"%06o\0 " % sum(block)
            data[off:off + BLOCK] = block


mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(0, 7)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 16)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(max_size=600)),
    st.tuples(st.just("dup"), st.integers(0, 64), st.integers(0, 64)),
)


def _mutate(seed: bytes, ops: list[tuple[object, ...]], fix: bool) -> bytes:
    data = bytearray(seed)
    for op in ops:
        n = max(len(data), 1)
        if op[0] == "set":
            pos, val = int(op[1]) % n, bytes(op[2])  # type: ignore[call-overload]
            data[pos:pos + len(val)] = val
        elif op[0] == "flip" and data:
            data[int(op[1]) % n] ^= 1 << int(op[2])  # type: ignore[call-overload]
        elif op[0] == "cut":
            del data[int(op[1]) % n:]  # type: ignore[call-overload]
        elif op[0] == "insert":
            pos = int(op[1]) % n  # type: ignore[call-overload]
            data[pos:pos] = bytes(op[2])  # type: ignore[call-overload]
        elif op[0] == "dup":
            blocks = max(len(data) // BLOCK, 1)
            src = (int(op[1]) % blocks) * BLOCK  # type: ignore[call-overload]
            dst = (int(op[2]) % blocks) * BLOCK  # type: ignore[call-overload]
            data[dst:dst] = data[src:src + BLOCK]
    if fix:
        _fix_checksums(data)
    return bytes(data)


@FUZZ
@given(seed=st.sampled_from(PLAIN_SEEDS), ops=st.lists(mutation, min_size=1, max_size=6),
       fix=st.booleans())
def test_mutated_archives(workdir: str, seed: bytes, ops: list[tuple[object, ...]],
                          fix: bool) -> None:
    check_one(_mutate(seed, ops, fix), workdir)


@FUZZ
@given(seed=st.sampled_from(PLAIN_SEEDS), ops=st.lists(mutation, min_size=1, max_size=4),
       zstd=st.booleans(), cut=st.integers(0, 400))
def test_mutated_compressed_archives(workdir: str, seed: bytes,
                                     ops: list[tuple[object, ...]], zstd: bool,
                                     cut: int) -> None:
    data = _mutate(seed, ops, True)
    packed = zstandard.ZstdCompressor().compress(data) if zstd else gzip.compress(data)
    check_one(packed, workdir)
    check_one(packed[:-cut or None], workdir)


# Header field offsets and widths (POSIX ustar; GNU sparse area at 386/482/483).
FIELDS = [(100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (156, 1), (157, 100),
          (329, 8), (337, 8), (345, 155), (386, 96), (482, 1), (483, 12)]


@FUZZ
@given(seed=st.sampled_from(PLAIN_SEEDS), block=st.integers(0, 40),
       field=st.sampled_from(FIELDS), value=st.binary(max_size=16), base256=st.booleans())
def test_header_fields(workdir: str, seed: bytes, block: int, field: tuple[int, int],
                       value: bytes, base256: bool) -> None:
    data = bytearray(seed)
    blocks = max(len(data) // BLOCK, 1)
    start = (block % blocks) * BLOCK + field[0]
    raw = value.ljust(field[1], b"\0")[:field[1]]
    if base256 and field[1] > 1:
        raw = bytes([0x80 | raw[0], *raw[1:]])
    data[start:start + field[1]] = raw
    _fix_checksums(data)
    check_one(bytes(data), workdir)


pax_key = st.sampled_from([
    b"path", b"linkpath", b"size", b"uid", b"gid", b"mtime", b"SCHILY.devmajor",
    b"SCHILY.xattr.user.x", b"LIBARCHIVE.xattr.user.%41", b"GNU.sparse.map",
    b"GNU.sparse.size", b"GNU.sparse.realsize", b"GNU.sparse.major", b"GNU.sparse.minor",
    b"GNU.sparse.offset", b"GNU.sparse.numbytes", b"GNU.sparse.name", b"hdrcharset",
])
pax_value = st.one_of(st.binary(max_size=20), st.integers(-5, 1 << 70).map(
    lambda n: str(n).encode()), st.from_regex(rb"\A[0-9,.\-]{0,24}\Z"))


@FUZZ
@given(records=st.lists(st.tuples(pax_key, pax_value), max_size=8),
       typeflag=st.sampled_from([b"0", b"1", b"2", b"3", b"5", b"S", b"x"]),
       size=st.integers(0, 3000), glob=st.booleans())
def test_pax_records(workdir: str, records: list[tuple[bytes, bytes]], typeflag: bytes,
                     size: int, glob: bool) -> None:
    from tests.layerfs.test_tar import END, header, pax

    arc = pax(records, typeflag=b"g" if glob else b"x")
    arc += header(b"victim", typeflag=typeflag, size=size) + bytes(size + (-size % BLOCK))
    check_one(arc + END, workdir)
