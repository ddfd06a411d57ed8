"""Fixtures of the harness tests: a real daemon (container backend) with two layers in its
store, a busybox base (``sh`` only) and the Debian rootfs (bash, python3)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.edged.test_e2e_container import RealNode, layer_store, real_node  # noqa: F401

DEBIAN_TAR = "/var/cache/edged-test/debian-rootfs.tar"


@pytest.fixture(scope="session")
def debian_layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(store dir, digest) of the Debian rootfs as a base layer."""
    from layerfs.build import build_layer
    from layerfs.store import Store

    if not os.path.exists(DEBIAN_TAR):
        pytest.skip(f"needs {DEBIAN_TAR} (bash scripts/rootfs.sh)")
    store = str(tmp_path_factory.mktemp("debstore"))
    res = build_layer(DEBIAN_TAR, kind="base", store=Store(store))
    return store, res.digest


@pytest.fixture
def deb_node(real_node: Callable[..., RealNode],  # noqa: F811
             debian_layer: tuple[str, str]) -> Callable[..., RealNode]:
    """A daemon whose store holds the Debian layer: ``deb_node(**config_overrides)``."""
    store, _ = debian_layer

    def start(**overrides: object) -> RealNode:
        return real_node(store_dir=store, **overrides)

    return start
