"""What ``nox -s gpu`` runs and the rules that keep it from passing with nothing tested.

- **Its tests** are the files that hold tests marked ``gpu`` (:func:`gpu_test_files`), and
  only those: pytest collects every module it is given before ``-m gpu`` filters, so one
  module that cannot be imported in the session's environment (an example plugin it does not
  install, a CPU-only package) fails the whole session.
- **Its packages** are core, every plugin (``noxfile.py``'s ``PLUGINS``) and
  :data:`SESSION_PACKAGES`; ``tests/test_gpu_session.py`` checks on a CPU machine that every
  module its test files import is one of them, a dependency they declare, or the standard
  library, and that collection of ``-m gpu`` over those files succeeds.
- **The machine**: :func:`main` stops the session before it installs anything on a machine
  without an NVIDIA driver (``driver``), and right after it installs torch when torch sees no
  CUDA device (``check``), saying why (a CPU build, or a driver older than the CUDA torch was
  built for) and what to install (``POSTTRAIN_TORCH_INDEX`` picks torch's package index).
- **Skips**: with :data:`REQUIRE_GPU_VAR` set (the session sets it), a gpu test may skip only
  for lack of GPUs, its reason saying ``needs N GPUs`` (:data:`GPU_COUNT_SKIP`); any other
  skip (CUDA not available, a package missing) fails (``tests/conftest.py``).

This module imports nothing but the standard library at module level: the session runs it
before anything but torch is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Set to 1 by ``nox -s gpu``: a gpu test that skips for anything but a count of GPUs fails.
REQUIRE_GPU_VAR = "POSTTRAIN_REQUIRE_GPU"
#: The skip reason a gpu test may give under :data:`REQUIRE_GPU_VAR` (the machine has too few GPUs).
GPU_COUNT_SKIP = re.compile(r"\bneeds \d+ GPUs\b")
#: What the session installs besides core and the plugins (requirement -> import name): the
#: GPU build of vLLM, megatron-core and Transformer Engine (megatron's fused layers), pytest.
SESSION_PACKAGES = {
    "vllm": "vllm",
    "megatron-core": "megatron",
    "transformer-engine[pytorch]": "transformer_engine",
    "pytest": "pytest",
}
#: Where tests live (``pyproject.toml``'s ``testpaths``).
TEST_ROOTS = ("tests", "examples/plugins")
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files (relative to ``root``) that hold tests marked ``gpu``."""
    found = []
    for folder in TEST_ROOTS:
        for path in sorted((root / folder).rglob("test_*.py")):
            if GPU_MARK.search(path.read_text()):
                found.append(str(path.relative_to(root)))
    return found


def driver_cuda(nvidia_smi: str) -> tuple[int, int] | None:
    """The newest CUDA version the driver supports, from ``nvidia-smi``'s header
    (``CUDA Version: 12.4``); None when it does not say."""
    match = re.search(r"CUDA Version\s*:\s*(\d+)\.(\d+)", nvidia_smi)
    return (int(match[1]), int(match[2])) if match else None


def cuda_problem(*, torch_version: str, torch_cuda: str | None, cuda_available: bool,
                 nvidia_smi: str | None) -> str | None:
    """Why torch cannot compute on a GPU here, with what to install; None when it can.
    ``nvidia_smi``: that command's output, None when the machine has no such command."""
    if cuda_available:
        return None
    if nvidia_smi is None:
        return NO_DRIVER
    if torch_cuda is None:
        return (f"torch {torch_version} is a CPU build (torch.version.cuda is None). Install a CUDA build, e.g. "
                "POSTTRAIN_TORCH_INDEX=https://download.pytorch.org/whl/cu126 nox -s gpu")
    driver = driver_cuda(nvidia_smi)
    needed = tuple(int(part) for part in torch_cuda.split(".")[:2])
    if driver is not None and driver < needed:
        return (f"torch {torch_version} is built for CUDA {torch_cuda}, but the NVIDIA driver supports CUDA up to "
                f"{driver[0]}.{driver[1]} (nvidia-smi), so torch sees no GPU. Install a driver for CUDA {torch_cuda} "
                "or newer, or a torch built for the driver's CUDA: POSTTRAIN_TORCH_INDEX="
                f"https://download.pytorch.org/whl/cu{driver[0]}{driver[1]} nox -s gpu (torch's index serves the "
                "versions it builds; pick the newest CUDA at most the driver's).")
    return (f"torch {torch_version} (CUDA {torch_cuda}) sees no GPU although nvidia-smi answers (driver CUDA "
            f"{'unknown' if driver is None else f'{driver[0]}.{driver[1]}'}): check CUDA_VISIBLE_DEVICES and that "
            "nvidia-smi lists a GPU.")


NO_DRIVER = ("no GPU on this machine: nvidia-smi is not installed, so there is no NVIDIA driver. nox -s gpu "
             "runs on a machine with a CUDA GPU; on this one run nox -s tests.")


def nvidia_smi() -> str | None:
    """What ``nvidia-smi`` prints, or None when the machine has no such command."""
    smi = shutil.which("nvidia-smi")
    return subprocess.run([smi], capture_output=True, text=True).stdout if smi else None


def machine_problem() -> str | None:
    """:func:`cuda_problem` of this machine and this process's torch."""
    import torch

    return cuda_problem(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                        cuda_available=torch.cuda.is_available(), nvidia_smi=nvidia_smi())


def main(argv: list[str]) -> int:
    """``files``: print :func:`gpu_test_files`; ``packages``: the session's packages;
    ``driver``: exit 1 when the machine has no NVIDIA driver (no torch needed, so the session
    asks before installing anything); ``check``: exit 1 with :func:`machine_problem`."""
    problem = None
    if argv == ["files"]:
        print("\n".join(gpu_test_files()))
    elif argv == ["packages"]:
        print("\n".join(SESSION_PACKAGES))
    elif argv == ["driver"]:
        problem = None if shutil.which("nvidia-smi") else NO_DRIVER
    elif argv == ["check"]:
        problem = machine_problem()
    else:
        print("usage: python -m tests.gpu_session files|packages|driver|check", file=sys.stderr)
        return 2
    if problem:
        print(f"nox -s gpu: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
