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
        self.vllm = "vllm.v1.engine.core" in sys.modules

    def report(self) -> dict:
        import numpy
        import torch

        return {"preloaded": self.preloaded, "vllm": self.vllm, "pid": os.getpid(), "threads": torch.get_num_threads(),
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


def test_engine_workers_are_forked_with_vllm_imported_and_other_workers_without(ray_cluster, fork_servers):
    pytest.importorskip("vllm")
    from posttrain.config.schema import RunConfig
    from posttrain_vllm.generation import engine_environment

    fork_servers.wait()  # the vLLM servers start with the cluster
    engine = _report(ray_cluster, runtime_env={"env_vars": engine_environment(RunConfig())})
    other = _report(ray_cluster)

    assert engine["preloaded"] and engine["vllm"] and other["preloaded"] and not other["vllm"], (engine, other)


def test_a_server_that_imported_ray_refuses_another_jobs_worker_which_starts_fresh(tmp_path):
    """A vLLM server's Ray read the RAY_ variables when it was imported: a worker of another
    job is refused and execs a fresh interpreter (here: the client runs a script that reports
    which)."""
    import subprocess

    servers = worker_forks.ForkServers(tmp_path)
    servers.start({"RAY_JOB_ID": "01000000"}, ["ray._raylet"])
    try:
        servers.wait(timeout_s=120)
        script = tmp_path / "report.py"
        script.write_text("import sys\nprint('ray._raylet' in sys.modules)\n")

        def client(job: str) -> str:
            done = subprocess.run([sys.executable, worker_forks.__file__, "client", str(tmp_path), str(script)],
                                  env={**os.environ, "RAY_JOB_ID": job}, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()

        assert client("01000000") == "True"  # forked from the server
        assert client("02000000") == "False"  # refused: a fresh interpreter
    finally:
        servers.close()


def test_the_import_time_environment_names_the_servers_socket(tmp_path):
    base = {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "4"}

    assert worker_forks.import_time_environment(base) == {"HF_HUB_OFFLINE": "1"}
    same = worker_forks.socket_path(tmp_path, {**base, "PATH": "/usr/bin", "OMP_NUM_THREADS": "1"})
    assert same == worker_forks.socket_path(tmp_path, base)  # neither is read when torch loads
    assert worker_forks.socket_path(tmp_path, {**base, "OMP_WAIT_POLICY": "PASSIVE"}) != same
