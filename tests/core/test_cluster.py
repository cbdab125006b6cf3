"""init_ray: start a local cluster or join one; bundles and runtime environments of groups."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed.cluster import bundle_of, init_ray
from posttrain.distributed.worker_group import merged_runtime_env
from posttrain.errors import ConfigError
from posttrain.gc_thresholds import THRESHOLDS

PROBE = (
    "import os, signal, ray\n"
    "from posttrain.config.schema import ClusterConfig\n"
    "from posttrain.distributed import init_ray\n"
    "def mine(signum, frame): pass\n"
    "signal.signal(signal.SIGTERM, mine)  # e.g. a run's graceful stop: ray.init must not replace it\n"
    "init_ray(ClusterConfig(num_cpus=3))\n"
    "init_ray(ClusterConfig(num_cpus=1))  # idempotent: no second cluster\n"
    "import psutil, time\n"
    "idle = 0  # worker processes Ray started ahead of need, seen over 3 s (a cluster it starts has none)\n"
    "for _ in range(30):\n"
    "    time.sleep(0.1)\n"
    "    idle = max(idle, sum(p.name().startswith('ray::IDLE') for p in psutil.Process().children(recursive=True)))\n"
    "@ray.remote(num_cpus=0)\n"
    "def worker_gc(): import gc; return ','.join(map(str, gc.get_threshold()))\n"
    "print(ray.cluster_resources()['CPU'], ray.get_runtime_context().gcs_address, os.environ['RAY_AUTH_MODE'],\n"
    "      signal.getsignal(signal.SIGTERM) is mine, idle, ray.get(worker_gc.remote()))\n"
    "ray.shutdown()\n"
)


def _probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.ray
def test_init_ray_joins_ray_address_else_starts_a_local_cluster(ray_cluster):
    address = ray_cluster.get_runtime_context().gcs_address
    joined = _probe(RAY_ADDRESS=address, RAY_AUTH_MODE="disabled")
    # a worker process of posttrain's job collects garbage less often (gc_thresholds), also on a joined cluster
    gc = ",".join(map(str, THRESHOLDS))
    assert joined == [str(ray_cluster.cluster_resources()["CPU"]), address, "disabled", "True", "0", gc]
    started = _probe()
    assert started[0] == "3.0" and started[1] != address and started[2:] == ["disabled", "True", "0", gc]
    init_ray(ClusterConfig(num_cpus=1))  # this process is already connected: nothing changes
    assert ray_cluster.get_runtime_context().gcs_address == address


LOGGING_PROBE = (
    "import json, os, sys, ray\n"
    "from posttrain.config.schema import ClusterConfig\n"
    "from posttrain.distributed import init_ray\n"
    "from posttrain.log import configure_logging\n"
    "configure_logging(sys.argv[1])\n"
    "init_ray(ClusterConfig(num_cpus=1))\n"
    "@ray.remote(num_cpus=0, runtime_env={'env_vars': {'GROUP_OWN': '1'}})\n"
    "def env(): return {k: os.environ.get(k) for k in ('TORCH_CPP_LOG_LEVEL', 'PYTHONWARNINGS', 'GROUP_OWN')}\n"
    "print(json.dumps(ray.get(env.remote())))\n"
    "ray.shutdown()\n"
)


@pytest.mark.ray
@pytest.mark.parametrize("level", ["info", "debug"])
def test_ray_and_the_workers_print_only_errors_below_debug(level):
    """Below debug, Ray's own logger says nothing at start and every worker of the job gets
    the quiet-library environment, merged with a group's own variables; at debug neither."""
    import json

    from posttrain.log import QUIET_LIBRARY_ENV

    clean = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", *QUIET_LIBRARY_ENV)}
    done = subprocess.run([sys.executable, "-c", LOGGING_PROBE, level], env=clean, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    worker_env = json.loads(done.stdout.splitlines()[-1])
    if level == "info":
        assert worker_env == {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONWARNINGS": QUIET_LIBRARY_ENV["PYTHONWARNINGS"],
                              "GROUP_OWN": "1"}
        assert "Started a local Ray instance" not in done.stderr, done.stderr
    else:
        assert worker_env == {"TORCH_CPP_LOG_LEVEL": None, "PYTHONWARNINGS": None, "GROUP_OWN": "1"}
        assert "Started a local Ray instance" in done.stderr, done.stderr


def test_bundle_of_drops_zero_resources_and_refuses_empty():
    assert bundle_of(WorkerResources(cpus=0.5)) == {"CPU": 0.5}
    assert bundle_of(WorkerResources(cpus=1, gpus=0.25)) == {"CPU": 1.0, "GPU": 0.25}
    with pytest.raises(ConfigError, match=r"ask for nothing; set resources.cpus or resources.gpus above 0"):
        bundle_of(WorkerResources(cpus=0, gpus=0))


def test_env_vars_merge_into_the_runtime_env():
    resources = WorkerResources(
        env_vars={"A": "1", "B": "2"},
        runtime_env={"py_executable": "/opt/gen/bin/python", "env_vars": {"B": "old", "C": "3"}},
    )
    assert merged_runtime_env(resources) == {
        "py_executable": "/opt/gen/bin/python",
        "env_vars": {"B": "2", "C": "3", "A": "1"},
    }
    assert resources.runtime_env["env_vars"] == {"B": "old", "C": "3"}  # the config is not modified
    assert merged_runtime_env(WorkerResources()) is None


@pytest.mark.ray
def test_the_run_waits_for_cluster_num_nodes_then_names_the_nodes_alive(ray_cluster):
    import time

    from posttrain.distributed import VirtualCluster
    from posttrain.errors import ClusterError

    address = ray_cluster.get_runtime_context().gcs_address
    start = time.monotonic()
    with pytest.raises(ClusterError) as waited:
        VirtualCluster(ClusterConfig(num_nodes=2, node_wait_s=1))
    assert 1 <= time.monotonic() - start < 10
    message = str(waited.value)
    assert message.startswith(
        f"cluster.num_nodes=2, but the Ray cluster at {address} has 1 alive node(s) after 1 s (cluster.node_wait_s). "
        "Alive: "
    )
    assert message.endswith(f"Start Ray on the missing nodes (ray start --address={address}) and check their Ray "
                            "logs, or lower cluster.num_nodes.")
    assert VirtualCluster(ClusterConfig(num_nodes=1)).nodes[0].alive


def test_more_than_one_node_needs_a_cluster_to_join_and_is_refused_before_ray_starts():
    code = (
        "import ray\n"
        "from posttrain.config.schema import ClusterConfig\n"
        "from posttrain.distributed.cluster import check_node_count\n"
        "try:\n"
        "    check_node_count(ClusterConfig(num_nodes=2))\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error, ray.is_initialized())\n"
    )
    clean = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120)
    assert done.stdout == (
        "ConfigError cluster.num_nodes=2, but neither cluster.ray_address nor RAY_ADDRESS names a Ray cluster to "
        "join, and the local cluster a run starts has one node. Start Ray on every node, then set RAY_ADDRESS (or "
        "cluster.ray_address) to the head's address (see docs/clusters.md), or set cluster.num_nodes=1. False\n"
    ), done.stderr
