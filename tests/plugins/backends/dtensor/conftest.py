"""Shared pieces of the dtensor backend tests: a token NLL loss, a skewed batch, the
conformance kit's float64 reference (plain transformers + autograd), and policy builders."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import ray.cloudpickle
import torch

from posttrain.batch import Batch
from posttrain.config.schema import (
    DynamicBatchingConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    SequencePackingConfig,
    WorkerResources,
)
from posttrain.interfaces.loss import LossFunction, LossType
from posttrain.testing.policy import (
    exported_weights,
    max_difference,
    reference_logprobs,
    reference_model,
    reference_step,
)
from posttrain_dtensor.config import DTensorConfig

# Ray workers cannot import this module: send the loss class by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Lengths with a long tail, the case packing and dynamic batching are for.
LENGTHS = [5, 17, 3, 9, 24, 4, 11, 6]
PROMPT = 2  # leading tokens of every sample without loss


class TokenNLL(LossFunction):
    """Mean NLL over valid tokens of the global batch; its metrics are the microbatch's
    shares of all valid tokens and sequences, which must sum to exactly 1."""

    loss_type = LossType.TOKEN

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        mask = batch["token_mask"] * batch["sample_mask"][:, None]
        loss = -(logprobs * mask).sum() / global_valid_toks
        return loss, {
            "token_share": float(mask.sum() / global_valid_toks),
            "sequence_share": float(batch["sample_mask"].sum() / global_valid_seqs),
        }


def make_batch(lengths=LENGTHS, width: int | None = None, seed: int = 0, drop_sample: int | None = 6) -> Batch:
    """Right-padded random token rows (ids 7..99: characters of the tiny tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    width = width or max(lengths) + 3
    pos = torch.arange(width)[None, :]
    real = pos < lens[:, None]
    ids = torch.randint(7, 100, (len(lengths), width), generator=g) * real
    sample_mask = torch.ones(len(lengths))
    if drop_sample is not None:
        sample_mask[drop_sample] = 0.0
    return Batch(
        input_ids=ids,
        input_lengths=lens,
        token_mask=(real & (pos >= PROMPT)).float(),
        sample_mask=sample_mask,
    )


def full_weights(policy) -> dict[str, torch.Tensor]:
    return exported_weights(policy, 1 << 16)


def sgd_grads(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
    """Gradients recovered from one plain SGD step: (w0 - w1) / lr."""
    return {k: (before[k].double() - after[k].double()) / lr for k in before}


def restore(policy, checkpoint: str):
    """Load ``checkpoint`` into ``policy`` and reset the batching options the tests change
    (the driver reads them at every pass): one microbatch per rank, no packing or dynamic
    batching."""
    policy.load_checkpoint(checkpoint)
    p = policy.config.policy
    policy.config.policy = attrs.evolve(
        p,
        train_micro_batch_size=p.train_global_batch_size // policy.config.data_parallel_size,
        sequence_packing=SequencePackingConfig(),
        dynamic_batching=DynamicBatchingConfig(),
    )
    return policy


def policy_config(model_path: str, dtensor: DTensorConfig | None = None, **overrides) -> RunConfig:
    """A CPU float32 policy config for the tiny model; SGD with lr=1 so one step's weight
    change is the gradient. ``dtensor`` is the backend's own section."""
    fields = dict(
        model=model_path,
        train_global_batch_size=len(LENGTHS),
        logprob_micro_batch_size=3,
        max_total_sequence_length=32,
        logprob_chunk_size=16,  # the tiny vocabulary (103) in 7 chunks, the last one partial
        max_grad_norm=None,
        optimizer=OptimizerConfig(name="sgd", lr=1.0),
        resources=WorkerResources(cpus=0.5),
    )
    fields.update(overrides)
    dp = fields.get("num_workers", 1) // fields.get("tensor_parallel_size", 1)
    fields.setdefault("train_micro_batch_size", len(LENGTHS) // dp)  # one microbatch per rank
    sections = {"policy.dtensor": dtensor} if dtensor is not None else {}
    return RunConfig(seed=0, policy=PolicyConfig(**fields), sections=sections)


def deepseek_v3(folder: Path, tokenizer_model: str) -> str:
    """A tiny random DeepSeek-V3 (not in the model zoo) with ``tokenizer_model``'s tokenizer (a
    zoo folder): 4 routed experts and a shared one per layer, 2 per token from one of 2 groups
    (n_group 2, topk_group 1), multi-head latent attention (low-rank q and kv, values narrower
    than queries)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config

    ids = {key: getattr(AutoConfig.from_pretrained(tokenizer_model), key)
           for key in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    config = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=32,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              initializer_range=0.2, **ids)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_model).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def dt():
    """The helpers above, for test modules (conftest modules are not importable by name)."""
    return SimpleNamespace(
        LENGTHS=LENGTHS,
        PROMPT=PROMPT,
        make_batch=make_batch,
        reference_model=reference_model,
        reference_logprobs=reference_logprobs,
        reference_step=reference_step,
        full_weights=full_weights,
        sgd_grads=sgd_grads,
        max_diff=max_difference,
        policy_config=policy_config,
        restore=restore,
        deepseek_v3=deepseek_v3,
        nll=TokenNLL(),
    )


@pytest.fixture
def policy(setup, dt):
    """The module's policy (its ``setup`` fixture's) with the initial weights and default batching restored."""
    return dt.restore(setup["policy"], setup["initial_ckpt"])


@pytest.fixture(scope="session")
def virtual_cluster(ray_cluster):
    from posttrain.config.schema import ClusterConfig
    from posttrain.distributed import VirtualCluster

    cluster = VirtualCluster(ClusterConfig())
    yield cluster
    cluster.shutdown()
