"""Python projects from the package index as sandbox images that run their own test suites.

:func:`build_project_image` turns ``NAME==VERSION`` into base, workspace and toolkit layers
in the layer store, with the environment a test run needs (:mod:`edged.projects.image`
describes the layout and the path order); :mod:`edged.projects.testdeps` says which test
dependencies are read from a project's sdist; every reason a project's tests cannot run is a
typed :class:`ProjectError` (:mod:`edged.projects.errors`). The main job (``edged rollout``)
is built on this, and so can any job that runs a project's tests in sandboxes; nothing here
talks to the daemon.
"""

from __future__ import annotations

from edged.projects.errors import ProjectError
from edged.projects.image import ProjectImage, build_project_image, sandbox_env
from edged.projects.testdeps import TestDeps, find_test_deps

__all__ = ["ProjectError", "ProjectImage", "TestDeps", "build_project_image",
           "find_test_deps", "sandbox_env"]
