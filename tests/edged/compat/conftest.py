"""Fixtures of the compatibility tests: the harness fixtures (a real daemon, the Debian and
busybox layers)."""

from tests.edged.harness.conftest import deb_node, debian_layer  # noqa: F401
from tests.edged.test_e2e_container import layer_store, real_node  # noqa: F401
