"""Policy passes that read from a plane: with TransferQueue the dtensor workers fetch their
own shards and write their logprobs back, and the results equal what the same policy
computes from a batch the driver materialised (the in-memory plane's path).

Two data-parallel workers and 5 samples: the pass pads to a multiple of 2 by repeating the
last key, and only the real rows are written back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transfer_queue", reason="transferqueue is not installed (pip install posttrain-transferqueue)")

from posttrain.batch import Batch  # noqa: E402
from posttrain.builtin.memory_plane import MemoryDataPlane  # noqa: E402
from posttrain.config.schema import ClusterConfig, OptimizerConfig, PolicyConfig, RunConfig, WorkerResources  # noqa: E402
from posttrain.distributed import VirtualCluster  # noqa: E402
from posttrain.interfaces import PlaneSamples  # noqa: E402
from posttrain.plugins import new_plugin_host  # noqa: E402
from posttrain_dtensor.policy import DTensorPolicy  # noqa: E402
from posttrain_ppo.gae import AdvantageEstimate, Whitening, whitening_stats  # noqa: E402
from posttrain_sft.loss import NLLLoss  # noqa: E402
from posttrain_transferqueue.runtime import controller_running  # noqa: E402

pytestmark = [pytest.mark.transferqueue, pytest.mark.ray]

LENGTHS = [9, 14, 6, 12, 11]
FIELDS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


def samples_batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor(LENGTHS)
    positions = torch.arange(max(LENGTHS))[None, :]
    real = positions < lengths[:, None]
    return Batch(
        input_ids=torch.randint(7, 100, (len(LENGTHS), max(LENGTHS)), generator=g) * real,
        input_lengths=lengths,
        token_mask=(real & (positions >= 3)).float(),
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),
    )


def two_worker_policy(model: str, run_dir: str, head: str = "lm") -> tuple[DTensorPolicy, VirtualCluster]:
    config = RunConfig(
        seed=0,
        run_dir=run_dir,
        policy=PolicyConfig(
            model=model, head=head, num_workers=2, train_global_batch_size=4, train_micro_batch_size=2,
            logprob_micro_batch_size=2, max_total_sequence_length=32, optimizer=OptimizerConfig(name="sgd", lr=0.5),
            resources=WorkerResources(cpus=0.5),
        ),
    )
    cluster = VirtualCluster(ClusterConfig())
    return DTensorPolicy(config, cluster, name="critic" if head == "value" else "policy"), cluster


@pytest.fixture(scope="module")
def policy(ray_cluster: Any, tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DTensorPolicy]:
    policy, cluster = two_worker_policy(tiny_model_path, str(tmp_path_factory.mktemp("run")))
    yield policy
    policy.shutdown()
    cluster.shutdown()


@pytest.fixture
def queue(policy: DTensorPolicy, tmp_path: Path) -> Iterator[Any]:
    plane = new_plugin_host().data_planes["transferqueue"](RunConfig(run_dir=str(tmp_path / "tq")))
    yield plane
    plane.shutdown()
    assert not controller_running()


def record_sharded_results(policy: DTensorPolicy, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """What each of the policy's sharded passes returns to the driver from now on, in call order."""
    returned: list[list[Any]] = []
    run_sharded = policy.group.run_sharded

    def recording(method: str, shards: Any, *args: Any, **kwargs: Any) -> list[Any]:
        results = run_sharded(method, shards, *args, **kwargs)
        returned.append(results)
        return results

    monkeypatch.setattr(policy.group, "run_sharded", recording)
    return returned


def test_workers_fetch_their_shards_and_write_logprobs_back(policy: DTensorPolicy, queue: Any, monkeypatch) -> None:
    batch = samples_batch()
    keys = [f"p{i}" for i in range(len(batch))]
    memory = MemoryDataPlane()
    for plane in (memory, queue):
        plane.put("train/1", keys, batch.fields(FIELDS))

    returned = record_sharded_results(policy, monkeypatch)
    for plane in (memory, queue):
        samples = PlaneSamples(plane, "train/1", keys, FIELDS)
        policy.logprobs_into(samples, "prev_logprobs")
        policy.logprobs_into(samples, "reference_logprobs", reference=True)
    assert returned[2:] == [[None, None], [None, None]], "the TransferQueue passes returned results to the driver"

    outputs = ["prev_logprobs", "reference_logprobs"]
    expected = memory.get("train/1", keys, outputs)
    found = queue.get("train/1", keys, outputs)
    direct = policy.get_logprobs(batch)["logprobs"]
    assert torch.equal(expected["prev_logprobs"], direct)
    assert direct[:, 1:].abs().sum() > 0
    for name in outputs:
        assert torch.equal(found[name], expected[name]), name

    # Training reads the shards the same way: the same loss; a real step moves the weights.
    nll = NLLLoss()
    on_memory = policy.train_from(PlaneSamples(memory, "train/1", keys[:4], FIELDS), nll, eval_mode=True)
    on_queue = policy.train_from(PlaneSamples(queue, "train/1", keys[:4], FIELDS), nll)
    assert on_queue["loss"] == on_memory["loss"] > 0
    assert on_queue["num_tokens"] == on_memory["num_tokens"] == float(batch["token_mask"][[0, 1, 3]].sum())
    assert on_queue["grad_norm"] > 0
    assert not torch.equal(policy.get_logprobs(batch)["logprobs"], direct)
    queue.clear("train/1")


def test_workers_write_a_teachers_top_k_into_the_plane(policy: DTensorPolicy, queue: Any, monkeypatch) -> None:
    """``topk_into`` (distillation's teacher pass): the workers write the top-k fields under
    the names asked for, and the driver receives none of them; equal to the in-memory path."""
    batch = samples_batch()
    keys = [f"p{i}" for i in range(len(batch))]
    fields = {"topk_indices": "topk_indices", "teacher_topk_logprobs": "topk_logprobs"}
    memory = MemoryDataPlane()
    returned = record_sharded_results(policy, monkeypatch)
    for plane in (memory, queue):
        plane.put("train/2", keys, batch.fields(FIELDS))
        policy.topk_into(PlaneSamples(plane, "train/2", keys, FIELDS), 4, fields)
    assert returned[1] == [None, None], "the TransferQueue pass returned results to the driver"
    expected, found = memory.get("train/2", keys, list(fields)), queue.get("train/2", keys, list(fields))
    direct = policy.get_topk_logits(batch, 4)
    assert torch.equal(expected["teacher_topk_logprobs"], direct["topk_logprobs"])
    for name in fields:
        assert torch.equal(found[name], expected[name]), name
    queue.clear("train/2")


def test_a_critics_workers_write_its_values_into_the_plane(
    ray_cluster: Any, tiny_model_path: str, queue: Any, tmp_path: Path, monkeypatch
) -> None:
    """``values_into`` (PPO's critic pass): the workers write the values, the driver receives
    none of them; equal to the in-memory path and to ``get_values`` on the batch. Then
    ``map_into`` (PPO's advantage estimate and whitening) on the same workers."""
    critic, cluster = two_worker_policy(tiny_model_path, str(tmp_path / "run"), head="value")
    try:
        batch = samples_batch()
        keys = [f"p{i}" for i in range(len(batch))]
        memory = MemoryDataPlane()
        returned = record_sharded_results(critic, monkeypatch)
        for plane in (memory, queue):
            plane.put("train/3", keys, batch.fields(FIELDS))
            critic.values_into(PlaneSamples(plane, "train/3", keys, FIELDS), "critic_values")
        assert returned[1] == [None, None], "the TransferQueue pass returned results to the driver"
        expected, found = memory.get("train/3", keys, ["critic_values"]), queue.get("train/3", keys, ["critic_values"])
        direct = critic.get_values(batch)["values"]
        assert torch.equal(expected["critic_values"], direct)
        assert direct.abs().sum() > 0
        assert torch.equal(found["critic_values"], expected["critic_values"])

        # PPO's advantage estimate, mapped by the critic's workers over their shards: the driver
        # receives sums only; fields and sums equal the in-memory path's (one map over all rows).
        rewards = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0])
        inputs = ["critic_values", "shaped_rewards", "token_mask", "sample_mask"]
        sums, before = [], len(returned)
        for plane in (memory, queue):
            plane.put("train/3", keys, {"shaped_rewards": rewards})
            sums.append(critic.map_into(PlaneSamples(plane, "train/3", keys, inputs), AdvantageEstimate("critic_values", 1.0, 0.9)))
            mean, std = whitening_stats(sums[-1])
            critic.map_into(PlaneSamples(plane, "train/3", keys, ["advantages", "token_mask", "sample_mask"]), Whitening(mean, std))
        # the in-memory maps run in the driver; each TransferQueue map returns one dict of floats per worker
        assert len(returned) == before + 2
        for results in returned[before:]:
            assert all(isinstance(r, dict) and all(isinstance(v, float) for v in r.values()) for r in results), results
        assert sums[1] == pytest.approx(sums[0], rel=1e-12) and sums[0]["tokens"] == float(batch["token_mask"][[0, 1, 3, 4]].sum())
        outputs = ["advantages", "returns", "old_values"]
        expected, found = memory.get("train/3", keys, outputs), queue.get("train/3", keys, outputs)
        for name in outputs:
            torch.testing.assert_close(found[name], expected[name], rtol=1e-6, atol=1e-7)
        assert expected["advantages"].abs().sum() > 0
        queue.clear("train/3")
    finally:
        critic.shutdown()
        cluster.shutdown()
