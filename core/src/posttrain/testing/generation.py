"""Checking a generation backend against plain transformers on the same weights.

:class:`GenerationContract` runs the checks every backend must pass (greedy parity,
logprob parity after a refit, stop strings and truncation, fresh samples per call) on a
running backend. The functions below it are the reference computations it uses, for a
backend's own extra tests: :func:`prompt_batch`, :func:`check_output_layout`,
:func:`reference_logprobs` (a direct forward pass), :func:`perturbed_weights` and
:func:`weight_buckets` (new weights to refit with), :func:`stop_string_prefix`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from posttrain.backend.hf_export import bucket_names
from posttrain.backend.sampling import sampling_logprobs
from posttrain.backend.weight_sync import GatheredWeights, ParamMeta
from posttrain.batch import Batch
from posttrain.interfaces.generation import Generation, RefitStats
from posttrain.interfaces.loss import LossFunction
from posttrain.interfaces.policy import Policy
from posttrain.run.refit import refit


@attrs.define
class GenerationContract:
    """Checks of ``generation`` against ``model`` (transformers, float32, the weights the
    backend started with, loaded from ``model_path``).

    The backend must have been configured with ``temperature``, ``max_new_tokens`` and
    ``stop_token_ids`` (plus the model's EOS ids, which ``eos_token_ids`` lists), no
    top-k/top-p, and must load the tokenizer for stop strings. Each check leaves the
    backend with its original weights.
    """

    generation: Generation
    model: Any
    model_path: str
    prompts: list[list[int]]
    temperature: float
    max_new_tokens: int
    stop_token_ids: list[int]
    eos_token_ids: list[int]
    pad_token_id: int = 0

    def transformers_greedy(self, model: Any = None) -> list[list[int]]:
        """transformers' own greedy ``generate`` of each prompt, alone (no padding)."""
        model = model or self.model
        stops = [*self.eos_token_ids, *self.stop_token_ids]
        return [
            model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=self.max_new_tokens,
                eos_token_id=stops, pad_token_id=self.pad_token_id,
            )[0, len(prompt) :].tolist()
            for prompt in self.prompts
        ]

    def check_greedy(self) -> None:
        """Greedy tokens equal transformers' greedy ``generate``; logprobs are those of the raw
        logits; a row ends at a stop token (not truncated) or after ``max_new_tokens`` (truncated)."""
        out = self.generation.generate(prompt_batch(self.prompts, pad_token_id=self.pad_token_id), greedy=True)
        check_output_layout(out, self.prompts, self.pad_token_id)
        tokens = generated_tokens(out, self.prompts)
        assert tokens == self.transformers_greedy()
        stops = {*self.eos_token_ids, *self.stop_token_ids}
        ended = [bool(row) and row[-1] in stops for row in tokens]
        assert any(ended) and not all(ended), "choose stop tokens so some rows stop and some are truncated"
        assert out["truncated"].tolist() == [not e and len(row) == self.max_new_tokens for e, row in zip(ended, tokens, strict=True)]
        assert all(e or len(row) == self.max_new_tokens for e, row in zip(ended, tokens, strict=True))
        mask = generated_mask(out, self.prompts)
        torch.testing.assert_close(out["logprobs"][mask], reference_logprobs(self.model, out, temperature=0)[mask], atol=1e-4, rtol=0)

    def check_refit(self, *, bucket_bytes: int, seed: int = 1, scale: float = 0.5) -> None:
        """After a refit to perturbed weights (streamed in buckets of ``bucket_bytes``), the
        sampled tokens' logprobs match a transformers forward of the new weights (mean of
        exp(|difference|) <= 1.01) and not of the old ones; refit reports every byte; a
        backend that reports ``weight_versions`` gives the refit's version on every row. A
        refit back restores the original greedy output."""
        from transformers import AutoModelForCausalLM

        new = perturbed_weights(self.model, seed=seed, scale=scale)
        changed = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        changed.load_state_dict(new)
        batch = prompt_batch(self.prompts, pad_token_id=self.pad_token_id)
        self.generation.generate(batch)  # leaves caches computed with the old weights
        stats = refit(ExportedWeights(new), self.generation, bucket_bytes, version=7)
        assert stats.bytes_moved == sum(t.numel() * t.element_size() for t in new.values())
        assert stats.num_tensors == len(new) and stats.num_buckets == len(list(weight_buckets(new, bucket_bytes)))
        assert stats.seconds > 0

        out = self.generation.generate(batch)
        check_output_layout(out, self.prompts, self.pad_token_id)
        if "weight_versions" in out:
            assert out["weight_versions"].tolist() == [7] * len(self.prompts), out["weight_versions"]
        mask = generated_mask(out, self.prompts)
        diff = (out["logprobs"] - reference_logprobs(changed, out, temperature=self.temperature))[mask]
        assert torch.exp(diff.abs()).mean() <= 1.01 and diff.abs().max() < 1e-3, f"max difference {diff.abs().max():.2e}"
        stale = (out["logprobs"] - reference_logprobs(self.model, out, temperature=self.temperature))[mask]
        assert torch.exp(stale.abs()).mean() > 1.01, "the old weights explain the samples: refit had no effect"

        refit(ExportedWeights(self.model.state_dict()), self.generation, 1 << 40)
        again = self.generation.generate(batch, greedy=True)
        assert generated_tokens(again, self.prompts) == self.transformers_greedy()

    def check_stop_strings(self, tokenizer: Any) -> None:
        """A row with a stop string ends with the token that completes its first occurrence
        in the generated text (not truncated); rows without a hit are unchanged."""
        free = generated_tokens(self.generation.generate(prompt_batch(self.prompts), greedy=True), self.prompts)
        texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in free]
        hits = [row for row, text in enumerate(texts) if len(text) >= 5][:2]
        assert hits, "no row generated text long enough to take a stop string from"
        stops: list[list[str] | None] = [None] * len(self.prompts)
        for row in hits:
            stops[row] = [texts[row][3:5]]
        misses = [row for row in range(len(self.prompts)) if row not in hits]
        for row in misses[:1]:
            stops[row] = ["never-generated"]
        out = self.generation.generate(prompt_batch(self.prompts, stop_strings=stops), greedy=True)
        check_output_layout(out, self.prompts, self.pad_token_id)
        tokens = generated_tokens(out, self.prompts)
        for row in range(len(self.prompts)):
            if row in hits:
                assert tokens[row] == stop_string_prefix(tokenizer, free[row], stops[row][0])
                assert not out["truncated"][row]
            else:
                assert tokens[row] == free[row]

    def check_colocated_cycle(self) -> None:
        """The colocated order of a step: ``finish_generation`` (release), refit while
        released, ``prepare_for_generation`` (wake, twice: idempotent); greedy output is then
        the new weights'. Restores the original weights."""
        from transformers import AutoModelForCausalLM

        new = perturbed_weights(self.model, seed=2, scale=0.5)
        changed = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        changed.load_state_dict(new)
        batch = prompt_batch(self.prompts, pad_token_id=self.pad_token_id)
        self.generation.finish_generation()
        refit(ExportedWeights(new), self.generation, 1 << 40)
        self.generation.prepare_for_generation()
        self.generation.prepare_for_generation()
        assert generated_tokens(self.generation.generate(batch, greedy=True), self.prompts) == self.transformers_greedy(changed)
        refit(ExportedWeights(self.model.state_dict()), self.generation, 1 << 40)

    def check_fresh_samples(self) -> None:
        """Two sampling calls on the same prompts draw different samples."""
        batch = prompt_batch(self.prompts, pad_token_id=self.pad_token_id)
        first, second = self.generation.generate(batch), self.generation.generate(batch)
        assert not torch.equal(first["output_ids"], second["output_ids"]), "two calls drew the same samples"


class NegativeLogLikelihood(LossFunction):
    """Mean negative logprob of the masked tokens (global token normalisation): a loss that
    moves a policy's weights in one step, for refit tests."""

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        mask = batch["token_mask"] * batch["sample_mask"][:, None]
        loss = -(logprobs * mask).sum() / global_valid_toks
        return loss, {"nll": float(loss.detach())}


def check_trained_policy_refit(policy: Policy, generation: Generation, prompts: list[list[int]], *, bucket_bytes: int,
                               steps: int = 1, max_difference: float | None = None,
                               mult_prob_error: float = 1.01) -> RefitStats:
    """Train ``policy`` ``steps`` steps on the backend's samples, refit, sample again: the
    backend's logprobs then match ``policy.get_logprobs`` (mean of exp(|difference|), GRPO's
    ``token_mult_prob_error``, at most ``mult_prob_error``; given ``max_difference``, every
    difference at most that too), and did not before the refit. Returns the refit's stats. The policy and the backend must have been built from the
    same ``generation.temperature`` (the policy's logprobs are those of ``logits / temperature``)."""
    for _ in range(steps):
        out = generation.generate(prompt_batch(prompts))
        mask = generated_mask(out, prompts)
        batch = Batch(
            input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"],
            token_mask=mask.float(), sample_mask=torch.ones(len(prompts)),
        )
        policy.train(batch, NegativeLogLikelihood())
    trained = policy.get_logprobs(batch)["logprobs"]
    assert torch.exp((out["logprobs"] - trained)[mask].abs()).mean() > 1.01, "training did not change the policy"

    stats = refit(policy, generation, bucket_bytes)
    assert stats.num_tensors > 0 and stats.bytes_moved > 0
    out = generation.generate(prompt_batch(prompts))
    mask = generated_mask(out, prompts)
    theirs = policy.get_logprobs(Batch(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]))
    diff = (out["logprobs"] - theirs["logprobs"])[mask]
    if max_difference is not None:
        assert float(diff.abs().max()) <= max_difference, f"max |difference| {diff.abs().max():.2e}"
    error = float(torch.exp(diff.abs()).mean())
    assert error <= mult_prob_error, f"token_mult_prob_error {error:.7f}, mean |difference| {diff.abs().mean():.2e}"
    return stats


class ExportedWeights:
    """Given weights behind the policy side of :func:`refit`: :meth:`send_weights` runs one
    sender rank in this process (a test stand-in for a policy's workers)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = dict(weights)

    def send_weights(self, endpoint: Any, bucket_bytes: int, version: int) -> RefitStats:
        metas = [ParamMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in self.weights.items()]
        source = GatheredWeights(metas, lambda names: {name: self.weights[name] for name in names})
        stats = endpoint.connect(source, rank=0, bucket_bytes=bucket_bytes).send(version)
        return stats.refit_stats()


def stop_token_for(model: Any, prompt: Sequence[int], *, position: int, eos_token_ids: Sequence[int]) -> int:
    """The token transformers' greedy decoding of ``prompt`` produces at ``position``: as a
    stop token, it ends that row there."""
    out = model.generate(torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=position + 1,
                         eos_token_id=list(eos_token_ids), pad_token_id=0)
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == position + 1, "greedy decoding hit EOS before the position"
    return tokens[position]


def prompt_batch(
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int = 0,
    stop_strings: Sequence[Sequence[str] | None] | None = None,
) -> Batch:
    """Right-padded ``input_ids`` and ``input_lengths`` (and per-row ``stop_strings``)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = torch.tensor(prompt)
    batch = Batch(input_ids=input_ids, input_lengths=torch.tensor([len(p) for p in prompts]))
    if stop_strings is not None:
        batch["stop_strings"] = [list(s) if s is not None else None for s in stop_strings]
    return batch


def generated_tokens(output: Batch, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each row's generated token ids, read from ``output_ids``."""
    return [
        output["output_ids"][row, len(p) : int(output["unpadded_sequence_lengths"][row])].tolist()
        for row, p in enumerate(prompts)
    ]


def check_output_layout(output: Batch, prompts: Sequence[Sequence[int]], pad_token_id: int) -> None:
    """Assert the output conventions of :mod:`posttrain.interfaces.generation`."""
    ids, logprobs = output["output_ids"], output["logprobs"]
    assert ids.dtype == torch.long and logprobs.dtype == torch.float32 and ids.shape == logprobs.shape
    assert output["truncated"].dtype == torch.bool
    if "weight_versions" in output:
        assert output["weight_versions"].dtype == torch.long and output["weight_versions"].shape == (len(prompts),)
    total = output["unpadded_sequence_lengths"]
    assert int(total.max()) == ids.shape[1], "output is wider than its longest row"
    for row, prompt in enumerate(prompts):
        end, generated = int(total[row]), int(output["generation_lengths"][row])
        assert end == len(prompt) + generated
        assert ids[row, : len(prompt)].tolist() == list(prompt), f"row {row}: prompt changed"
        assert (ids[row, end:] == pad_token_id).all(), f"row {row}: not right-padded with {pad_token_id}"
        assert (logprobs[row, : len(prompt)] == 0).all() and (logprobs[row, end:] == 0).all()
        assert (logprobs[row, len(prompt) : end] <= 0).all() and torch.isfinite(logprobs[row, len(prompt) : end]).all()


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, output: Batch, *, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """Logprobs [B, S] of each row's tokens under ``model`` (one forward pass per row,
    no padding), by :func:`posttrain.backend.sampling.sampling_logprobs`; 0 at position 0 and on padding."""
    ids = output["output_ids"]
    result = torch.zeros(ids.shape, dtype=torch.float32)
    for row, length in enumerate(output["unpadded_sequence_lengths"].tolist()):
        tokens = ids[row : row + 1, :length]
        logits = model(input_ids=tokens).logits[0, :-1]
        step = sampling_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        result[row, 1:length] = step.gather(-1, tokens[0, 1:, None])[:, 0]
    return result


def generated_mask(output: Batch, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Bool [B, S]: True at generated positions."""
    mask = torch.zeros(output["output_ids"].shape, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        mask[row, len(prompt) : int(output["unpadded_sequence_lengths"][row])] = True
    return mask


def perturbed_weights(model: torch.nn.Module, *, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """The model's state dict plus seeded Gaussian noise of std ``scale`` times each tensor's std."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
        spread = tensor.float().std() if tensor.numel() > 1 else torch.tensor(1.0)
        out[name] = tensor + scale * float(spread if spread > 0 else 1.0) * noise
    return out


def weight_buckets(weights: Mapping[str, torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Buckets of at most ``bucket_bytes`` (a larger tensor is its own bucket), in order."""
    sizes = [(name, tensor.numel() * tensor.element_size()) for name, tensor in weights.items()]
    for names in bucket_names(sizes, bucket_bytes):
        yield {name: weights[name] for name in names}


def stop_string_prefix(tokenizer, tokens: Sequence[int], stop: str) -> list[int] | None:
    """The shortest prefix of ``tokens`` whose text (special tokens skipped) contains
    ``stop``, decoding every prefix in full; None when there is none."""
    for end in range(1, len(tokens) + 1):
        if stop in tokenizer.decode(list(tokens[:end]), skip_special_tokens=True):
            return list(tokens[:end])
    return None
