"""Contract tests for a policy backend, against plain transformers on the same weights.

:class:`PolicyContract` is a class of pytest tests. A subclass named ``Test...`` sets ``name``
(the registered backend) and, if the backend needs them, ``sections`` (its config sections
by dotted path, e.g. ``{"policy.mine": MineConfig()}``) and ``policy_overrides`` (fields of
:class:`~posttrain.config.schema.PolicyConfig`, e.g. ``{"num_workers": 2}``). The kit builds
a seeded tiny Llama (:func:`posttrain.models.tiny.build_tiny_model`), starts the backend once
per class through its registered factory on the Ray cluster of the ``ray_local`` fixture,
and checks, each test starting from the initial weights (restored from a checkpoint the kit
saves first):

- logprobs follow the convention of :mod:`posttrain.interfaces.policy` and equal a float64
  transformers forward at the configured sampling temperature (0.7); top-k logits equal
  transformers' raw top-k; the reference logprobs are the initial weights' after training;
- one training step with the kit's settings (plain SGD, learning rate 1, no clipping,
  several microbatches per rank) moves every weight by exactly the gradient of the
  global-batch loss (gradient accumulation and data-parallel reduction are exact), and
  reports the loss, gradient norm and token count of that global batch; ``eval_mode``
  reports the loss without a step;
- a checkpoint resumes exactly; the Hugging Face export loads in transformers with the
  policy's logprobs; ``export_weights`` honours its bucket size and gives the weights;
  ``offload``/``prepare_for_training`` keep the weights; ``info`` names the model;
- a weight sync (:meth:`Policy.send_weights`) to a stand-in engine delivers exactly the
  exported weights, worker to worker, staging at most one layer group and one bucket.

The reference helpers (:func:`reference_logprobs`, :func:`reference_step`, ...) are public
for a backend's own extra tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from posttrain.backend.sampling import logprob_temperature
from posttrain.backend.vision import TILED
from posttrain.batch import Batch
from posttrain.config.schema import (
    ClusterConfig,
    GenerationConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    WorkerResources,
)
from posttrain.data.images import image_fields, sample_images
from posttrain.distributed import VirtualCluster
from posttrain.interfaces.generation import RefitStats
from posttrain.interfaces.policy import Policy
from posttrain.models.tiny import build_tiny_model
from posttrain.plugins import plugin_host
from posttrain.testing.generation import NegativeLogLikelihood

#: Sample lengths of the kit's batch (a long and a short tail) and leading tokens without loss.
LENGTHS = (5, 13, 3, 9)
PROMPT_TOKENS = 2
#: The kit's optimizer: one step moves each weight by exactly minus its gradient.
SGD = OptimizerConfig(name="sgd", lr=1.0)
#: The sampling temperature the kit configures: logprobs (and the loss's) must be those of
#: ``logits / TEMPERATURE``; top-k logits stay raw.
TEMPERATURE = 0.7


def contract_batch(lengths: tuple[int, ...] = LENGTHS, *, seed: int = 0, dropped: int | None = 2) -> Batch:
    """Right-padded random rows of the tiny tokenizer's characters (ids 7..99), two prompt
    tokens without loss, and sample ``dropped`` (if any) masked out of the loss."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = max(lengths) + 2
    position = torch.arange(width)[None, :]
    real = position < lens[:, None]
    sample_mask = torch.ones(len(lengths))
    if dropped is not None:
        sample_mask[dropped] = 0.0
    return Batch(
        input_ids=torch.randint(7, 100, (len(lengths), width), generator=g) * real,
        input_lengths=lens,
        token_mask=(real & (position >= PROMPT_TOKENS)).float(),
        sample_mask=sample_mask,
    )


def reference_model(model_path: str | Path, dtype: torch.dtype = torch.float64) -> Any:
    """The Hugging Face model at ``model_path`` in ``dtype`` with eager attention (and, in a
    mixture of experts, transformers' loop over the experts: its grouped kernel has no float64)."""
    from transformers import AutoConfig

    from posttrain.models.auto import generative_class

    return generative_class(AutoConfig.from_pretrained(model_path)).from_pretrained(model_path, dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager")


def reference_logprobs(model: Any, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """[B, S] in the model's dtype: each sample run alone (no padding, with its images when
    the batch has image fields), the full ``log_softmax(logits / temperature)``; 0 at position
    0, on padding and where ``token_mask`` is 0 (when the batch has one)."""
    dtype = next(model.parameters()).dtype
    out = torch.zeros(batch["input_ids"].shape, dtype=dtype)
    for i, n in enumerate(batch["input_lengths"].tolist()):
        ids = batch["input_ids"][i : i + 1, :n]
        images = reference_image_inputs(model, *sample_images(batch, i), ids) if image_fields(batch) else {}
        logp = (model(ids, **images).logits[0, :-1] / temperature).log_softmax(-1)
        out[i, 1:n] = logp.gather(-1, ids[0, 1:, None])[:, 0]
    if "token_mask" in batch:
        out = out * batch["token_mask"].to(out.dtype)
    return out


def reference_image_inputs(model: Any, pixels: torch.Tensor, grids: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    """One sample's images (its pixel values and grids, :func:`~posttrain.data.images.sample_images`)
    as transformers' forward of ``model`` on ``ids`` [1, n] takes them; none when it has none."""
    if not len(grids):
        return {}
    pixels = pixels.to(next(model.parameters()).dtype)
    if model.config.model_type in TILED:  # Idefics3: [1, tiles, 3, side, side]
        side = model.config.vision_config.image_size
        return {"pixel_values": pixels.view(1, -1, 3, side, side)}
    return {"pixel_values": pixels, "image_grid_thw": grids, "mm_token_type_ids": (ids == model.config.image_token_id).int()}


def reference_step(model_path: str | Path, batch: Batch, temperature: float = 1.0) -> tuple[float, dict[str, torch.Tensor]]:
    """The global-batch token NLL (:class:`NegativeLogLikelihood`) of ``logits / temperature``
    and its gradient for every parameter, in float64."""
    model = reference_model(model_path)
    logprobs = reference_logprobs(model, batch, temperature)
    mask = batch["token_mask"].double() * batch["sample_mask"].double()[:, None]
    loss = -(logprobs * mask).sum() / mask.sum()
    loss.backward()
    return float(loss.detach()), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def exported_weights(policy: Policy, bucket_bytes: int = 1 << 20) -> dict[str, torch.Tensor]:
    """Every weight :meth:`Policy.export_weights` gives, by Hugging Face name."""
    return {name: tensor for bucket in policy.export_weights(bucket_bytes) for name, tensor in bucket.items()}


def max_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute elementwise difference between two sets of the same named tensors."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@attrs.frozen
class ContractSubject:
    """The running policy under test and what it was built from; ``initial`` is a checkpoint
    of its starting state that :meth:`restore` loads."""

    policy: Policy
    config: RunConfig
    model_path: str
    initial: str
    scratch: Path

    @property
    def temperature(self) -> float:
        return logprob_temperature(self.config.generation.temperature)

    def restore(self) -> Policy:
        self.policy.load_checkpoint(self.initial)
        return self.policy


def synced_weights(policy: Policy, bucket_bytes: int, version: int) -> tuple[dict[str, torch.Tensor], int, RefitStats]:
    """What one weight sync of ``policy`` delivers to a stand-in engine
    (:class:`~posttrain.testing.probe.WeightProbe` in a Ray actor): the tensors it received
    by name, the version it recorded, and the sync's stats."""
    from posttrain.backend.weight_sync import BroadcastEndpoint
    from posttrain.distributed import WorkerGroup
    from posttrain.run.refit import refit
    from posttrain.testing.probe import WeightProbe

    cluster = VirtualCluster(ClusterConfig())
    try:
        with WorkerGroup(cluster, WeightProbe, name="weight-probe", num_workers=1,
                         resources=WorkerResources(cpus=0.25)) as group:
            engine = _Endpoint(BroadcastEndpoint(tuple(group.actors), 1, "gloo", name="weight-probe"))
            stats = refit(policy, engine, bucket_bytes, version=version)
            received_version, received = group.run_rank0(WeightProbe.state)
    finally:
        cluster.shutdown()
    return received, received_version, stats


def staging_bound(weights: Mapping[str, torch.Tensor], bucket_bytes: int) -> int:
    """The most bytes a sync of ``weights`` may stage on the sending rank: the largest layer
    group, plus one bucket (or the largest tensor, which is a bucket of its own) with its
    alignment padding."""
    from posttrain.backend.weight_sync import ALIGN_BYTES, layer_groups

    sizes = {name: t.numel() * t.element_size() for name, t in weights.items()}
    largest_group = max(sum(sizes[n] for n in group) for group in layer_groups(list(weights)))
    return largest_group + max(bucket_bytes, max(sizes.values())) + ALIGN_BYTES * len(sizes)


@attrs.frozen
class _Endpoint:
    """A generation backend reduced to its weight endpoint (what refit asks it for)."""

    endpoint: Any

    def weight_endpoint(self) -> Any:
        return self.endpoint

    def refit_window(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class PolicyContract:
    """Tests for a policy backend plugin (see the module docstring for what is checked).

    Set ``name``; optionally ``sections`` and ``policy_overrides``. The kit's settings
    (SGD at learning rate 1, no gradient clipping, float32, small microbatches) are applied
    before ``policy_overrides``, which may change the layout (``num_workers``,
    ``tensor_parallel_size``, ``resources``) but should leave the optimizer alone.
    """

    name: str
    sections: Mapping[str, Any] = {}
    policy_overrides: Mapping[str, Any] = {}

    @pytest.fixture(scope="class")
    def subject(self, request: pytest.FixtureRequest, ray_local: Any, tmp_path_factory: Any) -> Iterator[ContractSubject]:
        cls = request.cls
        name = getattr(cls, "name", None)
        if not name:
            pytest.fail(f"{cls.__name__} must set 'name' (the registered policy backend)")
        scratch = tmp_path_factory.mktemp(f"policy-contract-{name}")
        model_path = str(build_tiny_model(scratch / "model", size="tiny", seed=0))
        fields: dict[str, Any] = dict(
            backend=name,
            model=model_path,
            train_global_batch_size=len(LENGTHS),
            train_micro_batch_size=1,
            logprob_micro_batch_size=1,
            max_total_sequence_length=32,
            logprob_chunk_size=16,
            max_grad_norm=None,
            optimizer=SGD,
            resources=WorkerResources(cpus=0.5),
        )
        fields.update(cls.policy_overrides)
        config = RunConfig(seed=0, run_dir=str(scratch / "run"), policy=PolicyConfig(**fields),
                           generation=GenerationConfig(temperature=TEMPERATURE), sections=dict(cls.sections))
        cluster = VirtualCluster(ClusterConfig())
        policy: Policy | None = None
        try:
            policy = plugin_host().policy_backends[name](config, cluster)
            initial = str(scratch / "initial")
            policy.save_checkpoint(initial)
            yield ContractSubject(policy, config, model_path, initial, scratch)
        finally:
            if policy is not None:
                policy.shutdown()
                policy.shutdown()  # a second shutdown is a no-op
            cluster.shutdown()

    # ------------------------------------------------------------------ registration and facts

    def test_registered_through_entry_points(self) -> None:
        backends = plugin_host().policy_backends
        assert self.name in backends, backends.unknown_message(self.name)

    def test_info_names_the_model(self, subject: ContractSubject) -> None:
        info = subject.policy.info()
        model = reference_model(subject.model_path, torch.float32)
        assert info["backend"] == self.name
        assert info["parameters"] == sum(p.numel() for p in model.parameters()), info
        assert info["world_size"] == subject.config.policy.num_workers, info
        assert {"device", "dtype"} <= set(info), f"info() lacks device or dtype: {info}"

    # ------------------------------------------------------------------ passes

    def test_logprobs_follow_the_convention_and_equal_transformers(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        batch = contract_batch()
        logprobs = policy.get_logprobs(batch)["logprobs"]
        assert logprobs.dtype == torch.float32 and logprobs.shape == batch["input_ids"].shape, (
            f"logprobs must be float32 {tuple(batch['input_ids'].shape)}, got {logprobs.dtype} {tuple(logprobs.shape)}"
        )
        unreported = batch["token_mask"] == 0  # position 0, padding and prompt tokens
        assert torch.all(logprobs[unreported] == 0), "position 0, padding and masked tokens must hold 0"
        expected = reference_logprobs(reference_model(subject.model_path), batch, subject.temperature)
        torch.testing.assert_close(logprobs.double(), expected, rtol=1e-4, atol=1e-5)

    def test_reference_logprobs_stay_the_initial_weights(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        batch = contract_batch()
        before = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
        expected = reference_logprobs(reference_model(subject.model_path), batch, subject.temperature)
        torch.testing.assert_close(before.double(), expected, rtol=1e-4, atol=1e-5)
        current = policy.get_logprobs(batch)["logprobs"]
        policy.train(batch, NegativeLogLikelihood())
        assert not torch.allclose(policy.get_logprobs(batch)["logprobs"], current), "a training step changed nothing"
        after = policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
        assert torch.equal(after, before), "the reference logprobs moved with training"

    def test_topk_logits_equal_transformers(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        batch = contract_batch()
        k = 3
        out = policy.get_topk_logits(batch, k)
        n, width = batch["input_ids"].shape
        assert out["topk_logits"].shape == (n, width - 1, k) and out["topk_indices"].shape == (n, width - 1, k)
        model = reference_model(subject.model_path)
        for i, length in enumerate(batch["input_lengths"].tolist()):
            logits = model(batch["input_ids"][i : i + 1, :length]).logits[0, : length - 1]
            values, indices = logits.topk(k, dim=-1)
            torch.testing.assert_close(out["topk_logits"][i, : length - 1].double(), values, rtol=1e-4, atol=1e-5)
            assert torch.equal(out["topk_indices"][i, : length - 1], indices), f"top-{k} ids of sample {i} differ"
            assert torch.all(out["topk_logits"][i, length:] == 0), f"padding positions of sample {i} must hold 0"

    # ------------------------------------------------------------------ training

    def test_a_step_moves_each_weight_by_the_global_batch_gradient(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        batch = contract_batch()
        before = exported_weights(policy)
        metrics = policy.train(batch, NegativeLogLikelihood())
        after = exported_weights(policy)
        loss, grads = reference_step(subject.model_path, batch, subject.temperature)
        lr = subject.config.policy.optimizer.lr
        moved = {name: (before[name].double() - after[name].double()) / lr for name in grads}
        assert max_difference(grads, moved) < 1e-4, "one SGD step did not move the weights by the global-batch gradient"
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
        assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
        valid = float((batch["token_mask"] * batch["sample_mask"][:, None]).sum())
        assert metrics["num_tokens"] == valid and metrics["lr"] == pytest.approx(lr)
        assert metrics["step_time_s"] > 0 and metrics["nll"] == pytest.approx(loss, rel=1e-5, abs=1e-6)

    def test_eval_mode_reports_the_loss_without_a_step(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        batch = contract_batch()
        before = policy.get_logprobs(batch)["logprobs"]
        metrics = policy.train(batch, NegativeLogLikelihood(), eval_mode=True)
        loss, _ = reference_step(subject.model_path, batch, subject.temperature)
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert "grad_norm" not in metrics, "eval_mode reported a gradient norm"
        assert torch.equal(policy.get_logprobs(batch)["logprobs"], before), "eval_mode changed the weights"

    # ------------------------------------------------------------------ state

    def test_checkpoint_resumes_exactly(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        first, second = contract_batch(seed=1), contract_batch(seed=2)
        policy.train(first, NegativeLogLikelihood())
        folder = str(subject.scratch / "resume")
        policy.save_checkpoint(folder)
        expected_metrics = policy.train(second, NegativeLogLikelihood())
        expected = policy.get_logprobs(second)["logprobs"]
        subject.restore()
        policy.load_checkpoint(folder)
        metrics = policy.train(second, NegativeLogLikelihood())
        assert torch.equal(policy.get_logprobs(second)["logprobs"], expected), "training after a resume differs"
        for key in ("loss", "grad_norm", "lr", "num_tokens"):
            assert metrics[key] == expected_metrics[key], f"{key}: {metrics[key]} after resuming, {expected_metrics[key]} before"

    def test_hugging_face_export_loads_with_the_policys_logprobs(self, subject: ContractSubject) -> None:
        from transformers import AutoTokenizer

        policy = subject.restore()
        batch = contract_batch()
        policy.train(batch, NegativeLogLikelihood())
        folder = subject.scratch / "export"
        policy.export_hf(str(folder))
        exported = reference_model(folder, torch.float32)
        AutoTokenizer.from_pretrained(folder)  # the tokenizer travels with the weights
        expected = policy.get_logprobs(batch)["logprobs"]
        torch.testing.assert_close(reference_logprobs(exported, batch, subject.temperature), expected, rtol=1e-4, atol=1e-5)

    def test_export_weights_honours_the_bucket_size(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        model = reference_model(subject.model_path, torch.float32)
        bucket_bytes = 64 * 1024
        buckets = list(policy.export_weights(bucket_bytes))
        assert len(buckets) > 1, "the tiny model's weights must span several 64 KiB buckets"
        for bucket in buckets:
            size = sum(t.numel() * t.element_size() for t in bucket.values())
            assert size <= bucket_bytes or len(bucket) == 1, f"a bucket of {size} bytes holds {len(bucket)} tensors"
        names = [name for bucket in buckets for name in bucket]
        assert len(names) == len(set(names)), "a weight was exported twice"
        expected = {name: p.detach() for name, p in model.named_parameters()}
        assert set(names) == set(expected), f"exported {sorted(set(names) ^ set(expected))} differently"
        assert max_difference({n: t for b in buckets for n, t in b.items()}, expected) == 0.0

    def test_send_weights_delivers_the_weights_worker_to_worker(self, subject: ContractSubject) -> None:
        """A sync to a stand-in engine delivers exactly :meth:`Policy.export_weights`'s
        tensors under the version given, staging at most one layer group and one bucket."""
        policy = subject.restore()
        policy.train(contract_batch(), NegativeLogLikelihood())
        expected = exported_weights(policy)
        bucket_bytes = 64 * 1024
        received, version, stats = synced_weights(policy, bucket_bytes, version=3)
        assert version == 3 and received.keys() == expected.keys()
        assert max_difference(received, expected) == 0.0 and all(received[n].dtype == t.dtype for n, t in expected.items())
        assert stats.bytes_moved == sum(t.numel() * t.element_size() for t in expected.values())
        assert stats.num_tensors == len(expected) and stats.num_buckets > 1
        assert 0 < stats.peak_staging_bytes <= staging_bound(expected, bucket_bytes), stats

    def test_offload_and_prepare_keep_the_weights(self, subject: ContractSubject) -> None:
        policy = subject.restore()
        batch = contract_batch()
        before = policy.get_logprobs(batch)["logprobs"]
        policy.offload()
        policy.prepare_for_training()
        assert torch.equal(policy.get_logprobs(batch)["logprobs"], before)

    def test_an_offloaded_policy_refuses_passes_and_exports_from_its_device(self, subject: ContractSubject) -> None:
        """While offloaded: a forward or training pass raises naming ``prepare_for_training``;
        exports and a weight sync give the weights of before and leave the policy offloaded."""
        policy = subject.restore()
        batch = contract_batch()
        policy.train(batch, NegativeLogLikelihood())
        before, weights = policy.get_logprobs(batch)["logprobs"], exported_weights(policy)
        policy.offload()
        for attempt in (lambda: policy.get_logprobs(batch), lambda: policy.train(batch, NegativeLogLikelihood())):
            with pytest.raises(Exception, match="prepare_for_training"):
                attempt()
        assert max_difference(exported_weights(policy), weights) == 0.0
        received, _, _ = synced_weights(policy, 64 * 1024, version=1)
        assert max_difference(received, weights) == 0.0
        folder = subject.scratch / "export_offloaded"
        policy.export_hf(str(folder))
        exported = {name: p.detach() for name, p in reference_model(folder, torch.float32).named_parameters()}
        assert max_difference(exported, weights) == 0.0
        with pytest.raises(Exception, match="prepare_for_training"):
            policy.get_logprobs(batch)
        policy.prepare_for_training()
        assert torch.equal(policy.get_logprobs(batch)["logprobs"], before)
