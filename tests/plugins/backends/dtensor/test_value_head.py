"""A value head (``policy.head: value``): the dtensor policy's values are those of the
sequence-classification folder it exports, at every position, in padded and packed rows; the
training pass gives them to a loss that takes values; the passes of the other head, and a
backend without value heads, are refused."""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch

from posttrain.config.schema import SequencePackingConfig
from posttrain.errors import ConfigError
from posttrain.interfaces.loss import LossFunction, LossType

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module


class LastTokenScore(LossFunction):
    """The mean over sequences of the value at each one's last token."""

    loss_type = LossType.SEQUENCE
    input_type = "values"

    def __call__(self, values, batch, global_valid_seqs, global_valid_toks):
        last = values.gather(1, (batch["input_lengths"] - 1)[:, None])[:, 0]
        return (last * batch["sample_mask"]).sum() / global_valid_seqs, {}


def hf_values(model, batch) -> torch.Tensor:
    valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=valid.long()).last_hidden_state
        return (hidden @ model.score.weight.T)[..., 0] * valid


@pytest.mark.parametrize("packing", [False, True])
def test_values_are_those_of_the_exported_sequence_classifier(dt, virtual_cluster, tiny_model_path, tmp_path, packing):
    from transformers import AutoModelForSequenceClassification

    from posttrain_dtensor.policy import DTensorPolicy

    packed = SequencePackingConfig(enabled=packing, max_tokens_per_row=48)
    policy = DTensorPolicy(dt.policy_config(tiny_model_path, head="value", sequence_packing=packed), virtual_cluster)
    batch = dt.make_batch()
    try:
        values = policy.get_values(batch)["values"]
        metrics = policy.train(batch, LastTokenScore(), eval_mode=True)
        with pytest.raises(ConfigError, match=r"get_logprobs needs policy.head 'lm'; this dtensor policy was built "
                                              r"with policy.head 'value'"):
            policy.get_logprobs(batch)
        with pytest.raises(ConfigError, match=r"the loss TokenNLL takes logprobs, which a policy with policy.head "
                                              r"'value' does not give"):
            policy.train(batch, dt.nll)
        policy.export_hf(str(tmp_path / "hf"))
    finally:
        policy.shutdown()

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert float((values - hf_values(model, batch)).abs().max()) < 1e-5
    valid = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["input_lengths"][:, None]
    with torch.no_grad():
        pooled = model(input_ids=batch["input_ids"], attention_mask=valid.long()).logits[:, 0]
    last = values.gather(1, (batch["input_lengths"] - 1)[:, None])[:, 0]
    assert float((last - pooled).abs().max()) < 1e-5
    kept = batch["sample_mask"].bool()
    assert metrics["loss"] == pytest.approx(float(last[kept].mean()), abs=1e-5)


def test_a_backend_without_value_heads_refuses_one(dt, virtual_cluster, tiny_model_path):
    plugin = pytest.importorskip("posttrain_policy_torch.plugin", reason="the example torch backend is not installed")
    with pytest.raises(ConfigError, match=r"^policy.head: the torch backend builds lm heads, not 'value'"):
        plugin.build_torch_policy(dt.policy_config(tiny_model_path, backend="torch", head="value"), virtual_cluster)
