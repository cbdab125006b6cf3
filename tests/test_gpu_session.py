"""``nox -s gpu`` cannot pass having tested nothing (:mod:`tests.gpu_session`), checked on a CPU
machine without installing its packages:

- its test files (those holding gpu tests) import only what the session installs, the
  standard library or the tests' own helpers; the whole test tree would not (the example
  plugin ``posttrain-policy-torch``, whose tests failed the session's collection before),
  which is why the session collects only those files;
- ``pytest --collect-only -m gpu`` over them succeeds and finds the gpu tests;
- without an NVIDIA driver the session stops before installing anything, and with the
  session's flag pytest stops saying there is no GPU; a gpu test that skips for lack of CUDA
  fails under the flag, one that skips for lack of GPUs does not;
- a driver older than torch's CUDA build is named, with the torch index to install from.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.gpu_session import NO_DRIVER, REQUIRE_GPU_VAR, SESSION_PACKAGES, cuda_problem, gpu_test_files

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ["core", *sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("plugins/*/*/pyproject.toml"))]


def module_imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports when it is imported (not in functions)."""
    names = set()
    for node in ast.walk(ast.Module(body=[n for n in ast.parse(path.read_text()).body
                                          if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)],
                                    type_ignores=[])):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def with_conftests(files: list[str]) -> list[Path]:
    """The files and every conftest.py pytest loads for them."""
    found = {ROOT / name for name in files}
    for name in files:
        for folder in (ROOT / name).parents:
            if (folder / "conftest.py").exists() and (folder == ROOT or ROOT in folder.parents):
                found.add(folder / "conftest.py")
    return sorted(found)


def session_modules() -> set[str]:
    """What the gpu session's environment can import: its packages (core, the plugins and
    their declared dependencies, :data:`SESSION_PACKAGES`), the tests' helpers, the standard
    library."""
    provides: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), set()).add(module)
    modules = {"tests", *sys.stdlib_module_names, *SESSION_PACKAGES.values()}
    for folder in INSTALLED:
        modules |= {package.name for package in (ROOT / folder / "src").iterdir() if (package / "__init__.py").exists()}
        for requirement in tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]["dependencies"]:
            name = re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=~!;]", requirement, maxsplit=1)[0]).lower()
            modules |= provides.get(name, set())
    return modules


def test_the_gpu_tests_import_only_what_the_session_installs():
    files = gpu_test_files()
    assert {"tests/e2e/test_gpu.py", "tests/plugins/backends/megatron/test_gpu.py"} <= set(files), files
    allowed = session_modules()
    missing = {str(path.relative_to(ROOT)): sorted(module_imports(path) - allowed) for path in with_conftests(files)}
    assert not {name: found for name, found in missing.items() if found}
    # the whole test tree, which the session collected before, imports an example plugin it does not install
    everything = [str(p.relative_to(ROOT)) for root in ("tests", "examples/plugins") for p in (ROOT / root).rglob("test_*.py")]
    beyond = set().union(*(module_imports(path) for path in with_conftests(everything))) - allowed
    assert "posttrain_policy_torch" in beyond, beyond


def test_collecting_the_gpu_tests_succeeds():
    env = {key: value for key, value in os.environ.items() if key != REQUIRE_GPU_VAR}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *gpu_test_files()],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert any("test_gpu_layout_matches_the_reference" in line for line in collected), done.stdout
    assert any("test_train_then_sync_gives_the_trainers_logprobs" in line for line in collected), done.stdout


def test_without_a_driver_the_session_stops_before_installing_anything(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi on it
    done = subprocess.run([sys.executable, "-m", "tests.gpu_session", "driver"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (1, f"nox -s gpu: {NO_DRIVER}")
    noxfile = (ROOT / "noxfile.py").read_text()
    assert '"tests.gpu_session", "driver"' in noxfile and f'"{REQUIRE_GPU_VAR}": "1"' in noxfile


def test_under_the_flag_pytest_stops_on_a_machine_without_a_gpu(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{Path(sys.executable).parent}", REQUIRE_GPU_VAR: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/e2e/test_gpu.py"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 3, done.stdout[-2000:]
    assert f"{REQUIRE_GPU_VAR}=1: {NO_DRIVER}" in done.stdout + done.stderr


def test_under_the_flag_a_gpu_test_may_skip_only_for_lack_of_gpus(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collectreport, pytest_runtest_makereport  # noqa: F401\n"
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'gpu: needs a CUDA GPU')\n"
    )
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n"
        "@pytest.mark.gpu\n@pytest.mark.skipif(True, reason='needs a CUDA GPU')\ndef test_no_cuda(): pass\n"
        "@pytest.mark.gpu\n@pytest.mark.skipif(True, reason='tp2 needs 2 GPUs')\ndef test_two_gpus(): pass\n"
        "@pytest.mark.skipif(True, reason='not a gpu test')\ndef test_cpu(): pass\n"
    )
    env = {**os.environ, REQUIRE_GPU_VAR: "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "2 skipped, 1 error" in done.stdout, done.stdout[-2000:]  # a skip at setup fails as an error there
    assert "ERROR at setup of test_no_cuda" in done.stdout
    assert "skipped under POSTTRAIN_REQUIRE_GPU=1: Skipped: needs a CUDA GPU" in done.stdout, done.stdout[-2000:]


def test_a_driver_too_old_for_torchs_cuda_build_is_named_with_what_to_install():
    old = cuda_problem(torch_version="2.13.0", torch_cuda="13.0", cuda_available=False,
                       nvidia_smi="| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |")
    assert old.startswith("torch 2.13.0 is built for CUDA 13.0, but the NVIDIA driver supports CUDA up to 12.4 "
                          "(nvidia-smi), so torch sees no GPU."), old
    assert "POSTTRAIN_TORCH_INDEX=https://download.pytorch.org/whl/cu124 nox -s gpu" in old
    assert cuda_problem(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=False,
                        nvidia_smi="CUDA Version: 13.0").startswith("torch 2.13.0+cpu is a CPU build")
    assert cuda_problem(torch_version="2.13.0", torch_cuda="13.0", cuda_available=True, nvidia_smi=None) is None
