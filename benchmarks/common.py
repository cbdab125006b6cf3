"""The side-by-side benchmark harness shared by every workload (``sft.py``, ``dpo.py``).

A workload names its *sides* (posttrain with packing on and off, TRL with its defaults and
with its best CPU settings). Each side runs in a subprocess of its own so its peak memory
is its alone; the harness runs the sides in turn, repetition after repetition (posttrain,
TRL, posttrain, TRL, ...), so all of them see the same machine load. A child trains
``warmup + steps`` optimizer steps on the same JSONL file and reports per step: the wall
time since the previous step ended (so data loading, collation and logging count on both
sides; process and Ray start-up and the first ``warmup`` steps do not), the loss, the real
(non-padding) sample lengths and a digest of the token ids it trained on, plus the settings
it actually ran with. :func:`check_settings` fails loudly unless every side trained the
same weights on the same samples with the same optimizer, learning rate and loss.

The floor: the model FLOPs a step must do (:func:`forward_flops`, real tokens only) divided
by this machine's float32 ``torch.mm`` rate measured in the same run
(:func:`matmul_flops_per_s`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import record
import torch

REPO = Path(__file__).resolve().parents[1]

#: Relative tolerance on the first step's loss across sides (same weights, same tokens).
LOSS_RTOL = 1e-4
#: The fields of a step record (:func:`step_record`) that must be equal on every side.
STEP_FIELDS = ("digest", "lengths", "loss_tokens")

#: Scheduling priority of every side's processes. Ray starts its workers 15 nicer than its
#: raylet (capped at 19), so posttrain's training worker runs at 19 whatever the driver's
#: niceness; a TRL child at its parent's niceness would win every contended CPU slice. At 19
#: both sides' training processes compete equally (what matters on a shared machine).
CHILD_NICENESS = 19


# ---------------------------------------------------------------------- the floor


def matmul_flops_per_s(n: int = 2048, repeats: int = 5, threads: int | None = None) -> float:
    """Median float32 ``torch.mm`` rate of ``n x n`` matrices (FLOP/s) on ``threads`` threads
    (default: all cores), after one warm-up product."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def copy_bytes_per_s(nbytes: int = 256 * 2**20, repeats: int = 5, threads: int | None = None) -> float:
    """Median rate (bytes/s) of ``dst.copy_(src)`` between two preallocated ``nbytes``
    float32 tensors on ``threads`` threads (default: all cores), after one warm-up copy.
    Counts the bytes copied once (each copy reads and writes them)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() * 4 / statistics.median(times)


def matmul_parameters(config: Any) -> int:
    """Weights of a Llama-style model that take part in a matrix product per token: every
    layer's q/k/v/o and gate/up/down projections plus the output head (embeddings are a lookup)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * config.intermediate_size
    return layers * per_layer + config.vocab_size * d


def forward_flops(config: Any, lengths: Sequence[int]) -> float:
    """FLOPs of one forward pass over sequences of these real lengths: 2 x matmul parameters
    per token plus causal attention (QK^T and AV over the lower triangle: 2 x layers x
    query width x n^2 per sequence). A training pass (forward + backward) is 3 x this."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    attention = 2 * config.num_hidden_layers * q * sum(n * n for n in lengths)
    return 2 * matmul_parameters(config) * sum(lengths) + attention


def skewed_lengths(samples: int, max_len: int, seed: int, low: int = 8) -> list[int]:
    """Log-normal lengths clipped to [low, max_len]: most short, a long tail of a few long ones."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(samples, generator=g) * 0.9 + torch.log(torch.tensor(max_len / 6)))
    return [int(x) for x in raw.clamp(low, max_len)]


#: The residual-stream dimension :func:`set_eos_rate` holds constant, and its value.
EOS_DIM, EOS_DIM_VALUE = 0, 1.0


def set_eos_rate(model_dir: str | Path, rate: float, contexts: int = 64, length: int = 48, seed: int = 0) -> float:
    """Edit the Llama in ``model_dir`` in place so that its mean next-token probability of
    EOS is ``rate``; return the rate measured after the edit (same contexts).

    A random model emits EOS about once per vocabulary size tokens, so nearly every sampled
    completion runs to the budget. The edit gives it an EOS logit bias that does not depend
    on the context: residual dimension :data:`EOS_DIM` is set to :data:`EOS_DIM_VALUE` in
    every token embedding and no layer writes to it (that row of every ``o_proj`` and
    ``down_proj`` is zeroed), so after the final RMSNorm it holds a near-constant value ``h``;
    the output head reads that dimension only in the EOS row, with weight ``b / h``, where
    ``b`` is solved (bisection) so that the mean EOS probability over ``contexts`` random
    token sequences of ``length`` tokens (every position) equals ``rate``. Deterministic:
    the same folder and arguments give the same weights. Sampling then stops at EOS with a
    roughly geometric length distribution (per-token stop probability ``rate``). A model whose
    head is tied to its embedding is refused (the edit needs them apart)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.config.tie_word_embeddings:  # zeroing the head's column would zero the embedding's
        raise SystemExit(f"{model_dir}: the skewed form gives the output head an EOS bias apart from the token "
                         "embedding, but this model ties the two (tie_word_embeddings); use --form dense")
    eos, d = model.config.eos_token_id, EOS_DIM
    with torch.no_grad():
        model.model.embed_tokens.weight[:, d] = EOS_DIM_VALUE
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[d, :] = 0.0
            layer.mlp.down_proj.weight[d, :] = 0.0
        model.lm_head.weight[:, d] = 0.0
        ids = torch.randint(len(model.lm_head.weight), (contexts, length), generator=torch.Generator().manual_seed(seed))
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
        logits = model.lm_head(hidden).flatten(0, 1)
        others = torch.cat([logits[:, :eos], logits[:, eos + 1:]], dim=1)
        margin = logits[:, eos] - torch.logsumexp(others, dim=1)  # P(eos) = sigmoid(margin + b)
        low, high = -30.0, 30.0
        for _ in range(60):
            b = (low + high) / 2
            low, high = (b, high) if torch.sigmoid(margin + b).mean() < rate else (low, b)
        model.lm_head.weight[eos, d] = b / hidden[..., d].mean()
        measured = float(torch.softmax(model(input_ids=ids).logits, dim=-1)[..., eos].mean())
    model.save_pretrained(model_dir, safe_serialization=True)
    return measured


def length_stats(lengths: Sequence[int], budget: int) -> dict[str, float]:
    """Completion length distribution: mean, median, 10th/90th percentile, min, max, and
    the share that used the whole budget."""
    ordered = sorted(lengths)
    n = len(ordered)
    return {
        "mean": statistics.mean(ordered), "median": statistics.median(ordered), "p10": ordered[int(0.1 * (n - 1))],
        "p90": ordered[int(0.9 * (n - 1))], "min": ordered[0], "max": ordered[-1],
        "at_budget": sum(x >= budget for x in ordered) / n,
    }


def template_tokens(model_dir: str | Path) -> int:
    """Tokens the model's chat template adds around a one-turn conversation (the tiny
    character tokenizer's 5: ``<bos> <|user|> ... <|end|> <|assistant|> ... <|end|>``), so that
    conversations written for a token budget fit it under any family's template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                        tokenize=True, return_dict=True)["input_ids"]
    return len(ids) - 2


def random_text(length: int, g: torch.Generator) -> str:
    """``length`` characters the tiny character tokenizer maps one to one onto tokens (a BPE
    tokenizer onto at most as many)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    return "".join(alphabet[i] for i in torch.randint(len(alphabet), (max(1, length),), generator=g).tolist())


# ---------------------------------------------------------------------- what a child reports


def step_record(sequences: Sequence[Sequence[int]], loss_tokens: int) -> dict[str, Any]:
    """What one step trained on, independent of row order and padding: the sorted real
    lengths, the loss-token count and a digest of the sorted token-id sequences."""
    seqs = sorted(tuple(int(t) for t in s) for s in sequences)
    digest = hashlib.sha256(json.dumps(seqs).encode()).hexdigest()[:16]
    return {"lengths": sorted(len(s) for s in seqs), "loss_tokens": int(loss_tokens), "digest": digest}


def rows_of(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None) -> list[list[int]]:
    """The real token sequences of a collated batch: padded rows cut by ``attention_mask``,
    or a padding-free row (one row, no mask) split where ``position_ids`` restart at 0."""
    if attention_mask is not None:
        return [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask, strict=True)]
    assert position_ids is not None and input_ids.shape[0] == 1, "padding-free batches carry position_ids"
    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [input_ids.shape[1]]
    return [input_ids[0, a:b].tolist() for a, b in zip(starts, starts[1:], strict=False)]


def weights_digest(model_dir: str | Path) -> str:
    """Digest of the safetensors weights a side was told to load."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with f.open("rb") as stream:  # in blocks: a side's peak memory must not hold a copy of the weights
            for block in iter(lambda: stream.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()[:16]


def child_result(spec: dict[str, Any], step_ends: Sequence[float], losses: Sequence[float],
                 steps: Sequence[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """A child's JSON report. ``step_ends`` are wall-clock ends of every step (warm-up
    included); timed steps are those after the warm-up, each measured from the previous end."""
    w = spec["warmup"]
    assert w >= 1 and len(step_ends) == len(losses) == len(steps) == w + spec["steps"], (len(step_ends), len(steps))
    return {
        "step_times_s": [b - a for a, b in zip(step_ends[w - 1:], step_ends[w:], strict=False)],
        "losses": [float(x) for x in losses],
        "steps": list(steps),
        "settings": {**settings, "weights": weights_digest(spec["model_dir"])},
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------- peak memory


def _children_of() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _hwm_kib(pid: int) -> tuple[int, str] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]), cmd
    return None


#: Processes Ray starts for itself that carry a ``ray::`` name like actors: its infrastructure.
RAY_AGENTS = frozenset({"ray::DashboardAgent", "ray::RuntimeEnvAgent"})


class TreeMemory:
    """Polls a process and its descendants; keeps each process's peak resident set (VmHWM).

    ``training_mb``: the root process and every descendant that is not Ray's own
    (:func:`is_ray_infrastructure`): the Ray actors holding models, engines and environments,
    and their children -- the memory the training itself needs. ``infra_mb``: Ray's own
    processes (GCS, raylet, dashboard and its agents, log monitor, idle workers). Both sum
    per-process peaks."""

    def __init__(self, root: int, period_s: float = 0.2):
        self.root, self.period_s = root, period_s
        self.peaks: dict[int, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            tree, todo = _children_of(), [self.root]
            while todo:
                pid = todo.pop()
                todo.extend(tree.get(pid, []))
                seen = _hwm_kib(pid)
                if seen is not None and seen[0] >= self.peaks.get(pid, (0, ""))[0]:
                    self.peaks[pid] = seen
            self._stop.wait(self.period_s)

    def stop(self) -> dict[str, Any]:
        """``peak_rss_mb`` and ``infra_rss_mb`` (see the class docstring) and ``rss_by_role``:
        the same per-process peaks summed by what each process is (:func:`process_role`), MB."""
        self._stop.set()
        self._thread.join()
        training = infra = 0
        by_role: dict[str, float] = {}
        for pid, (kib, cmd) in self.peaks.items():
            role = process_role(cmd, root=pid == self.root)
            by_role[role] = by_role.get(role, 0.0) + kib / 1024
            if pid == self.root or not is_ray_infrastructure(cmd):
                training += kib
            else:
                infra += kib
        return {"peak_rss_mb": training / 1024, "infra_rss_mb": infra / 1024, "rss_by_role": by_role}


def process_role(cmdline: str, *, root: bool = False) -> str:
    """What a benchmark's process is, from its command line: ``driver`` (the side's own
    process), ``ray::<Actor>`` for a Ray actor (the worker holding a model, an engine, an
    environment...), ``ray idle worker``, a Ray daemon by its program name (``gcs_server``,
    ``raylet``, ...), or ``other`` (e.g. a verifier pool's workers: ``python -m <module>``)."""
    if root:
        return "driver"
    if cmdline.startswith("ray::"):
        actor = cmdline.split()[0]
        return "ray idle worker" if actor.startswith("ray::IDLE") else actor.split(".")[0]
    words = cmdline.split()
    if not words:
        return "other"
    target = _run_target(words)
    if target == "-m":
        module = words.index("-m") + 1
        return f"python -m {words[module]}" if module < len(words) else "python -m"
    return "python -c" if target == "-c" else Path(target).name


def _run_target(words: list[str]) -> str:
    """What a command line runs: its program, or for a Python interpreter the first word
    after the interpreter's own flags (``-m`` or ``-c`` themselves for a module or code)."""
    if not Path(words[0]).name.startswith("python"):
        return words[0]
    return next((w for w in words[1:] if w in ("-m", "-c") or not w.startswith("-")), words[0])


def is_ray_infrastructure(cmdline: str) -> bool:
    """Whether a process is one Ray runs for itself (GCS, raylet, dashboard and its agents,
    log monitor, idle workers), not one holding a part of the training."""
    role = process_role(cmdline)
    if role.startswith("ray::") or role == "ray idle worker":
        return role in RAY_AGENTS or role == "ray idle worker"
    words = cmdline.split()
    return bool(words) and f"{os.sep}ray{os.sep}" in _run_target(words)


# ---------------------------------------------------------------------- running the sides


def run_child(script: Path, side: str, spec_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``script --child side --spec spec_path`` in its own process (and, for posttrain,
    its own Ray cluster); return its report with its peak memory added."""
    out = spec_path.with_name(f"{side}.{time.time_ns()}.json")
    env = {**os.environ, "RAY_ADDRESS": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    log = out.with_suffix(".log").open("w")
    proc = subprocess.Popen([sys.executable, str(script), "--child", side, "--spec", str(spec_path), "--out", str(out)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    memory = TreeMemory(proc.pid)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mem = memory.stop()
        log.close()
    if rc != 0:
        tail = out.with_suffix(".log").read_text()[-4000:]
        raise RuntimeError(f"side {side!r} failed (exit {rc}); last output:\n{tail}")
    report = {**json.loads(out.read_text()), **mem, "side": side, "load_avg_1m": os.getloadavg()[0]}
    out.write_text(json.dumps(report))
    return report


class SettingsMismatch(AssertionError):
    """The sides did not train the same thing; the message lists every difference."""


def check_settings(results: dict[str, dict[str, Any]], loss_rtol: float | None = LOSS_RTOL,
                   step_fields: Sequence[str] = STEP_FIELDS) -> None:
    """Raise :class:`SettingsMismatch` unless every side (and every repetition of it) ran
    the same settings (weights, optimizer, lr, schedule, clipping, loss options, rows per
    step) on the same samples (the per-step records' ``step_fields``; by default digests,
    real lengths, loss tokens) and got the same first-step loss within ``loss_rtol`` (when
    both report losses; ``None``: not compared, e.g. GRPO, whose sides sample different tokens)."""
    problems = []
    (ref_name, ref), *others = results.items()
    for name, res in others:
        for key in sorted(set(ref["settings"]) | set(res["settings"])):
            a, b = ref["settings"].get(key), res["settings"].get(key)
            if a != b:
                problems.append(f"setting {key!r}: {ref_name}={a!r} but {name}={b!r}")
        if len(res["steps"]) != len(ref["steps"]):
            problems.append(f"steps: {ref_name} ran {len(ref['steps'])} but {name} ran {len(res['steps'])}")
        for k, (sa, sb) in enumerate(zip(ref["steps"], res["steps"], strict=False), start=1):
            for field in step_fields:
                if sa[field] != sb[field]:
                    problems.append(f"step {k} {field}: {ref_name}={_short(sa[field])} but {name}={_short(sb[field])}")
        if loss_rtol is None or not (ref["losses"] and res["losses"]):  # no loss (generation) or not comparable
            continue
        la, lb = ref["losses"][0], res["losses"][0]
        if abs(la - lb) > loss_rtol * abs(la):
            problems.append(f"first-step loss: {ref_name}={la:.6f} but {name}={lb:.6f} (rtol {loss_rtol})")
    if problems:
        raise SettingsMismatch("the sides did not train the same thing:\n  " + "\n  ".join(problems))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


# ---------------------------------------------------------------------- the workload driver


@dataclass(frozen=True)
class Workload:
    """One benchmark: its sides (child entry points, each ``spec -> report``), the one that
    TRL is compared against, the data it writes, and the FLOPs of one step.

    Optional, for workloads that are not training steps (generation, refit): ``options``,
    extra command-line options (name -> ``add_argument`` keywords; ``--name`` on the command
    line, the parsed value in the spec under ``name``); ``rate``, the machine rate the floor
    divides by, of a thread count (default: float32 matmul FLOP/s); ``summarize`` and
    ``table``, replacing :func:`summarize` and :func:`markdown_table`.

    Optional, for workloads whose sides do not process identical tokens (GRPO samples its
    own): ``step_fields`` and ``loss_rtol`` (what :func:`check_settings` compares);
    ``prepare_model`` (edits the built model folder in place, before any side reads it, e.g.
    :func:`set_eos_rate`); ``side_extras`` (extra fields of a side's row, from its reports,
    the spec, the model config and the machine rate) and ``extra_table`` (Markdown appended
    to the table); ``defaults`` (this workload's defaults of the common options, e.g. ``lr``)."""

    name: str
    script: Path
    sides: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]
    baseline: str
    write_data: Callable[[dict[str, Any], Path], None]
    step_flops: Callable[[Any, list[int]], float]
    #: Rows (samples) per step: a number, or a function of the spec (workload options included).
    rows_per_step: int | Callable[[Mapping[str, Any]], int]
    flops_rule: str
    options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    rate: Callable[[int], float] = lambda threads: matmul_flops_per_s(threads=threads)
    summarize: Callable[..., dict[str, Any]] | None = None
    table: Callable[[dict[str, Any]], str] | None = None
    step_fields: tuple[str, ...] = STEP_FIELDS
    loss_rtol: float | None = LOSS_RTOL
    prepare_model: Callable[[dict[str, Any], Path], None] | None = None
    side_extras: Callable[[list[dict[str, Any]], dict[str, Any], Any, float], dict[str, Any]] | None = None
    extra_table: Callable[[dict[str, Any]], str] | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def parse_args(workload: Workload, argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"posttrain vs TRL: {workload.name}")
    p.add_argument("--model", default="small",
                   help="posttrain.models.tiny size preset (tiny | small | medium), or a real shape: "
                        + " | ".join(REAL_SHAPES))
    p.add_argument("--reps", type=int, default=2, help="repetitions of every side, alternating")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per repetition")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per repetition")
    p.add_argument("--max-len", type=int, default=256, help="longest sample in tokens")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", default=",".join(workload.sides), help="comma-separated subset of sides")
    p.add_argument("--out", default=None, help="folder for results.json / results.md (default: a temp folder)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side run")
    p.add_argument("--summarize", default=None,
                   help="rebuild the table from the finished side reports in this --out folder (e.g. of a stopped run)")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="also write the results into benchmarks/results/NAME.json, a table of docs/benchmarks.md "
                        "(then run python benchmarks/report.py)")
    p.add_argument("--run", metavar="LABEL", default=None,
                   help="the run's label in that file, replacing a run of the same label (default: form, reps x steps)")
    for name, kwargs in workload.options.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.set_defaults(**workload.defaults)
    return p.parse_args(argv)


def main(workload: Workload, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line: a child runs one side; otherwise run every side ``--reps`` times,
    check the settings, print the table and write ``results.json`` / ``results.md`` (and,
    with ``--record NAME``, the run into the results file ``benchmarks/results/NAME.json``)."""
    args = parse_args(workload, argv)
    if args.child:
        os.nice(CHILD_NICENESS - os.nice(0))
        spec = json.loads(Path(args.spec).read_text())
        torch.set_num_threads(spec["threads"])
        report = workload.sides[args.child](spec)
        Path(args.out).write_text(json.dumps(report))
        return report
    result = summarize_folder(workload, Path(args.summarize)) if args.summarize else run_benchmark(workload, args)
    if args.record:
        path = record.save(args.record, record.harness_record(result, record.command_line(), args.run))
        print(f"recorded in {path}")
    return result


#: Released models' configurations, built with random weights (``--model``): the architecture,
#: its sizes and its family's tokenizer from :mod:`posttrain.testing.zoo` (a 512-token BPE whose
#: ids the embedding's rows cover many times over, as Qwen's 151,936 rows cover its 151,665 tokens).
REAL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", dict(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40_960,
        rms_norm_eps=1e-6, initializer_range=0.02, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )),
}


def build_model(path: Path, name: str, seed: int) -> Path:
    """``--model``'s folder: a :data:`REAL_SHAPES` configuration or a tiny-model size preset."""
    if name in REAL_SHAPES:
        from posttrain.testing.zoo import build_zoo_model

        arch, sizes = REAL_SHAPES[name]
        return build_zoo_model(path, arch, seed=seed, **sizes)
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(path, size=name, seed=seed)


def make_spec(workload: Workload, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Build the model and the data; the spec every child reads."""
    spec = {
        "workload": workload.name, "model": args.model, "steps": args.steps, "warmup": args.warmup,
        "max_len": args.max_len, "lr": args.lr, "seed": args.seed,
        "threads": os.cpu_count() or 1, "workdir": str(workdir), **{name: getattr(args, name) for name in workload.options},
        "model_dir": str(build_model(workdir / "model", args.model, args.seed)),
    }
    rows = workload.rows_per_step
    spec["rows_per_step"] = rows(spec) if callable(rows) else rows
    if workload.prepare_model is not None:
        workload.prepare_model(spec, Path(spec["model_dir"]))
    data = workdir / "train.jsonl"
    workload.write_data(spec, data)
    spec["data"] = str(data)
    return spec


def run_benchmark(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:

    workdir = Path(args.out or tempfile.mkdtemp(prefix=f"bench_{workload.name}_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = make_spec(workload, args, workdir)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    load = [os.getloadavg()]
    rate = [workload.rate(spec["threads"])]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rep in range(args.reps):
        for side in sides:
            print(f"[{workload.name}] rep {rep + 1}/{args.reps}: {side} ...", flush=True)
            runs[side].append(run_child(workload.script, side, spec_path, args.timeout))
            load.append(os.getloadavg())
        rate.append(workload.rate(spec["threads"]))
    return finish(workload, spec, runs, rate, load)


def summarize_folder(workload: Workload, workdir: Path) -> dict[str, Any]:
    """The table of the side reports finished in ``workdir`` (a stopped run: every side
    that completed at least one repetition); the machine rate is measured now. Reports of a
    harness older than the memory fields show NaN peak memory."""
    spec = json.loads((workdir / "spec.json").read_text())
    runs: dict[str, list[dict[str, Any]]] = {}
    for side in workload.sides:
        for f in sorted(workdir.glob(f"{side}.*.json")):
            report = json.loads(f.read_text())
            runs.setdefault(side, []).append(report)
    load = [(r.get("load_avg_1m", float("nan")), 0.0, 0.0) for reps in runs.values() for r in reps] + [os.getloadavg()]
    return finish(workload, spec, runs, [workload.rate(spec["threads"])], load)


def finish(workload: Workload, spec: dict[str, Any], runs: dict[str, list[dict[str, Any]]], rate: list[float],
           load: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Check the settings, summarize, print the table and write results.json / results.md."""
    from transformers import AutoConfig

    workdir = Path(spec["workdir"])
    check_settings({f"{s}#{k + 1}": r for s, reps in runs.items() for k, r in enumerate(reps)},
                   loss_rtol=workload.loss_rtol, step_fields=workload.step_fields)
    hf_config = AutoConfig.from_pretrained(spec["model_dir"])
    result = (workload.summarize or summarize)(workload, spec, runs, hf_config, statistics.median(rate), rate, load)
    (workdir / "results.json").write_text(json.dumps(result, indent=1))
    table = (workload.table or markdown_table)(result) + (workload.extra_table(result) if workload.extra_table else "")
    table += memory_table(result)
    (workdir / "results.md").write_text(table)
    print("\n" + table + f"\nresults in {workdir}")
    return result


def summarize(workload: Workload, spec: dict[str, Any], runs: dict[str, list[dict[str, Any]]], hf_config: Any,
              rate: float, rates: list[float], load: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Per side: step time median/min/max over every timed step of every repetition, real
    tokens/s, peak memory, TRL/posttrain and time/floor ratios. Each side's floor is counted
    on the tokens its own timed steps processed (mean over its repetitions; the same on
    every side when all sides train the same tokens); the top-level floor is the baseline's."""
    rows = {}
    for side, reps in runs.items():
        timed = [s for r in reps for s in r["steps"][spec["warmup"]:]]
        flops = statistics.mean(workload.step_flops(hf_config, s["lengths"]) for s in timed)
        tokens = statistics.mean(sum(s["lengths"]) for s in timed)
        floor_s = flops / rate
        times = [t for r in reps for t in r["step_times_s"]]
        median = statistics.median(times)
        rows[side] = {
            "real_tokens_per_step": tokens, "step_gflop": flops / 1e9, "floor_s": floor_s,
            "step_s_median": median, "step_s_min": min(times), "step_s_max": max(times),
            "tokens_per_s": tokens / median,
            "peak_rss_mb": max(r.get("peak_rss_mb", float("nan")) for r in reps),
            "infra_rss_mb": max(r.get("infra_rss_mb", float("nan")) for r in reps), "time_over_floor": median / floor_s,
            "rss_by_role": _max_by_role(reps),
            "first_loss": reps[0]["losses"][0], "last_loss": reps[0]["losses"][-1], "reps": len(reps),
            "threads": reps[0]["threads"],
            **(workload.side_extras(reps, spec, hf_config, rate) if workload.side_extras else {}),
        }
    baseline = workload.baseline if workload.baseline in rows else next(iter(rows))  # the first side run, without it
    base_row = rows[baseline]
    tokens, flops, floor_s = base_row["real_tokens_per_step"], base_row["step_gflop"] * 1e9, base_row["floor_s"]
    first = next(iter(runs.values()))[0]
    base = base_row["step_s_median"]
    for row in rows.values():
        row["vs_baseline"] = row["step_s_median"] / base
    return {
        "workload": workload.name, "model": spec["model"], "parameters": _parameters(hf_config),
        "rows_per_step": spec["rows_per_step"], "real_tokens_per_step": tokens, "step_gflop": flops / 1e9,
        "flops_rule": workload.flops_rule, "matmul_gflops": rate / 1e9, "matmul_gflops_samples": [r / 1e9 for r in rates],
        "floor_s": floor_s, "baseline": baseline, "steps": spec["steps"], "warmup": spec["warmup"],
        "max_len": spec["max_len"], "load_avg_1m": [x[0] for x in load], "machine": _machine(), "sides": rows,
        "settings": first["settings"], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **({"form": spec["form"]} if "form" in spec else {}),
    }


def _max_by_role(reports: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each role's peak RSS (MB), the largest over the repetitions."""
    roles: dict[str, float] = {}
    for report in reports:
        for role, mb in report.get("rss_by_role", {}).items():
            roles[role] = max(roles.get(role, 0.0), mb)
    return dict(sorted(roles.items(), key=lambda item: -item[1]))


def memory_table(result: dict[str, Any]) -> str:
    """Peak RSS per kind of process and side (MB; processes of one kind summed), when measured."""
    sides = {name: s["rss_by_role"] for name, s in result["sides"].items() if s.get("rss_by_role")}
    if not sides:
        return ""
    roles = list(dict.fromkeys(role for by_role in sides.values() for role in by_role))
    lines = ["", "Peak resident memory by process (MB; the sum of each process's own peak, processes of a kind added):",
             "", "| process | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
    for role in roles:
        lines.append(f"| {role} | " + " | ".join(f"{by_role.get(role, 0.0):.0f}" for by_role in sides.values()) + " |")
    lines.append("| **all** | " + " | ".join(f"{sum(by_role.values()):.0f}" for by_role in sides.values()) + " |")
    return "\n".join(lines) + "\n"


def _parameters(config: Any) -> int:
    """The matrices, the input embedding unless the output head is the same tensor (tied), the norms."""
    embedding = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    return matmul_parameters(config) + embedding + (2 * config.num_hidden_layers + 1) * config.hidden_size


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def markdown_table(result: dict[str, Any]) -> str:
    """The result as a Markdown table with its context lines."""
    r = result
    loads = r["load_avg_1m"]
    lines = [
        f"**{r['workload']}**, model `{r['model']}` ({r['parameters'] / 1e6:.1f}M parameters), "
        f"{r['rows_per_step']} rows per step, {r['real_tokens_per_step']:.0f} real tokens per step, "
        f"{r['steps']} timed steps x {next(iter(r['sides'].values()))['reps']} repetitions per side; {r['date']}, {r['machine']}.",
        f"Floor: {r['step_gflop']:.1f} GFLOP per step ({r['flops_rule']}) / {r['matmul_gflops']:.1f} GFLOP/s "
        f"(float32 torch.mm, median; samples {', '.join(f'{x:.0f}' for x in r['matmul_gflops_samples'])}) "
        f"= {r['floor_s']:.3f} s. Load average (1 min) during the run: {min(loads):.1f} to {max(loads):.1f}.",
        "",
        f"| side | step s (median) | min | max | real tokens/s | peak RSS MB (+Ray infra) | time / {r['baseline']} | time / floor | first loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in r["sides"].items():
        lines.append(
            f"| {name} | {s['step_s_median']:.3f} | {s['step_s_min']:.3f} | {s['step_s_max']:.3f} | {s['tokens_per_s']:.0f} "
            f"| {s['peak_rss_mb']:.0f} (+{s['infra_rss_mb']:.0f}) | {s['vs_baseline']:.2f} | {s['time_over_floor']:.2f} "
            f"| {s['first_loss']:.5f} |"
        )
    return "\n".join(lines) + "\n"
