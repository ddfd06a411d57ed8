"""The architecture's import rules, checked by parsing every import of ``edged/`` and
``layerfs/`` (module level and inside functions alike: a lazy import is an import):

- no import circle among the modules;
- ``layerfs`` imports nothing of ``edged`` (it is usable on its own, e.g. on an image-build
  host);
- nothing under ``edged/node/`` or ``edged/api/`` imports a particular backend (only the
  contract, ``edged.backends.base``, and the registry, ``edged.backends.registry``), and no
  backend imports the node (it is below it);
- no backend imports another (``container``, ``microvm``, ``fncall`` share the contract and
  the rooms below it, never each other's code);
- the rooms every backend shares, ``edged/sbxinit/`` and ``edged/cgroups/``, import nothing
  of the backends (the contract's plain data they use is ``edged.datatypes``, below both),
  nor of the node, the API or the network; ``edged/images/`` (the layers' one owner) and
  ``edged/net/`` know no particular backend, nor the node or the API;
- ``edged/security/`` (policy) does not import the API (the transport);
- ``edged/security/`` does not import ``layerfs`` (confinement has its own native module);
- ``edged/client/`` (the SDK) imports nothing of the daemon, nor ``layerfs``;
- ``edged/cluster/`` imports nothing of the daemon either (it is a client of the nodes'
  APIs), and only it imports Ray: the SDK and the CLI start without it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edged", "layerfs")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` runs last (a module, else its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """(module of ours imported, line) for every import statement in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _resolve(a.name)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                target = _resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in MODULES \
                    else _resolve(base)
                if target:
                    yield target, node.lineno


#: The backends' own packages (edged/backends/<kind>/).
BACKENDS = sorted(p.parent.name for p in (ROOT / "edged/backends").glob("*/__init__.py"))

GRAPH = {m: sorted({t for t, _ in imports_of(m) if t != m}) for m in MODULES}


def _where(src: str, pred: object) -> list[str]:
    return [f"{src}:{line} imports {t}" for t, line in imports_of(src)
            if callable(pred) and pred(t)]


def test_the_graph_is_read() -> None:
    """The parser sees imports at all (a rule that checks nothing would pass)."""
    assert "edged.node.manager" in GRAPH["edged.api.app"]
    assert "edged.backends.registry" in GRAPH["edged.node.manager"]
    assert "layerfs.remote.connect" in GRAPH["edged.images.mounts"]  # a lazy import
    assert {"container", "fncall", "microvm"} <= set(BACKENDS)
    assert "edged.datatypes" in GRAPH["edged.sbxinit.client"]  # below a rule's room


def test_no_import_circle() -> None:
    """Tarjan's strongly connected components: none of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert circles == []


def _under(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


@pytest.mark.parametrize("src, forbidden, why", [
    ("layerfs", lambda t: t.startswith("edged"), "layerfs knows nothing of the daemon"),
    ("edged.node", lambda t: t.startswith("edged.backends.")
     and t not in ("edged.backends.base", "edged.backends.registry"),
     "the node knows backends by the contract and the registry"),
    ("edged.api", lambda t: t.startswith("edged.backends.")
     and t not in ("edged.backends.base", "edged.backends.registry"),
     "the API knows backends by the contract and the registry"),
    ("edged.compat", lambda t: t.startswith("edged.backends.")
     and t not in ("edged.backends.base", "edged.backends.registry"),
     "the E2B listener, beside the API, knows backends by the contract and the registry"),
    ("edged.backends", lambda t: t.startswith(("edged.node", "edged.api")),
     "a backend is below the node and the API"),
    *[(f"edged.backends.{kind}", lambda t, kind=kind: t.startswith("edged.backends.")
       and t.split(".")[2] in BACKENDS and t.split(".")[2] != kind,
       "a backend reaches into no other backend") for kind in BACKENDS],
    *[(room, lambda t: t.startswith(("edged.node", "edged.api", "edged.net",
                                     "edged.backends")),
       "the rooms every backend shares are below the backends (edged.datatypes: the data)")
      for room in ("edged.sbxinit", "edged.cgroups")],
    *[(room, lambda t: t.startswith(("edged.node", "edged.api"))
       or (t.startswith("edged.backends") and t != "edged.backends.base"),
       "below the node and the API, and no particular backend's")
      for room in ("edged.images", "edged.net")],
    ("edged.security", lambda t: t.startswith("edged.api"),
     "policy does not depend on the transport (the API)"),
    ("edged.security", lambda t: t.startswith("layerfs"),
     "confinement has its own native module (edged._native)"),
    ("edged.client", lambda t: not t.startswith("edged.client"),
     "the SDK speaks HTTP only: nothing of the daemon, nor layerfs"),
    ("edged.cluster", lambda t: not t.startswith(("edged.cluster", "edged.client",
                                                  "edged.tabular")),
     "the cluster is clients of the nodes' APIs: the SDK, nothing of the daemon"),
])
def test_import_rule(src: str, forbidden: object, why: str) -> None:
    broken = [w for m in _under(src) for w in _where(m, forbidden)]
    assert broken == [], why


def _imports_ray(module: str) -> list[int]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "ray" or n.startswith("ray.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_cluster_imports_ray() -> None:
    users = {m: ls for m in MODULES if (ls := _imports_ray(m))}
    assert "edged.cluster.actors" in users  # the check sees them
    assert [m for m in users if not m.startswith("edged.cluster.")] == []


def test_the_sdk_and_the_cli_load_without_ray() -> None:
    import subprocess
    import sys

    code = ("import sys, edged.client, edged.cli, edged.cluster; "
            "edged.cli.parser(); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
