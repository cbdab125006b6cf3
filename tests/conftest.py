"""Shared fixtures: offline environment, a tiny local model, and one Ray cluster per session."""

from __future__ import annotations

import os

# Set before anything imports transformers, ray or vllm.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A seeded tiny Llama + character tokenizer saved as a Hugging Face folder."""
    from posttrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0))


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory):
    """``zoo_model(name)``: the folder of the seeded tiny checkpoint of
    :mod:`posttrain.testing.zoo` architecture ``name`` (a vision-language one included),
    built once per session."""
    from posttrain.testing.zoo import VISION_ARCHITECTURES, build_zoo_model, build_zoo_vlm

    built: dict[str, str] = {}

    def path(name: str) -> str:
        if name not in built:
            build = build_zoo_vlm if name in VISION_ARCHITECTURES else build_zoo_model
            built[name] = str(build(tmp_path_factory.mktemp(f"zoo_{name}"), name))
        return built[name]

    return path


@pytest.fixture(scope="session")
def ray_cluster(fork_servers):
    """One local Ray cluster for the whole session (4 logical CPUs on any machine); its worker
    processes start as a run's do (posttrain's setup hook), forked from servers that imported
    torch and transformers once (:mod:`tests.worker_forks`): one for the environment of this
    process, one with ``OMP_WAIT_POLICY=PASSIVE`` as GRPO's workers get it; and, once the
    cluster is up, two that imported vLLM too, for the test session's engines in the environments
    the vLLM backend gives them (their workers start fresh until these listen)."""
    import importlib.util

    import ray

    from posttrain.distributed.cluster import setup_worker_process
    from tests.worker_forks import PRELOAD, PRELOAD_VLLM, ray_environment

    if ray.is_initialized():
        yield ray
        return
    fork_servers.start({}, PRELOAD)
    fork_servers.start({"OMP_WAIT_POLICY": "PASSIVE"}, PRELOAD)
    fork_servers.wait()
    # address="local": a cluster of its own, never one a developer started with `ray start`
    hook = f"{setup_worker_process.__module__}.{setup_worker_process.__name__}"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True, configure_logging=False,
             runtime_env={"worker_process_setup_hook": hook, "py_executable": fork_servers.py_executable})
    if importlib.util.find_spec("vllm") is not None:
        # the RAY_ variables of this job's workers (job id, raylet pid), which the servers' Ray reads at import
        workers = ray.get(ray.remote(lambda: ray_environment(os.environ)).remote())
        from posttrain.config.schema import RunConfig
        from posttrain_vllm.generation import engine_environment

        engine = {**workers, **engine_environment(RunConfig())}  # a run's engines at the default log level
        fork_servers.start(engine, PRELOAD_VLLM)
        fork_servers.start({**engine, "OMP_WAIT_POLICY": "PASSIVE"}, PRELOAD_VLLM)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def fork_servers():
    """The session cluster's :class:`~tests.worker_forks.ForkServers`, killed at the session's end."""
    import shutil
    import tempfile

    from tests.worker_forks import ForkServers

    directory = tempfile.mkdtemp(prefix="posttrain-forks-")  # short: a socket's path has at most 107 bytes
    servers = ForkServers(directory)
    try:
        yield servers
    finally:
        servers.close()
        shutil.rmtree(directory, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Files holding a slow test first, then the end-to-end files, each file's tests in their
    own order. ``nox -s tests`` hands whole files to its pytest processes in this order
    (pytest-xdist ``--dist loadfile --no-loadscope-reorder``), so the longest start early and
    the short ones fill in at the end, rather than a long file starting last and running alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slow, "e2e" not in item.path.parts))


# ----------------------------------------------------------------------------- nox -s gpu


def _require_gpu() -> bool:
    from tests.gpu_session import REQUIRE_GPU_VAR

    return os.environ.get(REQUIRE_GPU_VAR) == "1"


def pytest_sessionstart(session):
    """With ``POSTTRAIN_REQUIRE_GPU=1`` (``nox -s gpu``), stop at once when torch sees no GPU,
    saying why (:func:`tests.gpu_session.machine_problem`)."""
    if _require_gpu():
        from tests.gpu_session import REQUIRE_GPU_VAR, machine_problem

        problem = machine_problem()
        if problem:
            pytest.exit(f"{REQUIRE_GPU_VAR}=1: {problem}", returncode=3)


def pytest_collectreport(report):
    """With ``POSTTRAIN_REQUIRE_GPU=1``, a test module skipped as a whole (a package missing)
    is an error."""
    if _require_gpu() and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"skipped under POSTTRAIN_REQUIRE_GPU=1: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``POSTTRAIN_REQUIRE_GPU=1``, a gpu test that skips for anything but a count of
    GPUs (``needs N GPUs``) fails: the session would pass having tested nothing."""
    outcome = yield
    report = outcome.get_result()
    if not (_require_gpu() and report.skipped and item.get_closest_marker("gpu")):
        return
    from tests.gpu_session import GPU_COUNT_SKIP

    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not GPU_COUNT_SKIP.search(reason):
        report.outcome, report.longrepr = "failed", f"skipped under POSTTRAIN_REQUIRE_GPU=1: {reason}"


@pytest.fixture
def yaml_file(tmp_path, monkeypatch):
    """``yaml_file(text)``: ``text`` written to ``exp.yaml`` in a fresh working directory; returns
    the relative path, so a config error's "where set" reads ``exp.yaml:LINE``."""
    monkeypatch.chdir(tmp_path)

    def write(text: str) -> str:
        (tmp_path / "exp.yaml").write_text(text)
        return "exp.yaml"

    return write
