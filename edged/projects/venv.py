"""The project's environment in the sandbox: a virtual environment written by hand (no
interpreter runs at build time), as its CI's would be, with the toolkit after it on the path.

Layout, at ``prefix`` in the sandbox (``/work/.venv``)::

    pyvenv.cfg                      home = the base's /usr/bin; no system site-packages
    bin/python -> /usr/bin/python3  (and python3, python3.N) + the console scripts pip wrote
    lib/python3.N/site-packages/    the project, its test dependencies, and
        zz-edged-toolkit.pth        the toolkit's directory, added after site-packages

A ``.pth`` entry is appended to ``sys.path`` after the site-packages that holds it, so the
project's version of a distribution that both hold wins; the toolkit fills in the rest
(pytest). Unlike ``PYTHONPATH``, this holds in every process the venv's Python starts,
including those that reset the environment (pytest-mypy-plugins runs mypy with a
``PYTHONPATH`` of its own), and it keeps the stdlib ahead of both, as any venv does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

#: The ``.pth`` file naming the toolkit (``zz``: after any the project installs).
TOOLKIT_PTH = "zz-edged-toolkit.pth"


def site_packages(prefix: str | Path, pyver: str) -> str:
    """``prefix/lib/python<pyver>/site-packages`` (``pyver``: ``major.minor``)."""
    return f"{prefix}/lib/python{pyver}/site-packages"


def make_venv(dest: Path, *, prefix: str, python: str, pyver: str,
              after: list[str]) -> Path:
    """Write the skeleton of a venv into ``dest`` (which is ``prefix`` in the sandbox) for
    the base interpreter ``python`` (its directory becomes ``home``), with ``after`` (the
    toolkit's directories) on ``sys.path`` after its site-packages. Returns the host path of
    its site-packages. Raises OSError."""
    site = dest / site_packages("", pyver).lstrip("/")
    site.mkdir(parents=True, exist_ok=True)
    bindir = dest / "bin"
    bindir.mkdir(exist_ok=True)
    (dest / "pyvenv.cfg").write_text(f"home = {Path(python).parent}\n"
                                     "include-system-site-packages = false\n"
                                     f"version = {pyver}\n")
    for name, target in (("python", python), ("python3", "python"),
                         (f"python{pyver}", "python")):
        link = bindir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    (site / TOOLKIT_PTH).write_text("".join(f"{d}\n" for d in after))
    return site


def adopt_scripts(site: Path, dest: Path, python: str) -> None:
    """Move the console scripts ``pip install --target SITE`` wrote into ``SITE/bin`` into
    the venv's ``bin/`` and point them at the venv's Python ``python`` (pip names the
    interpreter it ran under, a host path)."""
    src = site / "bin"
    if src.is_dir():
        for p in sorted(src.iterdir()):
            target = dest / "bin" / p.name
            if target.is_symlink() or target.exists():
                continue  # the venv's own python links win
            shutil.move(str(p), target)
        shutil.rmtree(src)
    fix_shebangs(dest / "bin", python)


def fix_shebangs(bin_dir: Path, python: str) -> None:
    """Rewrite the ``#!...python...`` line of every regular file in ``bin_dir`` to
    ``#!<python>`` (``python`` may be ``/usr/bin/env python3``)."""
    if not bin_dir.is_dir():
        return
    for p in bin_dir.iterdir():
        if p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        first, _, rest = data.partition(b"\n")
        if first.startswith(b"#!") and b"python" in first:
            p.write_bytes(b"#!" + python.encode() + b"\n" + rest)
