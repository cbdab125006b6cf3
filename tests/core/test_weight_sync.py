"""Weight sync: layer groups and buckets, and a real broadcast from a sender to engines in
Ray actors, through the same code a policy's ranks run (posttrain.backend.weight_sync)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch

from posttrain.backend.hf_export import bucket_names
from posttrain.backend.weight_sync import (
    SHARED_MEMORY_DIR,
    BroadcastEndpoint,
    BroadcastReceiver,
    GatheredWeights,
    ParamMeta,
    TransferInit,
    TransferPlan,
    bucket_layout,
    checksum,
    checksums_match,
    cuda_ipc_route,
    layer_groups,
)
from posttrain.config.schema import ClusterConfig, WorkerResources
from posttrain.distributed import VirtualCluster, Worker, WorkerGroup
from posttrain.distributed.placement import DevicePlacement
from posttrain.errors import WorkerError
from posttrain.run.refit import refit
from posttrain.testing.generation import ExportedWeights

WEIGHTS = {
    "model.embed_tokens.weight": torch.randn(7, 5),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(5, 5, dtype=torch.bfloat16),
    "model.layers.0.mlp.up_proj.weight": torch.randn(3, 5, dtype=torch.float64),
    "model.layers.1.self_attn.q_proj.weight": torch.randn(5, 5),
    "model.layers.1.count": torch.arange(4),  # int64
    "model.norm.weight": torch.randn(5),
    "lm_head.weight": torch.randn(7, 5),
}


def metas(weights=WEIGHTS) -> list[ParamMeta]:
    return [ParamMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in weights.items()]


def test_layer_groups_cut_at_decoder_layers_with_embeddings_first_and_head_last():
    names = ["model.embed_tokens.weight", "model.layers.1.a", "model.layers.0.b", "model.layers.1.c",
             "model.norm.weight", "lm_head.weight", "model.layers.10.d"]
    assert layer_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.b"],
        ["model.layers.1.a", "model.layers.1.c"],
        ["model.layers.10.d"],
        ["model.norm.weight", "lm_head.weight"],
    ]


def test_buckets_are_the_export_buckets_and_cover_every_tensor_once():
    plan = TransferPlan.build(metas(), bucket_bytes=150)
    names = [[plan.metas[i].name for i in bucket] for bucket in plan.buckets]
    assert names == bucket_names([(m.name, m.nbytes) for m in plan.metas], 150)
    assert len(plan.buckets) > 3 and sorted(i for b in plan.buckets for i in b) == list(range(len(WEIGHTS)))
    assert plan.total_bytes == sum(t.numel() * t.element_size() for t in WEIGHTS.values())
    for index, bucket in enumerate(plan.buckets):
        assert sum(plan.metas[i].nbytes for i in bucket) <= 150 or len(bucket) == 1
        assert all(offset % 16 == 0 for offset in plan.offsets(index))  # each tensor viewable as its dtype
    with pytest.raises(ValueError, match=r"bucket size must be positive \(generation.refit_bucket_bytes\), got 0"):
        bucket_layout(metas(), 0)


def test_gathered_weights_yield_in_the_order_of_their_metadata_whatever_the_export_order():
    """A backend may list the final norm between layers, or layer 10 before layer 2: the plan
    follows the order the sender yields, so both sides cut the stream alike."""
    shuffled = ["model.layers.10.w", "model.norm.weight", "model.layers.2.w", "model.embed_tokens.weight"]
    tensors = {name: torch.full((2,), float(i)) for i, name in enumerate(shuffled)}
    source = GatheredWeights([ParamMeta(n, (2,), "float32") for n in shuffled], lambda names: {n: tensors[n] for n in names})
    yielded = [name for name, _ in source.layers()]
    assert yielded == [meta.name for meta in source.metadata]
    # layers by number; names seen after the first layer form the last group, in their order
    assert yielded == ["model.layers.2.w", "model.layers.10.w", "model.norm.weight", "model.embed_tokens.weight"]


def test_gathered_weights_hold_one_layer_group_at_a_time():
    gathered: list[list[str]] = []

    def gather(names):
        gathered.append(list(names))
        return {name: WEIGHTS[name] for name in names}

    source = GatheredWeights(metas(), gather)
    assert [name for name, _ in source.layers()] == list(WEIGHTS)
    assert gathered == layer_groups(list(WEIGHTS))
    largest = max(sum(WEIGHTS[n].numel() * WEIGHTS[n].element_size() for n in group) for group in gathered)
    assert source.peak_group_bytes == largest


class Engine(Worker):
    """An engine that keeps what the sync sends it (clones of each tensor, by name)."""

    def __init__(self, refuse: str | None = None, stall_s: float = 0.0):
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}
        self.refuse = refuse
        self.stall_s = stall_s
        self.version = -1

    def init_weight_transfer(self, init: TransferInit) -> None:
        time.sleep(self.stall_s)
        if self.refuse and any(m.name == self.refuse for m in init.plan.metas):
            raise ValueError(f"this engine has no parameter {self.refuse}")
        self.receiver = BroadcastReceiver(init)

    def receive_weights(self, version: int) -> list[str]:
        self.receiver.receive(lambda bucket: self.received.update({n: t.clone() for n, t in bucket}))
        self.version = version
        return []

    def state(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, self.received

    def busy(self, seconds: float) -> None:
        """Stand for a generate call: the actor takes no other call meanwhile."""
        time.sleep(seconds)

    def sent_checksums(self) -> dict[str, tuple[float, float]]:
        return self.receiver.sent_checksums


class Engines:
    """A generation backend's weight endpoint over a group of :class:`Engine` actors; with
    ``nodes``, the endpoint knows the engines share the sender's node (shared memory)."""

    def __init__(self, group: WorkerGroup, *, nodes: bool = False, timeout_s: float = 30, refit_wait_s: float = 30,
                 checksums: bool = False):
        self.endpoint = BroadcastEndpoint(tuple(group.actors), 1, "gloo", name="engines", timeout_s=timeout_s,
                                          refit_wait_s=refit_wait_s, engine_nodes=tuple(group.node_ids) if nodes else (),
                                          checksums=checksums)

    def weight_endpoint(self) -> BroadcastEndpoint:
        return self.endpoint

    def refit_window(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    vc = VirtualCluster(ClusterConfig())
    yield vc
    vc.shutdown()


@pytest.mark.parametrize(("same_node", "transport"), [(False, "gloo"), (True, "shared memory")])
def test_a_sync_reaches_every_engine_bit_for_bit_in_buckets(cluster, same_node, transport):
    shared_files = set(Path(SHARED_MEMORY_DIR).glob("posttrain-weights-*"))
    with WorkerGroup(cluster, Engine, name="engines", num_workers=2, resources=WorkerResources(cpus=0.25)) as group:
        stats = refit(ExportedWeights(WEIGHTS), Engines(group, nodes=same_node), bucket_bytes=150, version=7)
        assert stats.transport == transport
        assert set(Path(SHARED_MEMORY_DIR).glob("posttrain-weights-*")) == shared_files  # unlinked once mapped
        plan = TransferPlan.build(metas(), 150)
        assert (stats.bytes_moved, stats.num_tensors, stats.num_buckets) == (plan.total_bytes, len(WEIGHTS), len(plan.buckets))
        largest_bucket = max(plan.bucket_bytes(i) for i in range(len(plan.buckets)))
        assert stats.peak_staging_bytes <= largest_bucket + max(t.numel() * t.element_size() for t in WEIGHTS.values()) * 2
        assert stats.seconds > 0
        for version, received in group.run_all(Engine.state):
            assert version == 7 and received.keys() == WEIGHTS.keys()
            for name, tensor in WEIGHTS.items():
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


@pytest.mark.parametrize("same_node", [False, True])
def test_a_sync_with_checksums_delivers_the_senders_checksum_of_every_tensor(cluster, same_node):
    with WorkerGroup(cluster, Engine, name="engines", num_workers=1, resources=WorkerResources(cpus=0.25)) as group:
        refit(ExportedWeights(WEIGHTS), Engines(group, nodes=same_node, checksums=True), bucket_bytes=150, version=3)
        [(version, received)] = group.run_all(Engine.state)
        [sent] = group.run_all(Engine.sent_checksums)
    assert version == 3 and all(torch.equal(received[name], tensor) for name, tensor in WEIGHTS.items())
    assert sent == {name: checksum(tensor) for name, tensor in WEIGHTS.items()}


def test_a_plan_with_checksums_ends_each_bucket_with_an_aligned_float64_pair_per_tensor():
    plain, summed = TransferPlan.build(metas(), 150), TransferPlan.build(metas(), 150, checksums=True)
    assert plain.buckets == summed.buckets and plain.offsets(1) == summed.offsets(1)
    for bucket in range(len(summed.buckets)):
        start = summed.checksum_offset(bucket)
        assert start % 16 == 0 and start >= plain.bucket_bytes(bucket)
        assert summed.bucket_bytes(bucket) == start + 16 * len(summed.buckets[bucket])
        buffer = torch.zeros(summed.bucket_bytes(bucket), dtype=torch.uint8)
        assert summed.bucket_checksums(bucket, buffer).shape == (len(summed.buckets[bucket]), 2)


def test_checksums_match_up_to_rounding_to_the_coarser_dtype_and_no_further():
    weights = torch.randn(1000, dtype=torch.float64)
    sent = checksum(weights)
    rounded = checksum(weights.to(torch.bfloat16))
    assert checksums_match(sent, rounded, torch.bfloat16)
    assert not checksums_match(sent, rounded, torch.float32)
    one_changed = weights.clone()
    one_changed[17] += 1e-3
    assert not checksums_match(sent, checksum(one_changed.float()), torch.float32)
    assert not checksums_match(sent, checksum(-weights), torch.float64)  # same absolute values, other sum
    assert checksum(torch.stack([weights[:500], weights[500:]])) == pytest.approx(sent, rel=1e-12)


def test_an_nccl_sync_goes_through_cuda_ipc_only_when_every_engine_is_on_the_senders_gpu():
    """NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected", seen on an
    H200): engines colocated on rank 0's GPU take the CUDA IPC route, engines elsewhere the
    broadcast, and a mix of the two is refused before anything is sent."""
    rank0 = DevicePlacement("node-a", ("0",))
    assert cuda_ipc_route(rank0, [DevicePlacement("node-a", ("0",))] * 2, 1, "generation")
    assert not cuda_ipc_route(rank0, [DevicePlacement("node-a", ("1",)), DevicePlacement("node-b", ("0",))], 1, "generation")
    assert not cuda_ipc_route(rank0, [DevicePlacement("node-a")], 1, "generation")  # an engine on the CPU
    with pytest.raises(WorkerError, match=r"^weight sync to generation: engine\(s\) \[0\] compute on GPU \['0'\] of the "
                                          r"policy's rank 0 and engine\(s\) \[1\] do not; .*generation.weight_transport: gloo"):
        cuda_ipc_route(rank0, [DevicePlacement("node-a", ("0",)), DevicePlacement("node-a", ("1",))], 1, "generation")
    with pytest.raises(WorkerError, match=r"and each engine has 2 ranks; "):
        cuda_ipc_route(rank0, [DevicePlacement("node-a", ("0", "1"))], 2, "generation")


def test_a_worker_reports_its_node_and_no_gpus_on_the_cpu(cluster):
    with WorkerGroup(cluster, Engine, name="placed", num_workers=1, resources=WorkerResources(cpus=0.25)) as group:
        [where] = group.run_all(Engine.devices)
        assert where == DevicePlacement(group.node_ids[0], ())


def test_an_engine_that_refuses_the_plan_is_named_at_once(cluster):
    """Both engines refuse; the first to answer is named (the lower one when they answer together)."""
    with WorkerGroup(cluster, Engine, name="picky", num_workers=2, resources=WorkerResources(cpus=0.25),
                     kwargs={"refuse": "lm_head.weight"}) as group:
        with pytest.raises(WorkerError, match=r"weight sync: engines engine [01] init_weight_transfer\(\) failed: "
                                              r"ValueError: this engine has no parameter lm_head.weight"):
            refit(ExportedWeights(WEIGHTS), Engines(group), bucket_bytes=150)


def test_engines_that_do_not_join_in_time_are_named_and_a_later_sync_still_connects(cluster):
    with WorkerGroup(cluster, Engine, name="slow", num_workers=2, resources=WorkerResources(cpus=0.25),
                     kwargs={"stall_s": 1.5}) as group:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"^weight sync: engines rank\(s\) \[1, 2\] of the sync group did not join "
                                              r"within 0.5 s \(generation.refit_wait_s\)$"):
            refit(ExportedWeights(WEIGHTS), Engines(group, timeout_s=0.5, refit_wait_s=0.5), bucket_bytes=150)
        assert time.monotonic() - start < 1.5  # raised at the timeout, not when the engines came
        stats = refit(ExportedWeights(WEIGHTS), Engines(group), bucket_bytes=150, version=3)
        assert stats.num_tensors == len(WEIGHTS)
        assert all(version == 3 for version, _ in group.run_all(Engine.state))


def connected(group: WorkerGroup, **timeouts: float):
    """Policy rank 0's end of a sync with ``group``'s engines, connected while they are idle."""
    metas_ = metas()
    source = GatheredWeights(metas_, lambda names: {name: WEIGHTS[name] for name in names})
    return Engines(group, **timeouts).endpoint.connect(source, rank=0, bucket_bytes=150)


def test_a_sync_waits_for_an_engine_busy_generating_longer_than_the_transfer_timeout(cluster):
    """An engine takes one call at a time: a refit that comes while it generates (asynchronous
    GRPO) starts broadcasting once the engine receives, so a generate call longer than
    ``weight_sync_timeout_s`` no longer fails the broadcast; ``refit_wait_s`` bounds the wait."""
    with WorkerGroup(cluster, Engine, name="busy", num_workers=2, resources=WorkerResources(cpus=0.25)) as group:
        sender = connected(group, timeout_s=1.0, refit_wait_s=30)
        busy = group.run_all_async(Engine.busy, 2.5)
        stats = sender.send(5)
        group.get(busy)
        assert stats.num_tensors == len(WEIGHTS) and stats.seconds > 2.0
        assert all(version == 5 and received.keys() == WEIGHTS.keys() for version, received in group.run_all(Engine.state))


def test_an_engine_busy_past_refit_wait_s_is_named(cluster):
    with WorkerGroup(cluster, Engine, name="stuck", num_workers=1, resources=WorkerResources(cpus=0.25)) as group:
        sender = connected(group, timeout_s=1.0, refit_wait_s=0.5)
        group.run_all_async(Engine.busy, 3.0)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"^weight sync to engines: rank\(s\) \[1\] of the sync group did not start "
                                              r"receiving within 0.5 s \(generation.refit_wait_s\): their engine is "
                                              r"still busy"):
            sender.send(5)
        assert time.monotonic() - start < 2.5


def test_a_non_positive_bucket_size_is_refused():
    with pytest.raises(ValueError, match=r"bucket_bytes must be positive \(generation.refit_bucket_bytes\), got 0"):
        refit(ExportedWeights(WEIGHTS), None, bucket_bytes=0)
