"""The generation and refit benchmarks (benchmarks/generation.py, benchmarks/refit.py): their
summaries compute the floor from each call's own tokens, their checks refuse a dense run with
a short completion and sides that sampled differently, and posttrain's hf side and TRL's side,
run as the benchmark runs them, send the same prompts with the same sampling settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import generation  # noqa: E402
import refit  # noqa: E402


def tiny_config():
    from posttrain.models.tiny import SIZES, build_tokenizer, tiny_llama_config

    return tiny_llama_config(len(build_tokenizer()), **SIZES["tiny"])


def spec(form="skewed", warmup=1, steps=2, tmp_path=None):
    model_dir = tmp_path or Path("/nonexistent")
    return {"form": form, "warmup": warmup, "steps": steps, "max_new_tokens": 4, "model_dir": str(model_dir),
            "model": "tiny", "seed": 0}


def settings(**changes):
    base = generation.sampling_settings(rows=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                                        stop_token_ids=[3, 2], dtype="torch.float32")
    return {**base, **changes}


def test_sampling_settings_are_normalised():
    assert settings() == {"rows": 2, "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": None,
                          "stop_token_ids": [2, 3], "dtype": "float32"}
    assert generation.sampling_settings(rows=2, max_new_tokens=4, temperature=1, top_p=1, top_k=None,
                                        stop_token_ids=(3, 2), dtype="float32") == settings()


def test_report_keeps_row_lengths_and_refuses_a_short_dense_completion(tmp_path):
    rows = [[1, 5, 6], [1, 7]]
    report = generation.generation_report(spec("dense", tmp_path=tmp_path), rows, [9.0, 2.0, 3.0],
                                          [[4, 4], [4, 4], [4, 4]], settings())
    assert report["step_times_s"] == [2.0, 3.0] and report["losses"] == []
    assert report["steps"][0]["total_lengths"] == [7, 6] and report["steps"][0]["lengths"] == [2, 3]
    with pytest.raises(AssertionError, match="1 completions are not 4 tokens"):
        generation.generation_report(spec("dense", tmp_path=tmp_path), rows, [9.0, 2.0, 3.0],
                                     [[4, 4], [4, 3], [4, 4]], settings())


def test_settings_check_names_a_different_sampling_setting(tmp_path):
    rows = [[1, 5, 6], [1, 7]]
    a = generation.generation_report(spec(tmp_path=tmp_path), rows, [1.0] * 3, [[1, 4]] * 3, settings())
    b = generation.generation_report(spec(tmp_path=tmp_path), rows, [1.0] * 3, [[2, 2]] * 3, settings(temperature=0.7))
    common.check_settings({"a": a, "a2": a})
    with pytest.raises(common.SettingsMismatch, match="setting 'temperature': a=1.0 but b=0.7"):
        common.check_settings({"a": a, "b": b})


def test_length_stats():
    stats = common.length_stats([1, 2, 3, 4, 64, 64, 10, 20, 30, 40], budget=64)
    assert stats["mean"] == 23.8 and stats["median"] == 15 and stats["min"] == 1 and stats["max"] == 64
    assert stats["at_budget"] == 0.2 and stats["p10"] == 1 and stats["p90"] == 64


def test_summary_floor_counts_each_call_of_each_side(tmp_path):
    config = tiny_config()
    rows = [[1, 5, 6], [1, 7]]
    runs = {
        "posttrain-vllm": [generation.generation_report(spec(tmp_path=tmp_path), rows, [5.0, 1.0, 3.0],
                                                        [[4, 4], [1, 2], [4, 3]], settings())],
        "trl": [generation.generation_report(spec(tmp_path=tmp_path), rows, [5.0, 6.0, 6.0],
                                             [[4, 4], [4, 4], [4, 4]], settings())],
    }
    rate = 1e9
    result = generation.summarize_generation(generation.WORKLOAD, spec(tmp_path=tmp_path), runs, config, rate, [rate],
                                             [(1.0, 0.0, 0.0)])
    vllm, trl = result["sides"]["posttrain-vllm"], result["sides"]["trl"]
    floors = [common.forward_flops(config, [4, 4]) / rate, common.forward_flops(config, [7, 5]) / rate]
    assert vllm["floor_s"] == pytest.approx(sum(floors) / 2)
    assert vllm["time_over_floor"] == pytest.approx((1.0 / floors[0] + 3.0 / floors[1]) / 2)
    assert vllm["call_s_median"] == 2.0 and vllm["tokens_per_s"] == pytest.approx(5.0 / 2.0)
    assert trl["vs_baseline"] == 3.0 and trl["lengths"]["at_budget"] == 1.0
    table = generation.generation_table(result)
    assert "| trl | 6.000 |" in table


def test_refit_summary_reports_a_failing_side_and_the_copy_floor():
    report = {"step_times_s": [0.2, 0.4, 0.3], "bytes_moved": 100_000_000, "num_tensors": 10, "num_buckets": 1,
              "settings": {}, "threads": 2}
    runs = {"posttrain-vllm": [report], "trl-vllm": [{**report, "step_times_s": [], "error": "AttributeError: x"}]}
    result = refit.summarize_refit(refit.WORKLOAD, spec(), runs, tiny_config(), 1e10, [1e10], [(1.0, 0.0, 0.0)])
    row = result["sides"]["posttrain-vllm"]
    assert row["refit_s_median"] == 0.3 and row["floor_s"] == pytest.approx(0.01) and row["time_over_floor"] == pytest.approx(30)
    assert "| trl-vllm | fails: AttributeError: x |" in refit.refit_table(result)


def test_copy_rate_is_a_plausible_memory_bandwidth():
    rate = common.copy_bytes_per_s(nbytes=16 * 2**20, repeats=3, threads=1)
    assert 1e8 < rate < 1e12


@pytest.mark.trl
@pytest.mark.ray
def test_posttrain_hf_and_trl_sides_send_the_same_prompts_and_settings(tmp_path):
    pytest.importorskip("trl")
    args = common.parse_args(generation.WORKLOAD, ["--model", "tiny", "--steps", "1", "--max-len", "16",
                                                   "--form", "dense", "--max-new-tokens", "4"])
    run_spec = common.make_spec(generation.WORKLOAD, args, tmp_path)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(common.json.dumps(run_spec))
    runs = {side: common.run_child(generation.WORKLOAD.script, side, spec_path, timeout_s=300)
            for side in ("posttrain-hf", "trl")}
    common.check_settings(runs)  # weights, prompts of every call, sampling settings
    for run in runs.values():
        assert run["settings"]["stop_token_ids"] == [] and run["settings"]["rows"] == 128
        assert all(n == 4 for call in run["steps"] for n in call["completion_lengths"])
        assert len(run["step_times_s"]) == 1 and run["step_times_s"][0] > 0
