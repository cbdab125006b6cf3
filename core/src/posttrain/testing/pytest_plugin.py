"""pytest fixtures for testing posttrain plugins against the real host.

Enable in a test module or the root ``conftest.py`` with::

    pytest_plugins = ["posttrain.testing.pytest_plugin"]

Fixtures:

- ``posttrain_host``: a fresh :class:`~posttrain.plugins.PluginHost` loaded from the
  installed entry points, installed as this process's host for the test (so code that
  calls :func:`~posttrain.plugins.plugin_host` sees it) and restored afterwards.
- ``ray_local`` (session): Ray, started locally with 2 logical CPUs unless this process
  is already connected (then that cluster is used and left running).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from posttrain import plugins


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts a local Ray cluster")


@pytest.fixture
def posttrain_host() -> Iterator[plugins.PluginHost]:
    previous = plugins._HOST
    host = plugins.new_plugin_host()
    plugins.set_plugin_host(host)
    try:
        yield host
    finally:
        plugins.set_plugin_host(previous)


@pytest.fixture(scope="session")
def ray_local() -> Iterator[Any]:
    import ray

    from posttrain.config.schema import ClusterConfig
    from posttrain.distributed import init_ray

    if ray.is_initialized():
        yield ray
        return
    init_ray(ClusterConfig(num_cpus=2))
    try:
        yield ray
    finally:
        ray.shutdown()
