"""Coverage-guided fuzzing of the tar parser with atheris, and the seed corpus.

Run by hand from the repository root (``pip install -e .[fuzz]`` gets atheris):

    mkdir -p /tmp/fuzz-new
    .venv/bin/python -m tests.layerfs.fuzz_tar -max_total_time=300 /tmp/fuzz-new \
        tests/layerfs/corpus
    .venv/bin/python -m tests.layerfs.fuzz_tar --make-corpus tests/layerfs/corpus

(libFuzzer adds the inputs it finds to the first directory, so keep the kept corpus
second.)

The property: :func:`layerfs.sources.tar.load_tar` returns a Tree or raises
InvalidSourceError, and leaves at most its one spool file in the workdir (none after an
error). Anything else is a bug: add the input to the corpus with its expected outcome in
``EXPECTED.json`` and fix the parser. The default test suite replays the corpus
(``test_tar_fuzz.py``); libFuzzer writes crashing inputs as ``crash-*`` files.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import zstandard

from layerfs.errors import InvalidSourceError
from layerfs.sources.tar import load_tar
from tests.layerfs.test_tar import END, header, member, pax, regular


def check_one(data: bytes, workdir: str) -> str:
    """Load ``data``; return "ok" or "error"; raise on any property violation."""
    try:
        tree = load_tar(io.BytesIO(data), workdir=workdir, name="fuzz")
    except InvalidSourceError:
        left = os.listdir(workdir)
        if left:
            raise AssertionError(f"error left files in workdir: {left}") from None
        return "error"
    left = os.listdir(workdir)
    if len(left) > 1:
        raise AssertionError(f"more than one spool file: {left}")
    spool_size = os.path.getsize(os.path.join(workdir, left[0])) if left else 0
    for _, node in tree.walk():
        if node.data is not None:
            extents = (node.data.extents if node.data.extents is not None
                       else ((0, node.size, node.data.offset),))
            for off, length, src in extents:
                if src < 0 or src + length > spool_size or off + length > node.size:
                    raise AssertionError(f"data reference out of bounds: {node.data}")
    for name in left:
        os.unlink(os.path.join(workdir, name))
    return "ok"


def _gnu_tar_sparse(fmt: list[str], *, all_hole: bool = False) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "sp"
        with open(src, "wb") as f:
            if not all_hole:
                f.seek(5000)
                f.write(b"data")
                f.seek(300000)
                f.write(b"more")
            f.truncate(400000)
        out = Path(d) / "a.tar"
        subprocess.run(["tar", "--sparse", *fmt, "-C", d, "-cf", out, "sp"], check=True)
        return out.read_bytes()


def corpus_items() -> dict[str, tuple[bytes, str]]:
    """Seed archives, each with the outcome the parser must give ("ok" or "error")."""
    ok = "ok"
    err = "error"
    hard = (regular(b"a", b"first") + member(header(b"b", typeflag=b"1", linkname=b"a"))
            + member(header(b"c", typeflag=b"1", linkname=b"b")) + regular(b"a", b"again")
            + member(header(b"s", typeflag=b"2", linkname=b"a"))
            + member(header(b"hs", typeflag=b"1", linkname=b"s")) + END)
    xattrs = pax([(b"SCHILY.xattr.user.a", b"\0\n="), (b"LIBARCHIVE.xattr.user.b%20c",
                                                       b"aGk"),
                  (b"mtime", b"-1.5"), (b"uid", b"100000")]) + regular(b"f", b"x") + END
    long = b"d" * 150 + b"/" + b"e" * 150
    items: dict[str, tuple[bytes, str]] = {
        "ustar-kinds.tar": (b"".join([
            member(header(b"./", typeflag=b"5")), regular(b"dir/f", b"hello"),
            member(header(b"dev/null", typeflag=b"3", devmajor=1, devminor=3)),
            member(header(b"fifo", typeflag=b"6")),
            member(header(b"ln", typeflag=b"2", linkname=b"dir/f")), END]), ok),
        "hardlinks.tar": (hard, ok),
        "pax-xattrs-times.tar": (xattrs, ok),
        "gnu-longname.tar": (member(header(b"././@LongLink", typeflag=b"L",
                                           size=len(long)), long) + regular(b"x", b"y") + END,
                             ok),
        "base256.tar": (regular(b"f", b"", uid=1 << 31, gid=70000, mtime=-7) + END, ok),
        "no-end-marker.tar": (regular(b"a", b"abc"), ok),
        "gzip.tar.gz": (gzip.compress(hard, mtime=0), ok),
        "zstd.tar.zst": (zstandard.ZstdCompressor().compress(xattrs), ok),
        "bad-checksum.tar": (regular(b"a", b"1") + regular(b"b", b"2", checksum_delta=3)
                             + END, err),
        "truncated-data.tar": (regular(b"a", b"x" * 2000)[:1000], err),
        "truncated-zstd.tar.zst": (zstandard.ZstdCompressor().compress(hard)[:-5], err),
        "pax-bad-length.tar": (member(header(b"P", typeflag=b"x", size=10), b"99 path=a\n")
                               + regular(b"a", b"") + END, err),
        "symlink-parent.tar": (member(header(b"a", typeflag=b"2", linkname=b"/etc"))
                               + regular(b"a/passwd", b"x") + END, err),
        "nul-in-pax-path.tar": (pax([(b"path", b"a\0b")]) + regular(b"x", b"") + END, err),
        "negative-size.tar": (header(b"f", size=-1) + END, err),
        "absurd-base256.tar": (header(b"f", size=1 << 94) + END, err),
        "dotdot-names.tar": (regular(b"../../etc/passwd", b"p") + regular(b"/abs", b"a")
                             + END, ok),
        # A 3-byte security.capability: setxattr(2) refuses it, execve would fail on it.
        "bad-capability.tar": (pax([(b"SCHILY.xattr.security.capability", b"\x01\x02\x03")])
                               + regular(b"bin/t", b"x") + END, err),
        # GNU tar and tarfile read an empty name, POSIX the ustar one: ambiguous.
        "empty-pax-path.tar": (pax([(b"path", b"")]) + regular(b"ustar-name", b"x") + END,
                               err),
        # A whiteout marker of a 255-byte name is 259 bytes (docker writes them).
        "long-whiteout.tar": (pax([(b"path", b"d/.wh." + b"n" * 255)])
                              + regular(b"d/wh", b"") + END, ok),
        "device-whiteout.tar": (member(header(b"d/gone", typeflag=b"3", mode=0)) + END, ok),
    }
    if shutil.which("tar"):
        items["gnu-sparse.tar"] = (_gnu_tar_sparse(["--format=gnu"]), ok)
        items["pax-sparse-0.0.tar"] = (_gnu_tar_sparse(["--format=pax",
                                                        "--sparse-version=0.0"]), ok)
        items["pax-sparse-0.1.tar"] = (_gnu_tar_sparse(["--format=pax",
                                                        "--sparse-version=0.1"]), ok)
        items["pax-sparse-1.0.tar"] = (_gnu_tar_sparse(["--format=pax",
                                                        "--sparse-version=1.0"]), ok)
        # All hole (a preallocated file): once an unbuildable file without data.
        items["gnu-sparse-all-hole.tar"] = (_gnu_tar_sparse(["--format=gnu"], all_hole=True),
                                            ok)
        items["pax-sparse-1.0-all-hole.tar"] = (
            _gnu_tar_sparse(["--format=pax", "--sparse-version=1.0"], all_hole=True), ok)
    return items


def make_corpus(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name, (data, outcome) in sorted(corpus_items().items()):
        (directory / name).write_bytes(data)
        expected[name] = outcome
    (directory / "EXPECTED.json").write_text(json.dumps(expected, indent=1, sort_keys=True)
                                             + "\n")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--make-corpus":
        make_corpus(Path(sys.argv[2]))
        return
    import atheris  # only for this harness; not a test-suite dependency

    workdir = tempfile.mkdtemp(prefix="fuzz-tar-")

    def one(data: bytes) -> None:
        check_one(data, workdir)

    try:
        atheris.instrument_all()  # coverage feedback from the already imported parser
        atheris.Setup(sys.argv, one)
        atheris.Fuzz()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
