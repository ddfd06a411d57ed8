"""Why a project's tests could not be run: one typed error per cause, each with a message that
names the project and what to do, and the code that ``edged rollout --json`` reports."""

from __future__ import annotations

from edged.errors import EdgedError


class ProjectError(EdgedError, RuntimeError):
    """A project could not be turned into layers that run its tests. ``code`` says why (the
    subclasses); the message names the requirement and quotes the tool that failed (pip's
    ``ERROR:`` lines, the build's last lines). Nothing is left in the layer store from a
    failed project but the layers that were complete."""

    code = "project_failed"


class BadRequirement(ProjectError, ValueError):
    """The project requirement is not a PEP 508 requirement (``NAME``, ``NAME==VERSION``)."""

    code = "bad_requirement"


class NoSuchRelease(ProjectError, LookupError):
    """The package index has no release matching the requirement (a name or version that
    does not exist); the message lists the versions the index has, when it says."""

    code = "no_release"


class NoSdist(ProjectError, LookupError):
    """The release exists but only as wheels: the tests come from the sdist, so there is
    nothing to test."""

    code = "no_sdist"


class NoTests(ProjectError):
    """The sdist carries no test files (no ``test_*.py`` / ``*_test.py``)."""

    code = "no_tests"


class BuildFailed(ProjectError):
    """The project's build backend failed (metadata or wheel), e.g. a C extension without a
    compiler or headers; the message quotes the build's last lines."""

    code = "build_failed"


class DependencyFailed(ProjectError):
    """The project's test dependencies cannot be installed: no release for this Python, a
    conflict between them (or with the toolkit's pytest), or one that failed to build."""

    code = "dependency_failed"


class PythonMismatch(ProjectError):
    """The project needs another Python than the base layer's, or the host Python that
    installs the layers is not the base layer's (wheels and markers would be wrong)."""

    code = "python_mismatch"


class IndexUnreachable(ProjectError, OSError):
    """The package index could not be reached (DNS, connection, TLS)."""

    code = "index_unreachable"
