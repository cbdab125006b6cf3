"""Shared pieces of the megatron backend tests: tiny Llama and Qwen2 folders whose head
counts tensor parallelism of 2 divides, a skewed batch, an independent float64 reference
(plain transformers + autograd), policy configs, and a dtensor policy on the same weights
to compare with.

Nothing here imports megatron-core: the test modules skip themselves when it is missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import (
    ClusterConfig,
    GenerationConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    WorkerResources,
)
from posttrain.testing import policy as kit

#: Lengths with a long tail; sample 6 is dropped by ``sample_mask``.
LENGTHS = [5, 17, 3, 9, 24, 4, 11, 6]
PROMPT = 2  # leading tokens of every sample without loss
#: Logits are divided by this in every logprob (as the sampler's are): not 1, so a backend
#: that forgot it would fail the comparisons.
TEMPERATURE = 0.7


def make_batch(lengths=LENGTHS, seed: int = 0) -> Batch:
    """Right-padded random token rows (ids 7..99: characters of the tiny tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = max(lengths) + 3
    pos = torch.arange(width)[None, :]
    real = pos < lens[:, None]
    ids = torch.randint(7, 100, (len(lengths), width), generator=g) * real
    sample_mask = torch.ones(len(lengths))
    sample_mask[6] = 0.0
    return Batch(
        input_ids=ids,
        input_lengths=lens,
        token_mask=(real & (pos >= PROMPT)).float(),
        sample_mask=sample_mask,
    )


def reference_logprobs(model_path_or_model, batch: Batch, temperature: float = TEMPERATURE) -> torch.Tensor:
    """float64 [B, S] (the conformance kit's reference) at this module's temperature.
    Differentiable when given a model with gradients."""
    return kit.reference_logprobs(_reference_model(model_path_or_model), batch, temperature)


def _reference_model(model_path_or_model):
    return kit.reference_model(model_path_or_model) if isinstance(model_path_or_model, str) else model_path_or_model


def reference_nll_step(model_path: str, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
    """The global-batch token NLL and its gradients (Hugging Face names) in float64."""
    return kit.reference_step(model_path, batch, TEMPERATURE)


def reference_topk(model_path: str, batch: Batch, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample: float64 top-k raw logits and ids at every real position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64, attn_implementation="eager")
    with torch.no_grad():
        return [model(batch["input_ids"][i : i + 1, :n]).logits[0].topk(k, dim=-1)
                for i, n in enumerate(batch["input_lengths"].tolist())]


def policy_config(model_path: str, *, backend: str = "megatron", megatron=None, optimizer: OptimizerConfig | None = None,
                  **overrides) -> RunConfig:
    """A CPU float32 policy config for a tiny model: one microbatch per data-parallel rank,
    logprobs in microbatches of 3, the vocabulary (103) in chunks of 16 (the last partial)."""
    fields = dict(
        backend=backend,
        model=model_path,
        train_global_batch_size=len(LENGTHS),
        logprob_micro_batch_size=3,
        max_total_sequence_length=32,
        logprob_chunk_size=16,
        max_grad_norm=None,
        optimizer=optimizer or OptimizerConfig(name="sgd", lr=1.0),
        resources=WorkerResources(cpus=0.5),
    )
    fields.update(overrides)
    sections = {"policy.megatron": megatron} if megatron is not None else {}
    config = RunConfig(seed=0, policy=PolicyConfig(**fields), generation=GenerationConfig(temperature=TEMPERATURE),
                       sections=sections)
    config.policy.train_micro_batch_size = overrides.get("train_micro_batch_size", len(LENGTHS) // config.data_parallel_size)
    return config


def full_weights(policy) -> dict[str, torch.Tensor]:
    return kit.exported_weights(policy, 1 << 16)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two name -> tensor maps with the same names."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def sgd_step(policy, batch: Batch, initial: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """One training step of the token NLL on a policy with SGD at lr=1 from weights ``initial``:
    its gradients (the weight change, Hugging Face names) and the step's metrics."""
    from posttrain_sft.loss import NLLLoss

    metrics = policy.train(batch, NLLLoss())
    after = full_weights(policy)
    return {k: initial[k].double() - after[k].double() for k in after}, metrics


def check_sgd_step(policy, model_path: str, batch: Batch, initial: dict[str, torch.Tensor], *, grad_atol: float) -> None:
    """One SGD step (lr=1) from weights ``initial`` has the float64 reference's loss (1e-6),
    gradients (``grad_atol``) and gradient norm (1e-5 relative)."""
    ref_loss, ref_grads = reference_nll_step(model_path, batch)
    grads, metrics = sgd_step(policy, batch, initial)
    assert max_diff(grads, ref_grads) < grad_atol
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-6)
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values()))
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)


def save_tiny_qwen2(path) -> str:
    """A seeded tiny Qwen2 (q/k/v biases, tied embeddings) with the tiny character
    tokenizer, saved as a Hugging Face folder. Biases are random, not Qwen2's zero init,
    so a misplaced bias changes the numbers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(torch.randn_like(param) * 0.5 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory):
    """The tiny Llama with 4 query and 2 key/value heads (tensor parallel 2 divides both)."""
    from posttrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("llama_4h"), size="tiny", seed=0, num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2_tiny"))


@pytest.fixture(scope="session")
def virtual_cluster(ray_cluster):
    from posttrain.distributed import VirtualCluster

    cluster = VirtualCluster(ClusterConfig())
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def dtensor_policy(llama_path, virtual_cluster):
    """One dtensor rank on the tiny Llama, the backend megatron is compared with (per module,
    so that it does not hold its CPU for the rest of the session)."""
    dtensor = pytest.importorskip("posttrain_dtensor.policy", reason="posttrain-dtensor is not installed")
    policy = dtensor.DTensorPolicy(policy_config(llama_path, backend="dtensor"), virtual_cluster, name="dtensor-ref")
    yield policy
    policy.shutdown()


@pytest.fixture(scope="session")
def mg():
    """The helpers above, for test modules (conftest modules are not importable by name)."""
    return SimpleNamespace(
        LENGTHS=LENGTHS,
        TEMPERATURE=TEMPERATURE,
        make_batch=make_batch,
        reference_logprobs=reference_logprobs,
        reference_model=_reference_model,
        reference_nll_step=reference_nll_step,
        reference_topk=reference_topk,
        policy_config=policy_config,
        full_weights=full_weights,
        max_diff=max_diff,
        sgd_step=sgd_step,
        check_sgd_step=check_sgd_step,
        save_tiny_qwen2=save_tiny_qwen2,
    )
