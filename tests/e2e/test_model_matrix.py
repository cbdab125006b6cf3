"""The supported-models matrix: every architecture of :mod:`posttrain.testing.zoo` through
every path (the columns of :data:`model_matrix.PATHS`), each cell compared with what
``model_matrix.json`` records (``POSTTRAIN_RECORD_MATRIX=1`` records instead) and written
into docs/models.md by ``python tests/e2e/model_matrix.py``.

A cell first validates its config as a run does: a refusal there is the cell's outcome,
before any worker starts. Otherwise it runs the path and checks its numbers against plain
transformers. The architectures are built once, with two key/value heads so that tensor
parallel 2 divides them; one Ray cluster serves every cell, and each architecture's
one-rank policy (with an hf engine in its workers) serves the SFT, GRPO, refit and export
cells, each starting from the initial weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import attrs
import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.schema import (
    GenerationConfig,
    LoraConfig,
    OptimizerConfig,
    PolicyConfig,
    RunConfig,
    SequencePackingConfig,
    WorkerResources,
)
from posttrain.config.validate import validate_config
from posttrain.data.chat import ChatEncoder, load_tokenizer
from posttrain.data.dataset import build_dataset
from posttrain.distributed import VirtualCluster
from posttrain.errors import ConfigError
from posttrain.plugins import plugin_host
from posttrain.run.refit import refit
from posttrain.testing.generation import check_trained_policy_refit, generated_mask, prompt_batch
from posttrain.testing.policy import (
    exported_weights,
    max_difference,
    reference_logprobs,
    reference_model,
    reference_step,
)
from posttrain.testing.zoo import build_zoo_model
from tests.e2e import model_matrix as matrix

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
RECORDING = os.environ.get(matrix.RECORD_VARIABLE) == "1"
FULL = RECORDING or os.environ.get(matrix.FULL_VARIABLE) == "1"

CONVERSATIONS = [
    [{"role": "user", "content": "What is 7 plus 5?"}, {"role": "assistant", "content": "The answer is 12."}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello! How can I help you today?"}],
    [{"role": "user", "content": "What is 9 times 8?"}, {"role": "assistant", "content": "72"},
     {"role": "user", "content": "And 10 - 3?"}, {"role": "assistant", "content": "7"}],
    [{"role": "user", "content": "Translate to French: good morning."}, {"role": "assistant", "content": "Bonjour."}],
]
PROMPTS = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "Write a poem about the sea."}]]
SAMPLES_PER_PROMPT = 2
MAX_LENGTH = 64
#: LoRA's named targets: each family's query and value projections (Phi-3 fuses q, k and v).
NAMED_TARGETS = {"phi3": ["qkv_proj"]}
DEFAULT_TARGETS = ["q_proj", "v_proj"]


# ----------------------------------------------------------------------------- the record


@pytest.fixture(scope="module")
def record():
    """``record(arch, path_id, outcome)`` checks ``outcome`` against model_matrix.json (or, when
    recording, stores it; the file is written when the module ends, with its wall time)."""
    results = matrix.load()
    began = time.perf_counter()

    def check(arch: str, path_id: str, got: matrix.Outcome) -> None:
        if RECORDING:
            results["cells"].setdefault(arch, {})[path_id] = attrs.asdict(got)
            return
        want = matrix.outcome(results, arch, path_id)
        assert want is not None, f"{matrix.RESULTS.name} has no outcome for {arch}/{path_id}: record it"
        assert got.same_as(want), f"{arch}/{path_id}: recorded {want}, got {got}"

    yield check
    if RECORDING:
        results["wall_s"] = round(time.perf_counter() - began)
        results["load_1m"] = round(os.getloadavg()[0], 1)
        matrix.save(results)


def run_cell(record, arch: str, path_id: str, config: RunConfig, body) -> None:
    """Validate ``config`` (a refusal is the outcome), run ``body()``, and compare the outcome
    with the record. When the record says ``works``, a failure is raised as it is."""
    start = time.perf_counter()
    try:
        validate_config(config)
    except ConfigError as exc:
        record(arch, path_id, matrix.Outcome("refused", str(exc), round(time.perf_counter() - start, 1)))
        return
    expected = None if RECORDING else matrix.outcome(matrix.load(), arch, path_id)
    if expected is not None and expected.status == "works":
        body()
        got = matrix.Outcome("works", None, round(time.perf_counter() - start, 1))
    else:
        try:
            body()
            got = matrix.Outcome("works", None, round(time.perf_counter() - start, 1))
        except Exception as exc:  # recorded as a known failure
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            got = matrix.Outcome("fails", f"{type(exc).__name__}: {first}", round(time.perf_counter() - start, 1))
    record(arch, path_id, got)


# ----------------------------------------------------------------------------- per architecture


@attrs.define
class Arch:
    """One architecture's folder, its data in its own chat format, and what its cells share."""

    name: str
    path: str
    sft: Batch
    prompts: list[list[int]]
    cluster: VirtualCluster
    policy: object = None
    hf: object = None
    initial: str = ""

    def restore(self):
        """The one-rank policy at its initial weights and optimizer state, batching as configured."""
        self.policy.load_checkpoint(self.initial)
        self.policy.config.policy.sequence_packing = SequencePackingConfig()
        return self.policy


def run_config(arch: Arch, *, workers: int = 1, tp: int = 1, backend: str = "dtensor",
               lora: LoraConfig | None = None, optimizer: OptimizerConfig | None = None,
               generation: str = "hf") -> RunConfig:
    dp = workers // tp
    return RunConfig(
        seed=0,
        policy=PolicyConfig(
            backend=backend, model=arch.path, num_workers=workers, tensor_parallel_size=tp,
            train_global_batch_size=4, train_micro_batch_size=4 // dp, logprob_micro_batch_size=2,
            max_total_sequence_length=MAX_LENGTH, logprob_chunk_size=200, max_grad_norm=None,
            optimizer=optimizer or OptimizerConfig(name="adamw", lr=1e-2), lora=lora or LoraConfig(),
            resources=WorkerResources(cpus=0.5),
        ),
        generation=GenerationConfig(
            backend=generation, temperature=1.0, max_new_tokens=8, in_policy_workers=generation == "hf",
            resources=WorkerResources(cpus=1 if generation == "vllm" else 0.5),
        ),
    )


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    from posttrain.config.schema import ClusterConfig

    cluster = VirtualCluster(ClusterConfig())
    yield cluster
    cluster.shutdown()


def pytest_generate_tests(metafunc):
    """Each path's test runs on the architectures of :func:`model_matrix.cells_to_run`."""
    if "arch" in metafunc.fixturenames:
        path_id = next(p for p, column in matrix.PATHS.items() if column.test == metafunc.function.__name__)
        metafunc.parametrize("arch", matrix.cells_to_run(path_id, full=FULL), indirect=True, scope="module")


@pytest.fixture(scope="module")
def arch(request, cluster, tmp_path_factory):
    """The architecture of this group of cells: built once, its one-rank policy and hf engine
    started by the first cell that needs them and shut down when the group ends."""
    name = request.param
    folder = tmp_path_factory.mktemp(f"matrix_{name}")
    path = str(build_zoo_model(folder / "model", name, num_key_value_heads=2))
    encoder = ChatEncoder(load_tokenizer(path))
    rows = folder / "sft.jsonl"
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    sft = build_dataset(rows, "sft", encoder, max_length=MAX_LENGTH).collate(range(len(CONVERSATIONS)))
    prompts = [encoder.encode_prompt(p).input_ids for p in PROMPTS for _ in range(SAMPLES_PER_PROMPT)]
    state = Arch(name, path, sft, prompts, cluster)
    yield state
    for part in (state.hf, state.policy):
        if part is not None:
            part.shutdown()


def one_rank(arch: Arch):
    """The architecture's one-rank dtensor policy (started on first use) at its initial weights."""
    if arch.policy is None:
        host = plugin_host()
        config = run_config(arch)
        arch.policy = host.policy_backends["dtensor"](config, arch.cluster, name=f"matrix-{arch.name}")
        arch.initial = str(Path(arch.path).parent / "initial")
        arch.policy.save_checkpoint(arch.initial)
        arch.hf = host.generation_backends["hf"](config, arch.cluster, host=arch.policy)
    return arch.restore()


def nll():
    from posttrain_sft.loss import NLLLoss

    return NLLLoss()


def assert_transformers_logprobs(got: torch.Tensor, model, batch: Batch) -> None:
    """``got`` (a float32 trainer's) equal the logprobs of ``model``'s forward (a transformers
    model: eager attention, float32 like the trainer, each sample alone) within 1e-5."""
    want = reference_logprobs(model, batch).double()
    torch.testing.assert_close(got.double() * batch["token_mask"], want, rtol=0, atol=1e-5)


def reference_loss(model, batch: Batch) -> float:
    """The batch's token NLL under a transformers model, each sample alone (eager)."""
    mask = batch["token_mask"].double() * batch["sample_mask"].double()[:, None]
    with torch.no_grad():
        return float(-(reference_logprobs(model, batch).double() * mask).sum() / mask.sum())


def check_loss_and_gradients(config: RunConfig, arch: Arch, name: str) -> None:
    """A policy of ``config`` (SGD, lr=1: a step's weight change is the gradient): its step-0
    loss and every gradient equal transformers' float64 ones."""
    policy = plugin_host().policy_backends[config.policy.backend](config, arch.cluster, name=name)
    try:
        before = exported_weights(policy)
        loss = policy.train(arch.sft, nll())["loss"]
        after = exported_weights(policy)
    finally:
        policy.shutdown()
    ref_loss, ref_grads = reference_step(arch.path, arch.sft)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    grads = {k: before[k].double() - after[k].double() for k in before}
    assert sorted(grads) == sorted(ref_grads), "the policy's weights are not the model's parameters"
    assert max_difference(grads, ref_grads) < 1e-5


SGD = OptimizerConfig(name="sgd", lr=1.0)


# ----------------------------------------------------------------------------- the cells


def test_sft(arch, record):
    def body():
        policy = one_rank(arch)
        want = reference_loss(reference_model(arch.path), arch.sft)
        for packing in (SequencePackingConfig(), SequencePackingConfig(enabled=True, max_tokens_per_row=2 * MAX_LENGTH)):
            policy.config.policy.sequence_packing = packing
            assert policy.train(arch.sft, nll(), eval_mode=True)["loss"] == pytest.approx(want, abs=1e-5), packing
        assert_transformers_logprobs(policy.get_logprobs(arch.sft)["logprobs"], reference_model(arch.path, torch.float32),
                                     arch.sft)
        policy.train(arch.sft, nll())
        assert policy.train(arch.sft, nll(), eval_mode=True)["loss"] < want

    run_cell(record, arch.name, "sft", run_config(arch), body)


def test_grpo(arch, record):
    def body():
        from posttrain_grpo.config import ClippedPGConfig
        from posttrain_grpo.loss import ClippedPGLoss

        policy = one_rank(arch)
        out = arch.hf.generate(prompt_batch(arch.prompts))
        mask = generated_mask(out, arch.prompts).float()
        batch = Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"], token_mask=mask,
                      sample_mask=torch.ones(len(arch.prompts)), generation_logprobs=out["logprobs"])
        batch["prev_logprobs"] = policy.get_logprobs(batch)["logprobs"]
        rewards = torch.tensor([1.0, 0.0] * (len(arch.prompts) // 2))  # the first sample of each prompt is better
        batch["advantages"] = rewards - rewards.view(-1, SAMPLES_PER_PROMPT).mean(1).repeat_interleave(SAMPLES_PER_PROMPT)
        metrics = policy.train(batch, ClippedPGLoss(ClippedPGConfig()))
        assert 1.0 <= metrics["token_mult_prob_error"] < 1 + 1e-5
        moved = ((policy.get_logprobs(batch)["logprobs"] - batch["prev_logprobs"]) * mask).sum(1)
        assert float((moved * batch["advantages"]).sum()) > 0, moved

    run_cell(record, arch.name, "grpo", run_config(arch), body)


def test_fsdp2(arch, record):
    config = run_config(arch, workers=2, optimizer=SGD)
    run_cell(record, arch.name, "fsdp2", config, lambda: check_loss_and_gradients(config, arch, f"matrix-{arch.name}-dp2"))


def test_tp2(arch, record):
    config = run_config(arch, workers=2, tp=2, optimizer=SGD)
    run_cell(record, arch.name, "tp2", config, lambda: check_loss_and_gradients(config, arch, f"matrix-{arch.name}-tp2"))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not importable")
def test_vllm(arch, record):
    config = run_config(arch, generation="vllm")
    config = attrs.evolve(config, generation=attrs.evolve(config.generation, refit_checksums=True))

    def body():
        policy = one_rank(arch)
        engine = plugin_host().generation_backends["vllm"](config, arch.cluster)
        try:
            for _ in range(3):  # a refit that leaves anything stale shows by the next one at the latest
                check_trained_policy_refit(policy, engine, arch.prompts, bucket_bytes=1 << 16, max_difference=1e-4,
                                           mult_prob_error=1 + 1e-5)
        finally:
            engine.shutdown()

    run_cell(record, arch.name, "vllm", config, body)


def test_hf(arch, record):
    def body():
        policy = one_rank(arch)
        check_trained_policy_refit(policy, arch.hf, arch.prompts, bucket_bytes=1 << 16, mult_prob_error=1 + 1e-5)

    run_cell(record, arch.name, "hf", run_config(arch), body)


def check_lora(arch: Arch, targets, name: str, record, path_id: str) -> None:
    lora = LoraConfig(enabled=True, target_modules=targets, export_merged=True)
    config = run_config(arch, lora=lora)

    def body():
        policy = plugin_host().policy_backends["dtensor"](config, arch.cluster, name=name)
        try:
            step0 = policy.train(arch.sft, nll(), eval_mode=True)["loss"]
            policy.train(arch.sft, nll())
            trained = policy.train(arch.sft, nll(), eval_mode=True)["loss"]
            folder = Path(arch.path).parent / name
            policy.export_hf(str(folder))
        finally:
            policy.shutdown()
        assert step0 == pytest.approx(reference_loss(reference_model(arch.path), arch.sft), abs=1e-5)
        assert trained < step0 - 1e-3
        assert reference_loss(reference_model(folder / "merged"), arch.sft) == pytest.approx(trained, abs=1e-5)

    run_cell(record, arch.name, path_id, config, body)


def test_lora(arch, record):
    check_lora(arch, "all-linear", f"matrix-{arch.name}-lora", record, "lora")


def test_lora_named(arch, record):
    targets = NAMED_TARGETS.get(arch.name, DEFAULT_TARGETS)
    check_lora(arch, targets, f"matrix-{arch.name}-lora-named", record, "lora_named")


def test_export(arch, record):
    def body():
        from transformers import GenerationConfig

        policy = one_rank(arch)
        policy.train(arch.sft, nll())
        folder = Path(arch.path).parent / "export"
        policy.export_hf(str(folder))
        exported = reference_model(folder, torch.float32)  # AutoModelForCausalLM, eager (Gemma 2's soft-caps)
        assert_transformers_logprobs(policy.get_logprobs(arch.sft)["logprobs"], exported, arch.sft)
        refit(policy, arch.hf, 1 << 16)
        served = arch.hf.generate(prompt_batch(arch.prompts), greedy=True)
        stops = GenerationConfig.from_pretrained(folder).eos_token_id
        for row, prompt in enumerate(arch.prompts):
            end = int(served["unpadded_sequence_lengths"][row])
            with torch.no_grad():
                tokens = exported.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=stops,
                                           pad_token_id=exported.config.pad_token_id)[0, len(prompt):].tolist()
            assert tokens == served["output_ids"][row, len(prompt):end].tolist(), row

    run_cell(record, arch.name, "export", run_config(arch), body)


@pytest.mark.megatron
@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
def test_megatron(arch, record):
    config = run_config(arch, backend="megatron")

    def body():
        policy = plugin_host().policy_backends["megatron"](config, arch.cluster, name=f"matrix-{arch.name}-megatron")
        try:
            loss = policy.train(arch.sft, nll(), eval_mode=True)["loss"]
            logprobs = policy.get_logprobs(arch.sft)["logprobs"]
            policy.train(arch.sft, nll())
            trained = policy.train(arch.sft, nll(), eval_mode=True)["loss"]
        finally:
            policy.shutdown()
        assert loss == pytest.approx(reference_loss(reference_model(arch.path), arch.sft), abs=1e-5)
        assert_transformers_logprobs(logprobs, reference_model(arch.path, torch.float32), arch.sft)
        assert trained < loss

    run_cell(record, arch.name, "megatron", config, body)
