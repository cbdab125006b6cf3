"""A benchmark's results become a results file (benchmarks/record.py) and a table of
docs/benchmarks.md (benchmarks/report.py): the harness's own summaries, converted field by
field, a run replacing the run of its label, the command line as a user types it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import generation  # noqa: E402
import grpo  # noqa: E402
import record  # noqa: E402
import report  # noqa: E402


def tiny_config():
    from posttrain.models.tiny import SIZES, build_tokenizer, tiny_llama_config

    return tiny_llama_config(len(build_tokenizer()), **SIZES["tiny"])


def generation_summary():
    spec = {"form": "skewed", "warmup": 1, "steps": 2, "max_new_tokens": 4, "model_dir": "/nonexistent", "model": "tiny",
            "seed": 0}
    settings = generation.sampling_settings(rows=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                                            stop_token_ids=[2], dtype="float32")
    rows = [[1, 5, 6], [1, 7]]
    runs = {"posttrain-vllm": [generation.generation_report(spec, rows, [5.0, 1.0, 3.0], [[4, 4], [1, 2], [4, 3]], settings)],
            "trl": [generation.generation_report(spec, rows, [5.0, 6.0, 6.0], [[4, 4], [4, 4], [4, 4]], settings)]}
    for reports in runs.values():
        reports[0].update(peak_rss_mb=1234.56, infra_rss_mb=float("nan"))
    return generation.summarize_generation(generation.WORKLOAD, spec, runs, tiny_config(), 1e9, [1e9], [(0.5, 0, 0), (1.5, 0, 0)])


def test_a_generation_summary_becomes_rows_and_a_table():
    summary = generation_summary()
    file = record.harness_record(summary, "python benchmarks/generation.py --model tiny --reps 1 --steps 2")
    (run,) = file["runs"]
    assert run["label"] == "skewed, 1 x 2 steps" and run["details"] == "load 0.5 to 1.5, float32 matmul 1 GFLOP/s"
    vllm, trl = run["rows"]
    assert vllm == {"side": "posttrain-vllm", "call_s": 2.0, "call_s_min": 1.0, "call_s_max": 3.0, "tokens_per_s": 2,
                    "time_over_floor": round(summary["sides"]["posttrain-vllm"]["time_over_floor"], 2),
                    "peak_mb": 1235, "lengths": "2.5 / 2 / 3 / 4", "at_budget": "25%"}  # NaN Ray memory: left out
    assert trl["call_s"] == 6.0 and trl["at_budget"] == "100%"
    table = report.table(file)
    assert table.splitlines()[0].startswith("| side | call s (median) | min | max | vs baseline | tokens/s |")
    assert "| trl | 6.0 | 6.0 | 6.0 | 3.00 | 1 |" in table


def grpo_report(step_times, stages, lengths):
    steps = [grpo.grpo_step_record([[1, 5, 6], [1, 7]], lengths) for _ in range(len(step_times) + 1)]
    return {"step_times_s": step_times, "losses": [0.1] * len(steps), "steps": steps, "rewards": [0.5, 0.25],
            "stages": stages, "threads": 2, "settings": {}, "peak_rss_mb": 3000.0, "infra_rss_mb": 700.0,
            "rss_by_role": {"ray::DTensorPolicyWorker": 2000.4, "driver": 699.6, "ray::EnvironmentActor": 300.0,
                            "raylet": 120.0}}


def test_a_grpo_summary_gives_stage_times_memory_by_process_and_the_training_floor():
    spec = {"warmup": 1, "steps": 2, "model": "tiny", "rows_per_step": 2, "max_len": 64, "max_new_tokens": 64,
            "form": "skewed"}
    stages = [{"generation": 1.0, "training": 2.0, "refit": 0.1}, {"generation": 3.0, "training": 4.0, "refit": 0.3}]
    runs = {"posttrain-inside": [grpo_report([4.0, 6.0], stages, [4, 64])],
            "trl-default": [grpo_report([10.0, 12.0], [], [8, 60])]}
    rate = 1e9
    summary = common.summarize(grpo.WORKLOAD, spec, runs, tiny_config(), rate, [rate], [(1.0, 0, 0)])
    assert record.harness_record(summary, "c")["runs"][0]["label"] == "skewed, 1 x 2 steps"
    ours, theirs = record.harness_rows(summary)
    floor = summary["sides"]["posttrain-inside"]["stage_floor_s"]["training"]
    assert ours["step_s"] == 5.0 and ours["generation_s"] == 2.0 and ours["training_s"] == 3.0
    assert ours["refit_stage_s"] == 0.2 and ours["training_over_floor"] == round(3.0 / floor, 2)
    assert (ours["policy_worker_mb"], ours["driver_mb"], ours["environment_mb"]) == (2000, 700, 300)
    assert (ours["peak_mb"], ours["ray_mb"], ours["first_loss"]) == (3000, 700, 0.1)
    assert theirs["step_s"] == 11.0 and "training_s" not in theirs


def test_a_run_replaces_the_run_of_its_label_and_keeps_the_rest(tmp_path):
    def run(label, step):
        return {"label": label, "command": "c", "date": "d", "source": "s", "rows": [{"side": "a", "step_s": step}]}

    first = {"title": "T", "conditions": "C", "machine": "M", "baseline": "a", "runs": [run("dense", 1.0)]}
    record.save("x", first, tmp_path)
    record.save("x", {**first, "runs": [run("skewed", 2.0)]}, tmp_path)
    path = record.save("x", {**first, "title": "new title", "runs": [run("dense", 3.0)]}, tmp_path)
    saved = json.loads(path.read_text())
    assert saved["title"] == "T"
    assert [(r["label"], r["rows"][0]["step_s"]) for r in saved["runs"]] == [("dense", 3.0), ("skewed", 2.0)]


def test_the_recorded_command_is_the_one_a_user_types():
    argv = [str(BENCHMARKS / "grpo.py"), "--model", "small", "--out", "/tmp/x", "--record", "grpo_small", "--run=dense",
            "--sides", "trl-default,posttrain-inside"]
    assert record.command_line(argv) == "python benchmarks/grpo.py --model small --sides trl-default,posttrain-inside"


def test_the_harness_takes_record_and_run():
    import sft

    args = common.parse_args(sft.WORKLOAD, ["--record", "sft_small", "--run", "2 x 3 steps"])
    assert (args.record, args.run) == ("sft_small", "2 x 3 steps")


def test_a_table_names_a_field_it_does_not_know():
    file = {"title": "T", "conditions": "C", "machine": "M",
            "runs": [{"label": "l", "command": "c", "rows": [{"side": "a", "step_seconds": 1.0}]}]}
    with pytest.raises(ValueError, match=r"T: fields \['step_seconds'\] are not columns of record.COLUMNS"):
        report.table(file)


def test_the_report_rewrites_a_stale_table_and_check_names_it(tmp_path, capsys):
    results, page = tmp_path / "results", tmp_path / "page.md"
    run = {"label": "l", "command": "c", "date": "d", "source": "s", "rows": [{"side": "a", "step_s": 1.5}]}
    record.save("one", {"title": "T", "conditions": "c", "machine": "M", "runs": [run]}, results)
    page.write_text("# Page\n\n<!-- results one -->\nold table\n<!-- /results -->\n\nrest\n")
    options = ["--page", str(page), "--results", str(results)]
    assert report.main(["--check", *options]) == 1
    assert "tables differ from their results files: one" in capsys.readouterr().err
    assert report.main(options) == 0 and report.main(["--check", *options]) == 0
    assert page.read_text().endswith("| side | step s (median) |\n|---|---:|\n| a | 1.5 |\n\nCommand: `c`.\n<!-- /results -->\n\nrest\n")
    record.save("two", {"title": "U", "conditions": "c", "machine": "M", "runs": [run]}, results)
    assert report.main(options) == 2
    assert "results files with no place in the page: ['two']" in capsys.readouterr().err
