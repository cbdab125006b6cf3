"""The session cluster's workers (tests/worker_forks.py): forked with torch and transformers
imported where their environment matches a fork server's, a fresh interpreter where it does
not, and in either case a process of their own (thread count, random draws)."""

from __future__ import annotations

import os
import sys

import pytest

from tests import worker_forks

pytestmark = pytest.mark.ray


class Probe:
    def __init__(self):
        # before this actor imports anything: what the process had when Ray handed it the actor
        self.preloaded = "transformers.modeling_utils" in sys.modules

    def report(self) -> dict:
        import numpy
        import torch

        return {"preloaded": self.preloaded, "pid": os.getpid(), "threads": torch.get_num_threads(),
                "omp": os.environ.get("OMP_NUM_THREADS"), "wait": os.environ.get("OMP_WAIT_POLICY"),
                "draw": float(numpy.random.random_sample()), "script": os.path.basename(sys.argv[0])}


def _report(ray, **options):
    actor = ray.remote(Probe).options(**options).remote()
    try:
        return ray.get(actor.report.remote())
    finally:
        ray.kill(actor)


def test_workers_are_forked_with_the_imports_done_and_their_own_threads_and_draws(ray_cluster):
    one, two = _report(ray_cluster), _report(ray_cluster, num_cpus=2)
    passive = _report(ray_cluster, runtime_env={"env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "3"}})

    assert one["preloaded"] and two["preloaded"] and passive["preloaded"], (one, two, passive)
    # Ray sets OMP_NUM_THREADS from the actor's CPUs before its first task; the fork's torch follows
    assert (one["omp"], one["threads"]) == ("1", 1) and (two["omp"], two["threads"]) == ("2", 2)
    assert (passive["wait"], passive["threads"]) == ("PASSIVE", 3)
    assert one["draw"] != two["draw"]  # numpy's global generator reseeded in each fork
    assert one["script"] == "default_worker.py" and len({one["pid"], two["pid"], passive["pid"]}) == 3


def test_a_worker_whose_import_time_environment_differs_starts_fresh(ray_cluster):
    active = _report(ray_cluster, runtime_env={"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}})

    assert not active["preloaded"] and active["wait"] == "ACTIVE" and active["threads"] == 1, active


def test_the_import_time_environment_names_the_servers_socket(tmp_path):
    base = {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "4"}

    assert worker_forks.import_time_environment(base) == {"HF_HUB_OFFLINE": "1"}
    same = worker_forks.socket_path(tmp_path, {**base, "PATH": "/usr/bin", "OMP_NUM_THREADS": "1"})
    assert same == worker_forks.socket_path(tmp_path, base)  # neither is read when torch loads
    assert worker_forks.socket_path(tmp_path, {**base, "OMP_WAIT_POLICY": "PASSIVE"}) != same
