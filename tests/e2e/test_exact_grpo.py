"""GRPO with exact logprobs (``generation.exact_logprobs``) on CPU: the hf engine's logprob of
every sampled token is the dtensor trainer's, bit for bit, so ``token_mult_prob_error`` is
exactly 1 and ``mismatch_kl`` exactly 0 at every step, and in every turn and position bucket.

- multi-turn (three-turn guess_number games), two data-parallel ranks of two microbatches
  each; the same run without exact logprobs shows the cached decoding's gap (the control);
- single-turn with LoRA and two optimizer updates per step, no previous-logprob pass (a
  synchronous exact run takes the engine's logprobs as the previous policy's), stopped after
  step 2 and resumed: step 3 is exact too;
- asynchronous (k = 1): the tokens sampled by the weights being trained are exact at every
  step (``mismatch/staleness_0``); older tokens carry the drift of the optimizer steps since,
  which the top-level metrics include by their definition (see docs/algorithms/grpo.md).
"""

from __future__ import annotations

import attrs
import pytest

from posttrain.config.schema import CheckpointConfig, LoraConfig
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics
from posttrain_env_math.guess_number import guess_number_prompt
from posttrain_grpo.config import AsynchronousConfig, GRPOConfig
from tests.e2e.test_async_grpo import delayed_rows
from tests.e2e.test_async_grpo import run as run_with_delays
from tests.e2e.test_grpo_e2e import assert_finite, make_config, spread_rows, write_rows

pytestmark = pytest.mark.ray


def exact_config(config, *, exact: bool = True, **policy):
    """``config`` with exact logprobs (or not) and two data-parallel ranks of two microbatches."""
    return attrs.evolve(
        config,
        generation=attrs.evolve(config.generation, exact_logprobs=exact),
        policy=attrs.evolve(config.policy, num_workers=2, train_micro_batch_size=2, logprob_micro_batch_size=2, **policy),
    )


def mismatch(record: dict) -> dict[str, float]:
    """The step's mismatch metrics (but the token shares)."""
    return {name: value for name, value in record.items()
            if name in ("token_mult_prob_error", "mismatch_kl") or (name.startswith("mismatch/") and "share" not in name)}


def assert_exact(record: dict, names=None) -> None:
    for name, value in mismatch(record).items():
        if names is None or name in names:
            assert value == (1.0 if name.endswith("token_mult_prob_error") else 0.0), (record["step"], name, value)


@pytest.mark.slow
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "cached-decoding"])
def test_multi_turn_rollouts_have_no_mismatch_only_with_exact_logprobs(ray_cluster, tiny_model_path, tmp_path, exact):
    rows = [
        {"messages": guess_number_prompt(1, 5), "metadata": {"target": 1 + i % 5, "low": 1, "high": 5}, "task": "guess_number"}
        for i in range(4)
    ]
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2, max_rollout_turns=3)
    config = make_config(tiny_model_path, tmp_path / "run", write_rows(tmp_path / "train.jsonl", rows), grpo,
                         environments={"guess_number": {"max_guesses": 3}})
    run_algorithm(exact_config(config, exact=exact, max_total_sequence_length=384))

    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert_finite(record)
        assert record["rollout/mean_turns"] == 3.0
        assert {f"mismatch/turn_{k}/token_mult_prob_error" for k in (1, 2, 3)} <= record.keys()
        assert "mismatch/pos_256_511/token_mult_prob_error" in record  # third turns reach past 256 tokens
        if exact:
            assert_exact(record)
        else:  # float32 roundings of the cached decoding: about 1e-7 per token, 1e-14 of KL
            assert 1.0 < record["token_mult_prob_error"] < 1.0001 and 0.0 < record["mismatch_kl"] < 1e-9


@pytest.mark.slow
def test_single_turn_lora_stays_exact_through_a_checkpoint_and_resume(ray_cluster, tiny_model_path, tmp_path):
    """LoRA (its layers compute with the merged weight the engine receives), two optimizer
    updates per step, no previous-logprob pass although one is asked for (the engine's
    logprobs are the previous policy's), a checkpoint at step 2, and a resumed run that trains
    step 3. The mismatch metrics are those of each step's first update: the second trains
    logprobs its predecessor already moved. Rewards that differ in every group (``spread``)
    make every step move the adapters."""
    train = write_rows(tmp_path / "train.jsonl", spread_rows(24))
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=2,
                      skip_prev_logprobs_when_on_policy=False)
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, dropout=0.0)
    config = exact_config(make_config(tiny_model_path, tmp_path / "run", train, grpo,
                                      checkpointing=CheckpointConfig(save_period=2)), lora=lora,
                          train_global_batch_size=4)
    config = attrs.evolve(config, environments={}, algorithm="grpo_delayed",  # GRPO with the test environments
                          policy=attrs.evolve(config.policy, optimizer=attrs.evolve(config.policy.optimizer, lr=0.05)))
    run_with_delays(config)
    run_with_delays(attrs.evolve(config, sections={"grpo": attrs.evolve(grpo, max_num_steps=3)}))

    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert_finite(record)
        assert_exact(record)
        assert "is_weight_mean" not in record  # bypass: nothing to correct
    assert max(r["grad_norm"] for r in records[:2]) > 0  # the adapters moved before the checkpoint
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert events.count("no previous-logprob pass runs") == 2  # each run says so
    assert '"resumed"' in events and '"step": 2' in events


@pytest.mark.slow
def test_asynchronous_tokens_of_the_trained_weights_are_exact(ray_cluster, tiny_model_path, tmp_path):
    train = write_rows(tmp_path / "train.jsonl", delayed_rows(24, max_delay_s=0.05))
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=4, max_num_steps=3,
                      asynchronous=AsynchronousConfig(max_staleness_steps=1))
    config = make_config(tiny_model_path, tmp_path / "run", train, grpo, environments={}, algorithm="grpo_delayed")
    config = exact_config(config)
    run_with_delays(attrs.evolve(config, generation=attrs.evolve(config.generation, colocated=False)))

    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["async/staleness_max"] == 0  # round 1 samples the initial weights, which step 1 trains
    assert any(r["async/staleness_max"] == 1 for r in records)  # generation ran ahead
    fresh = [name for name in mismatch(records[0]) if name.startswith("mismatch/staleness_0/")]
    for record in records:
        assert_finite(record)
        assert_exact(record, fresh)
        if record["async/staleness_max"] == 0:
            assert_exact(record)
    assert fresh and all(name in records[0] for name in fresh)
