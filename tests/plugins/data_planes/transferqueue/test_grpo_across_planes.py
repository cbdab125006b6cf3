"""The same GRPO run through the in-memory plane and through TransferQueue logs the same
metrics at every step; so does the same PPO run, whose advantage estimate the critic's
workers compute next to the data.

With TransferQueue the policy workers fetch their own shards from the queue and write their
logprobs back (the driver plans from ``input_lengths`` alone); with the in-memory plane the
driver materialises every batch. The GRPO loop is the same code in both runs. Two
data-parallel policy workers and a KL penalty make every pass (reference logprobs, train)
go through the sharded-by-reference path; dynamic sampling makes every step
train on groups whose rewards differ, so every step moves the weights. In the TransferQueue
runs the driver reads per-sample fields and lengths only, never a per-token field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest.mock import ANY

import attrs
import pytest

pytest.importorskip("transfer_queue", reason="transferqueue is not installed (pip install posttrain-transferqueue)")

from posttrain.backend.policy_driver import ShardedPolicy  # noqa: E402
from posttrain.config.schema import DataPlaneConfig, RunConfig, WorkerResources  # noqa: E402
from posttrain.run.context import run_algorithm  # noqa: E402
from posttrain.run.metrics import read_metrics  # noqa: E402
from posttrain_grpo.config import ClippedPGConfig, DynamicSamplingConfig, GRPOConfig  # noqa: E402
from posttrain_ppo.config import PPOConfig  # noqa: E402
from posttrain_transferqueue.plane import TransferQueueDataPlane  # noqa: E402
from posttrain_transferqueue.runtime import controller_running  # noqa: E402
from tests.e2e.test_grpo_e2e import make_config, seven_rows, write_rows  # noqa: E402

pytestmark = [pytest.mark.transferqueue, pytest.mark.ray]

#: Prefixes of metrics that measure time; excluded from the comparison.
TIMING_PREFIXES = ("timing/", "throughput/")
#: Metrics, by exact name, that measure time (``time``: when the record was written);
#: excluded from the comparison.
TIMING_NAMES = ("time", "refit/seconds", "step_time_s", "critic/step_time_s")


def untimed(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES) and k not in TIMING_NAMES}


def grpo_config(model: str, run_dir: Path, train: str, plane: str) -> RunConfig:
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2,
                      loss=ClippedPGConfig(kl_penalty=0.05),
                      dynamic_sampling=DynamicSamplingConfig(enabled=True, max_gen_batches=20))
    config = make_config(model, run_dir, train, grpo, data_plane=DataPlaneConfig(backend=plane))
    half = grpo.samples_per_step // 2
    # 2 x 0.25 + generation 0.5 + TransferQueue 2 = 3 of the session cluster's 4 CPUs
    policy = attrs.evolve(config.policy, num_workers=2, train_micro_batch_size=half, logprob_micro_batch_size=half,
                          resources=WorkerResources(cpus=0.25))
    generation = attrs.evolve(config.generation, resources=WorkerResources(cpus=0.5))
    return attrs.evolve(config, policy=policy, generation=generation)


#: Per-token fields of a GRPO or PPO step. The driver never reads them from TransferQueue: the
#: workers read and write them (the driver writes the rollout's ``input_ids`` and masks itself).
PER_TOKEN_FIELDS = {"input_ids", "token_mask", "generation_logprobs", "prev_logprobs", "reference_logprobs",
                    "critic_values", "returns", "old_values"}


def record_driver_reads(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The fields of every read the driver makes from TransferQueue from now on (the workers'
    reads happen in their own processes)."""
    fetched: list[set[str]] = []
    get = TransferQueueDataPlane.get

    def recording(self: TransferQueueDataPlane, partition: str, keys: Any, fields: Any) -> Any:
        fetched.append(set(fields))
        return get(self, partition, keys, fields)

    monkeypatch.setattr(TransferQueueDataPlane, "get", recording)
    return fetched


def both_runs(tmp_path: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The in-memory run's and the TransferQueue run's train records, step by step (steps 1 and 2)."""
    memory = read_metrics(tmp_path / "memory" / "metrics.jsonl", "train")
    queue = read_metrics(tmp_path / "tq" / "metrics.jsonl", "train")
    assert [r["step"] for r in memory] == [r["step"] for r in queue] == [1, 2]
    return list(zip(memory, queue, strict=True))


@pytest.mark.slow  # two GRPO runs: about 1.5 min on 2 shared cores (test_policy_passes.py is the quick check)
def test_grpo_logs_identical_metrics_with_either_plane(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    train = write_rows(tmp_path / "train.jsonl", seven_rows(64))
    run_algorithm(grpo_config(tiny_model_path, tmp_path / "memory", train, "memory"))

    # Record what the driver gets back from the policy workers in the TransferQueue run.
    returned: list[tuple[str, Any]] = []
    run_pass = ShardedPolicy._run_pass

    def recording(self: ShardedPolicy, method: Any, work: list, *args: Any) -> Any:
        results = run_pass(self, method, work, *args)
        returned.append((method.__name__, args, results[1]))
        return results

    monkeypatch.setattr(ShardedPolicy, "_run_pass", recording)
    fetched = record_driver_reads(monkeypatch)
    run_algorithm(grpo_config(tiny_model_path, tmp_path / "tq", train, "transferqueue"))

    pairs = both_runs(tmp_path)
    for expected, found in pairs:
        assert untimed(found) == untimed(expected), f"step {expected['step']}"
        assert expected["grad_norm"] > 0
    assert pairs[-1][0]["kl_penalty"] > 0  # step 2 trained away from the reference: the reference pass counts

    # Per step, on policy (one optimizer step per batch): no previous-logprob pass (the loss
    # uses the training pass's own logprobs), one reference-logprob pass written by the
    # workers into the queue (nothing returned), then one train pass returning metrics only.
    assert [(method, args) for method, args, _ in returned] == [("logprobs", (True,)), ("train", ANY)] * 2
    for method, _, results in returned:
        if method == "logprobs":
            assert results == [None, None], "logprobs reached the driver"
        else:
            assert all(set(r) <= {"loss", "metrics", "num_tokens", "lr", "grad_norm", "step_time_s"} for r in results)
    assert fetched and all(not (fields & PER_TOKEN_FIELDS) for fields in fetched), fetched
    assert not controller_running(), "the run's TransferQueue (and every partition in it) outlived the run"


def ppo_config(model: str, run_dir: Path, train: str, plane: str) -> RunConfig:
    """The GRPO run above as PPO, with two data-parallel critic workers (0.25 CPU each)."""
    config = grpo_config(model, run_dir, train, plane)
    return attrs.evolve(config, algorithm="ppo", sections={**config.sections, "ppo": PPOConfig(critic=config.policy)})


@pytest.mark.slow  # two PPO runs: about a minute on 2 shared cores
def test_ppo_logs_identical_metrics_with_either_plane(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    train = write_rows(tmp_path / "train.jsonl", seven_rows(64))
    run_algorithm(ppo_config(tiny_model_path, tmp_path / "memory", train, "memory"))

    fetched = record_driver_reads(monkeypatch)
    run_algorithm(ppo_config(tiny_model_path, tmp_path / "tq", train, "transferqueue"))

    for expected, found in both_runs(tmp_path):
        # the sums behind the whitening are added over two shards instead of one batch: equal to
        # rounding, which for the loss of whitened advantages (a sum of O(1) terms near 0) is
        # float32's epsilon, 1.2e-7
        numbers = {k: v for k, v in untimed(expected).items() if isinstance(v, float)}
        assert {k: v for k, v in untimed(found).items() if k not in numbers} == {
            k: v for k, v in untimed(expected).items() if k not in numbers}, f"step {expected['step']}"
        assert {k: untimed(found)[k] for k in numbers} == pytest.approx(numbers, rel=1e-6, abs=2e-7), expected["step"]
        assert expected["critic/grad_norm"] > 0 and expected["ppo/values_mean"] != 0
    assert fetched and all(not (fields & PER_TOKEN_FIELDS) for fields in fetched), fetched
    assert not controller_running()


@pytest.mark.slow  # two GRPO runs of a vision-language model: about 40 s on 2 shared cores
def test_image_samples_log_identical_metrics_with_either_plane(ray_cluster, zoo_model, tmp_path, monkeypatch):
    """Image prompts (tiny Qwen2-VL): the images travel with their samples through
    TransferQueue to two data-parallel policy workers, and the driver reads none back."""
    from posttrain.testing.shapes import write_counting_rows
    from tests.e2e.test_vision_language_grpo import grpo_config as image_grpo_config

    prompts = str(write_counting_rows(tmp_path / "shapes", 8, seed=3, prompts=True, text_rows=1))

    def config(plane: str) -> RunConfig:
        base = image_grpo_config(zoo_model("qwen2_vl"), prompts, tmp_path / ("tq" if plane == "transferqueue" else plane))
        half = base.policy.train_global_batch_size // 2
        policy = attrs.evolve(base.policy, num_workers=2, train_micro_batch_size=half, logprob_micro_batch_size=half,
                              resources=WorkerResources(cpus=0.25))
        generation = attrs.evolve(base.generation, resources=WorkerResources(cpus=0.5))
        return attrs.evolve(base, policy=policy, generation=generation, data_plane=DataPlaneConfig(backend=plane))

    run_algorithm(config("memory"))
    fetched = record_driver_reads(monkeypatch)
    run_algorithm(config("transferqueue"))
    for expected, found in both_runs(tmp_path):
        assert untimed(found) == untimed(expected), f"step {expected['step']}"
    image_fields = {"pixel_values", "image_grid_thw"}
    assert fetched and all(not (fields & (PER_TOKEN_FIELDS | image_fields)) for fields in fetched), fetched
