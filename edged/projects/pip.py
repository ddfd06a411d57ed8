"""pip, the package index's own client, run for a project: download its sdist, resolve its
test environment (``--dry-run --report``), install pinned distributions into a prefix, and turn
pip's failures into typed errors that say why (:func:`classify`).

pip runs as ``python -m pip`` of the interpreter running edged (its configuration, index and
proxy settings apply); that interpreter must be the base layer's Python (checked by
:func:`edged.projects.image.build_project_image`), since pip picks wheels and evaluates
markers for the interpreter it runs under.
"""

from __future__ import annotations

import compileall
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from edged.projects.errors import (
    BuildFailed,
    DependencyFailed,
    IndexUnreachable,
    NoSuchRelease,
    ProjectError,
    PythonMismatch,
)

log = logging.getLogger("edged.projects")

#: How many lines of pip's output an error quotes.
QUOTE_LINES = 12
_NETWORK = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
            "Name or service not known", "Could not fetch URL", "ConnectTimeoutError",
            "SSLError", "ProxyError", "Network is unreachable")
_COMPILER = ("gcc", "cc1", "x86_64-linux-gnu-", "Python.h", "compiler", "rustc", "cargo",
             "error: command", "fatal error:")


@dataclass(frozen=True)
class Dist:
    """One distribution of a resolved environment: canonical name, version, and whether it
    was asked for (rather than pulled in as a dependency)."""

    name: str
    version: str
    requested: bool = False

    @property
    def pin(self) -> str:
        """``name==version``."""
        return f"{self.name}=={self.version}"


def _quote(output: str) -> str:
    """pip's own lines worth showing: its errors and the build output before them, not its
    warnings (this machine's index configuration warns on every run)."""
    lines = [x.rstrip() for x in output.splitlines()
             if x.strip() and not x.lstrip().startswith(("WARNING:", "DEPRECATION:"))]
    return "\n".join("    " + x for x in lines[-QUOTE_LINES:])


def classify(output: str, what: str, project: str) -> ProjectError:
    """The typed error for a pip run that failed while doing ``what`` (a phrase: "downloading
    the sdist of attrs==99") for project ``project``; ``output`` is pip's stderr (and
    stdout). The message says the cause in one sentence, then quotes pip."""
    proj = canonicalize_name(project)
    quote = _quote(output)

    def err(cls: type[ProjectError], why: str) -> ProjectError:
        return cls(f"{what}: {why}" + (f"\n  pip said:\n{quote}" if quote else ""))

    if any(m in output for m in _NETWORK) and "from versions: none" in output:
        return err(IndexUnreachable, "the package index could not be reached")
    m = re.search(r"requires a different Python: (\S+) not in '([^']*)'", output)
    if m:
        return err(PythonMismatch, f"it needs Python {m.group(2)}; the base layer's Python is "
                                   f"{m.group(1)}")
    m = re.search(r"No matching distribution found for ([A-Za-z0-9._-]+)", output)
    if m:
        name = canonicalize_name(m.group(1))
        versions = re.search(r"\(from versions: ([^)]*)\)", output)
        listed = versions.group(1) if versions else "none"
        if name == proj:
            return err(NoSuchRelease, f"the package index has no such release of {project} "
                                      f"(versions there: {_shorten(listed)})")
        return err(DependencyFailed, f"test dependency {m.group(1)} has no release this "
                                     f"Python can install (versions: {_shorten(listed)})")
    if "ResolutionImpossible" in output or "conflicting dependencies" in output:
        return err(DependencyFailed, "the requirements conflict (pip names them below)")
    m = re.search(r"(?:Failed building wheel for|Failed to build(?: installable wheels for some "
                  r"pyproject\.toml based projects)?) \(?([A-Za-z0-9._-]+)", output)
    building = m.group(1) if m else None
    if building is None and ("metadata-generation-failed" in output
                             or "subprocess-exited-with-error" in output):
        m = re.search(r"(?:Preparing metadata|Getting requirements to build wheel)"
                      r".*?\n.*?(?:for|of) ([A-Za-z0-9._-]+)", output)
        building = m.group(1) if m else project
    if building is not None:
        hint = next((x.strip() for x in output.splitlines()
                     if any(c in x for c in _COMPILER)), "")
        needs = f"; its build needs a compiler or headers ({hint[:120]})" if hint else ""
        if canonicalize_name(building) == proj:
            return err(BuildFailed, f"building {project} from its sdist failed{needs}")
        return err(DependencyFailed, f"test dependency {building} failed to build{needs}")
    if any(m in output for m in _NETWORK):
        return err(IndexUnreachable, "the package index could not be reached")
    return err(ProjectError, "pip failed")


def _shorten(versions: str, keep: int = 8) -> str:
    """The last ``keep`` of pip's comma-separated version list (the newest)."""
    vs = [v.strip() for v in versions.split(",") if v.strip()]
    if len(vs) <= keep:
        return ", ".join(vs)
    return f"{', '.join(vs[-keep:])} and {len(vs) - keep} older"


def pip(args: list[str], *, what: str, project: str,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pip ARGS``. Raises the :func:`classify` error when pip fails."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, check=False)
    if done.returncode != 0:
        raise classify(done.stdout + "\n" + done.stderr, what, project)
    return done


def resolve(requirements: list[str], *, project: str, what: str,
            no_deps: bool = False) -> tuple[list[Dist], dict[str, Any]]:
    """Resolve ``requirements`` as pip would install them into an empty environment (the
    interpreter's installed packages ignored; with ``no_deps``, only them), building
    ``project`` from its sdist. Returns
    (the distributions, ``project``'s metadata as pip's report gives it: ``provides_extra``,
    ``requires_dist``...). Raises :class:`ProjectError` (:func:`classify`)."""
    with tempfile.TemporaryDirectory(prefix="edged-pip-") as tmp:
        report = Path(tmp) / "report.json"
        pip(["install", "--dry-run", "--ignore-installed", "-q", "--no-binary", project,
             *(["--no-deps"] if no_deps else []), "--report", str(report), *requirements],
            what=what, project=project)
        items = json.loads(report.read_text()).get("install", [])
    dists, meta = [], {}
    for item in items:
        md = item.get("metadata", {})
        name = canonicalize_name(md.get("name", ""))
        dists.append(Dist(name, str(md.get("version", "")), bool(item.get("requested"))))
        if name == canonicalize_name(project):
            meta = md
    return dists, meta


def install_target(target: Path, pins: list[str], *, project: str, what: str) -> None:
    """Install exactly ``pins`` (``name==version``, no dependencies pulled in) into the
    ``--target`` prefix ``target``, ``project`` built from its sdist; no ``.pyc`` (see
    :func:`compile_for_sandbox`). Raises :class:`ProjectError`."""
    if not pins:
        target.mkdir(parents=True, exist_ok=True)
        return
    pip(["install", "-q", "--no-deps", "--ignore-installed", "--no-compile", "--no-binary",
         project, "--target", str(target), *pins], what=what, project=project)


def installed(path: Path) -> dict[str, str]:
    """{canonical name: version} of the distributions installed in the prefix ``path``."""
    out: dict[str, str] = {}
    for d in metadata.distributions(path=[str(path)]):
        name = d.metadata["Name"]
        if name:
            out.setdefault(canonicalize_name(name), d.version)
    return out


def compile_for_sandbox(root: Path, inside: str) -> bool:
    """Compile every ``.py`` under ``root`` ahead, so that no sandbox compiles it again:
    checked-hash ``.pyc`` (PEP 552: valid whatever the layer's clamped mtimes) naming their
    sources by their path in the sandbox, ``inside`` (pip's would name this temporary
    directory, and no two builds would give the same layer). Returns False if some file did
    not compile (Python then compiles it on import)."""
    import py_compile

    return bool(compileall.compile_dir(
        str(root), quiet=2, ddir=inside, workers=1,
        invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH))
