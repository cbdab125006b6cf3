"""A vLLM engine of several GPUs inside posttrain's placement group: the executor options it
passes, and vLLM 0.32's own checks of that group passing, on a CPU machine with Ray's
logical GPUs (:mod:`tests.plugins.backends.vllm.vllm_bundles`).

Colocated with a policy of 4 ranks, an engine of 2 GPUs puts its two workers on the GPUs of
policy ranks 0 and 1, half a GPU each; separate, on 2 GPUs the policy's 2 ranks do not have,
a whole GPU each. The engine's own process holds no GPU. Before, the engine's actor held
its 2 GPUs in one bundle, which vLLM's check refuses ("Placement group bundle cannot have
more than 1 GPU"), and passed no executor, so vLLM would have run that check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.distributed.placement import DeviceBundles
from posttrain_vllm.worker import ray_executor

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[4]


def test_an_engine_of_several_gpus_runs_vllms_ray_executor_on_its_bundles():
    assert ray_executor(None) == ({}, {})
    assert ray_executor(DeviceBundles((4, 5), 0.5)) == (
        {"distributed_executor_backend": "ray"}, {"VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    )


@pytest.mark.ray
def test_vllms_placement_checks_pass_and_put_the_workers_on_the_engines_gpus():
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "tests.plugins.backends.vllm.vllm_bundles"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    colocated, separate = seen["colocated"], seen["separate"]
    for engine in (colocated, separate):
        assert engine["options"] == {"distributed_executor_backend": "ray"}
        assert engine["own_gpus"] == [] and len(engine["nodes"]) == 1 and engine["same_group"]
    assert colocated["policy"] == [["0"], ["1"], ["2"], ["3"]]
    assert colocated["workers"] == colocated["policy"][:2]
    assert colocated["env"]["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
    gpus = [gpu for (gpu,) in separate["policy"] + separate["workers"]]
    assert len(separate["policy"]) == 2 and sorted(gpus) == ["0", "1", "2", "3"]  # each its own GPU
    assert separate["env"]["VLLM_RAY_PER_WORKER_GPUS"] == "1"
