"""The README's Layout section matches the tree (issue 10): every room of the code is listed
there, and nothing listed there is gone.

The rooms: each folder of ``csrc/`` (listed as ``csrc/<name>/``), each package directly under
``edged/`` and ``layerfs/`` and each backend package under ``edged/backends/`` (named as
``<name>/`` in the ``edged/`` or ``layerfs/`` entry). Every other top-level entry of the section
(``profiles/``, ``tests/``, ...) and every ``<name>/`` the ``edged/`` and ``layerfs/`` entries
name must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: ``name/``, not part of a longer path (``backends/base.py``) nor of a word
_DIR_NAME = re.compile(r"(?<![\w./])([a-z_][a-z0-9_-]*)/(?![\w.])")


def layout_entries(readme: str) -> dict[str, str]:
    """The Layout section's code block as {entry path: its description} (an entry starts at
    a line's first column; indented lines continue the one before). Raises ValueError if the
    README has no such block."""
    m = re.search(r"^## Layout\n+```\n(.*?)^```", readme, re.M | re.S)
    if m is None:
        raise ValueError("README.md: no '## Layout' section with a code block")
    entries: dict[str, str] = {}
    last = None
    for line in m.group(1).splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            last, _, rest = line.partition(" ")
            entries[last] = rest
        elif last is not None:
            entries[last] += " " + line.strip()
    return entries


def _has_files(d: Path) -> bool:
    return any(p.is_file() for p in d.rglob("*") if "__pycache__" not in p.parts)


def rooms(root: Path) -> dict[str, list[str]]:
    """The rooms the section must list: {"csrc": [csrc/<dir>/ ...], "edged": [<pkg>/ ...],
    "layerfs": [<pkg>/ ...]} (edged's with its backend packages)."""
    out = {"csrc": [f"csrc/{d.name}/" for d in sorted((root / "csrc").iterdir())
                    if d.is_dir() and d.name != "__pycache__" and _has_files(d)]}
    for pkg, below in (("edged", ("", "backends/")), ("layerfs", ("",))):
        out[pkg] = [f"{d.name}/" for sub in below
                    for d in sorted((root / pkg / sub).iterdir())
                    if (d / "__init__.py").is_file()]
    return out


def layout_problems(readme: str, root: Path) -> list[str]:
    """What the README's Layout section and the tree at ``root`` disagree on, one line each
    (empty: they agree)."""
    entries = layout_entries(readme)
    problems = []
    for d in rooms(root)["csrc"]:
        if d not in entries:
            problems.append(f"{d} is not in the README's Layout")
    for pkg in ("edged", "layerfs"):
        named = set(_DIR_NAME.findall(entries.get(f"{pkg}/", "")))
        for d in rooms(root)[pkg]:
            if d[:-1] not in named:
                problems.append(f"{pkg}/{d} is not named in the Layout's {pkg}/ entry")
        for name in sorted(named):
            if not any(p.is_dir() for p in (root / pkg).rglob(name)):
                problems.append(f"the Layout's {pkg}/ entry names {name}/: no such folder")
    for entry in entries:
        if not (root / entry).exists():
            problems.append(f"the Layout lists {entry}: it is gone")
    return problems


def test_the_readme_layout_matches_the_tree() -> None:
    assert layout_problems((ROOT / "README.md").read_text(), ROOT) == []


def _tree(tmp: Path) -> Path:
    for d in ("csrc/lib", "edged/api", "edged/backends/container", "layerfs/lazy"):
        (tmp / d).mkdir(parents=True)
    for f in ("csrc/lib/a.c", "edged/api/__init__.py", "edged/backends/__init__.py",
              "edged/backends/container/__init__.py", "layerfs/lazy/__init__.py"):
        (tmp / f).write_text("")
    return tmp


README = """# x

## Layout

```
csrc/lib/       the C core
edged/          api/ (routes), backends/ (container/)
layerfs/        lazy/ (the lazy server)
```
"""


def test_a_matching_layout_has_no_problems(tmp_path: Path) -> None:
    assert layout_problems(README, _tree(tmp_path)) == []


def test_a_room_missing_from_the_layout_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    for d in ("csrc/bpf", "edged/net", "edged/backends/microvm", "layerfs/remote"):
        (root / d).mkdir()
        (root / d / ("x.c" if d.startswith("csrc") else "__init__.py")).write_text("")
    assert layout_problems(README, root) == [
        "csrc/bpf/ is not in the README's Layout",
        "edged/net/ is not named in the Layout's edged/ entry",
        "edged/microvm/ is not named in the Layout's edged/ entry",
        "layerfs/remote/ is not named in the Layout's layerfs/ entry"]


def test_a_listed_room_that_is_gone_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    gone = README.replace("backends/ (container/)", "backends/ (container/, fncall/)").replace(
        "layerfs/ ", "systemd/        units\nlayerfs/ ")
    assert layout_problems(gone, root) == [
        "the Layout's edged/ entry names fncall/: no such folder",
        "the Layout lists systemd/: it is gone"]
