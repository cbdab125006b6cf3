"""Whole distillation runs on CPU (dtensor student and teacher, hf generation inside the
student's worker, the tiny models): the student's KL to the teacher falls over a few steps,
metrics and validation are logged; a teacher whose tokenizer differs from the student's is refused before anything
starts, naming both and the first token they disagree on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posttrain.config import config_from_dict
from posttrain.errors import ConfigError
from posttrain.run.context import run_algorithm
from posttrain.run.metrics import read_metrics


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def distill_config(student: str, teacher: str, tmp_path: Path, **distill) -> object:
    rows = [{"prompt": f"Say seven ({i})", "answer": "7", "task": "math"} for i in range(32)]
    prompts = write_rows(tmp_path / "prompts.jsonl", rows)
    return config_from_dict({
        "algorithm": "distill", "seed": 3, "run_dir": str(tmp_path / "run"),
        "policy": {"model": student, "train_global_batch_size": 16, "train_micro_batch_size": 16,
                   "logprob_micro_batch_size": 16, "max_total_sequence_length": 64, "optimizer": {"lr": 3e-3}},
        # the engine inside the student's worker: the same metrics as an engine process of its own
        # (checked: every metric of 8 steps equal), one process fewer
        "generation": {"max_new_tokens": 8, "in_policy_workers": True},
        "data": {"train": str(prompts), "validation": str(prompts)},
        "environments": {"math": {"num_workers": 1}},
        "distill": {"teacher": {"model": teacher}, "topk": 8, "num_prompts_per_step": 4, "num_generations_per_prompt": 4,
                    "max_num_steps": 8, "max_num_epochs": 10, "val_period": 8, "val_at_start": True,
                    "max_val_samples": 4, **distill},
        "checkpointing": {"enabled": False}, "logger": {"progress_bar": False},
    })


@pytest.mark.ray
def test_the_students_kl_to_the_teacher_falls(ray_cluster, tiny_model_path, tmp_path, monkeypatch):
    from posttrain.models.tiny import build_tiny_model
    from posttrain.run.context import RunContext

    sections = []
    build_generation = RunContext.build_generation
    monkeypatch.setattr(RunContext, "build_generation", lambda self, generation=None, **kw: sections.append(generation)
                        or build_generation(self, generation, **kw))
    teacher = str(build_tiny_model(tmp_path / "teacher", size="tiny", seed=1))
    run_algorithm(distill_config(tiny_model_path, teacher, tmp_path))
    assert sections[0].rows_per_call == 4 * 4  # a step's samples (more than the 4 validation prompts)

    train = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    kl = [r["reverse_kl"] for r in train]
    assert kl == [r["loss"] for r in train]  # the default KL is the reverse one
    assert sum(kl[-3:]) / 3 < 0.7 * sum(kl[:3]) / 3, kl
    for name in ("forward_kl", "topk_mass", "reward", "grad_norm", "timing/teacher", "refit/seconds"):
        assert name in train[-1], name
    validation = read_metrics(tmp_path / "run" / "metrics.jsonl", "validation")
    assert [r["step"] for r in validation] == [0, 8] and "accuracy" in validation[0]


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_starts(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_path, teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_call|>"]})
    tokenizer.save_pretrained(teacher)
    with pytest.raises(ConfigError) as info:
        run_algorithm(distill_config(tiny_model_path, str(teacher), tmp_path))
    assert str(info.value).startswith(
        f"distill.teacher.model: the teacher's tokenizer ('{teacher}') differs from the student's ('{tiny_model_path}', "
        "policy.model): 103 tokens for the student, 104 for the teacher; token '<|tool_call|>' (id 103) exists for "
        "the teacher only. On-policy distillation compares the teacher's and the student's next-token "
        "distributions token id by token id, so the teacher must use the student's tokenizer"
    )
    assert not (tmp_path / "run").exists()  # nothing ran: the run folder it created is removed
