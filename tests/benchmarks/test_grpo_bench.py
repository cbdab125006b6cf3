"""The GRPO benchmark's own pieces (benchmarks/grpo.py, grpo_reward.py, common.set_eos_rate):
the EOS-rate edit gives the intended rate, the settings check catches different prompts but
not the different samples each side draws, the floor rule is 4 forward passes, the reward
varies within a group, ``--prompts`` sizes the steps and the data. Fast: the tiny model, no Ray, no TRL run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import grpo  # noqa: E402
import grpo_reward  # noqa: E402


def eos_probability(model, seed: int) -> torch.Tensor:
    """The model's next-token probability of EOS at every position of 32 random sequences."""
    ids = torch.randint(model.config.vocab_size, (32, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return torch.softmax(model(input_ids=ids).logits, dim=-1)[..., model.config.eos_token_id]


def test_eos_rate_edit_gives_the_intended_rate_and_completion_lengths(tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "model", size="tiny", seed=0)
    before = eos_probability(AutoModelForCausalLM.from_pretrained(folder), seed=1)
    assert float(before.mean()) < 0.02  # about 1 / vocabulary size

    assert common.set_eos_rate(folder, grpo.EOS_RATE) == pytest.approx(grpo.EOS_RATE, rel=0.01)
    model = AutoModelForCausalLM.from_pretrained(folder)
    after = eos_probability(model, seed=1)  # contexts the calibration did not see
    assert float(after.mean()) == pytest.approx(grpo.EOS_RATE, rel=0.05)
    assert float(after.std()) < 0.2 * grpo.EOS_RATE  # nearly independent of the context

    torch.manual_seed(0)
    prompts = torch.full((128, 4), model.config.bos_token_id)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                         max_new_tokens=grpo.MAX_NEW_TOKENS, pad_token_id=model.config.pad_token_id)
    completion = out[:, 4:]
    ended = completion == model.config.eos_token_id
    lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, torch.tensor(grpo.MAX_NEW_TOKENS))
    stats = common.length_stats(lengths.tolist(), grpo.MAX_NEW_TOKENS)
    assert 14 < stats["mean"] < 26 and stats["p90"] > 35 and 0 < stats["at_budget"] < 0.15, stats

    again = build_tiny_model(tmp_path / "again", size="tiny", seed=0)
    common.set_eos_rate(again, grpo.EOS_RATE)
    assert common.weights_digest(again) == common.weights_digest(folder)  # deterministic


def test_eos_rate_edit_refuses_a_head_tied_to_the_embedding(tmp_path):
    """Zeroing the head's column of a tied model zeroes the embedding's too, and the bias then
    divides by zero: the edit once wrote NaN weights and went on (the Qwen3-0.6B shape)."""
    from posttrain.testing.zoo import build_zoo_model

    folder = build_zoo_model(tmp_path / "model", "llama_tied", tokenizer="character")
    with pytest.raises(SystemExit, match="ties the two .tie_word_embeddings.; use --form dense"):
        common.set_eos_rate(folder, grpo.EOS_RATE)


def report(prompts, completion_lengths, loss=-0.1, lr=1e-6):
    return {"settings": {"lr": lr}, "losses": [loss],
            "steps": [grpo.grpo_step_record(prompts, completion_lengths)]}


def check(results):
    common.check_settings(results, loss_rtol=grpo.WORKLOAD.loss_rtol, step_fields=grpo.WORKLOAD.step_fields)


def test_settings_check_catches_other_prompts_but_not_other_samples():
    prompts = [[1, 5, 6], [1, 7]]
    check({"a": report(prompts, [3, 64]), "b": report(prompts, [10, 2], loss=-0.3)})  # own samples, own loss
    with pytest.raises(common.SettingsMismatch) as err:
        check({"a": report(prompts, [3, 64]), "b": report(prompts[::-1], [3, 64], lr=2e-6)})
    lines = str(err.value).splitlines()[1:]
    assert lines[0] == "  setting 'lr': a=1e-06 but b=2e-06"
    assert lines[1].startswith("  step 1 prompt_digest:") and len(lines) == 2  # same tokens, other order
    with pytest.raises(common.SettingsMismatch, match="prompt_tokens"):
        check({"a": report(prompts, [3, 64]), "b": report([[1, 5, 6], [1, 7, 7]], [3, 64])})


def test_step_record_counts_prompt_and_completion_tokens():
    record = grpo.grpo_step_record([[1, 5, 6], [1, 7]], [4, 64])
    assert record["prompt_tokens"] == 5 and record["completion_tokens"] == 68 and record["samples"] == 2
    assert record["lengths"] == [7, 66] and record["completion_lengths"] == [4, 64]
    dense = {"form": "dense", "max_new_tokens": 64}
    grpo.check_completions([grpo.grpo_step_record([[1]], [64])], dense)
    with pytest.raises(AssertionError, match="dense form: completions shorter than 64 tokens"):
        grpo.check_completions([record], dense)
    grpo.check_completions([record], {"form": "skewed", "max_new_tokens": 64})
    grpo.check_completions([grpo.grpo_step_record([[1]], [16])], {"form": "dense", "max_new_tokens": 16})


def test_max_new_tokens_option_sets_the_budget_of_every_side(tmp_path):
    """``--max-new-tokens 16`` reaches the spec, which both sides' configs read; 64 by default."""
    args = common.parse_args(grpo.WORKLOAD, ["--model", "tiny", "--max-new-tokens", "16"])
    assert common.make_spec(grpo.WORKLOAD, args, tmp_path / "a")["max_new_tokens"] == 16
    args = common.parse_args(grpo.WORKLOAD, ["--model", "tiny"])
    assert common.make_spec(grpo.WORKLOAD, args, tmp_path / "b")["max_new_tokens"] == grpo.MAX_NEW_TOKENS == 64


def test_floor_rule_is_four_forward_passes_split_by_stage():
    from posttrain.models.tiny import SIZES, build_tokenizer, tiny_llama_config

    config = tiny_llama_config(len(build_tokenizer()), **SIZES["tiny"])
    lengths = [30, 90]
    one = common.forward_flops(config, lengths)
    assert grpo.step_flops(config, lengths) == 4 * one
    reports = [{"steps": [grpo.grpo_step_record([[1] * 26, [1] * 26], [4, 64])], "rewards": [0.1],
                "stages": [{"rollout": 2.0, "logprobs": 1.0, "training": 3.0, "step": 6.0}]}]
    extras = grpo.side_extras(reports, {"warmup": 0, "max_new_tokens": 64}, config, rate=1e9)
    assert extras["stage_floor_s"] == pytest.approx({"rollout": one / 1e9, "training": 3 * one / 1e9})
    assert extras["stage_s_median"]["training"] == 3.0 and extras["completions"]["at_budget"] == 0.5


def test_reward_varies_within_a_group_and_is_recorded(tmp_path):
    record = tmp_path / "rollouts.jsonl"
    env = grpo_reward.BenchRewardEnvironment(record=str(record))
    answers = ["aaaa", "abcd", "", "xyz"]
    logs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": a, "token_ids": [0] * (len(a) + 1)}]
            for a in answers]
    result = env.step(logs, [{}] * len(logs))
    assert result.rewards.tolist() == [1.0, 0.25, 0.0, 0.0]
    line = common.json.loads(record.read_text())
    assert line["prompts"] == ["hi"] * 4 and line["completion_lengths"] == [5, 5, 1, 4]


def test_reward_plugin_folder_declares_the_entry_point(tmp_path):
    import importlib.metadata

    folder = grpo_reward.install_plugin(tmp_path)
    dist = next(importlib.metadata.distributions(path=[str(folder)]))
    (entry,) = dist.entry_points
    assert (entry.group, entry.name, entry.value) == ("posttrain", "bench_reward", "grpo_reward")


def test_prompts_option_sets_the_rows_per_step_and_the_data(tmp_path):
    """``--prompts 3``: 3 x 8 rows per step in the spec, and 3 prompts for each of the warm-up
    and timed steps in the data file."""
    args = common.parse_args(grpo.WORKLOAD, ["--model", "tiny", "--prompts", "3", "--steps", "2"])
    spec = common.make_spec(grpo.WORKLOAD, args, tmp_path)
    assert (spec["prompts"], spec["rows_per_step"]) == (3, 3 * grpo.GENERATIONS)
    assert len(Path(spec["data"]).read_text().splitlines()) == 3 * (1 + 2)
    assert grpo.common_settings(spec)["num_prompts"] == 3
