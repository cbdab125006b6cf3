"""Reference computations for testing a generation backend against plain transformers.

A backend's tests build prompts with :func:`prompt_batch`, check the output conventions
with :func:`check_output_layout`, and compare the reported logprobs with
:func:`reference_logprobs` (a direct forward pass). :func:`perturbed_weights` and
:func:`weight_buckets` give new weights to refit with.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from posttrain.batch import Batch
from posttrain.sampling import sampling_logprobs


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
    no padding), by :func:`posttrain.sampling.sampling_logprobs`; 0 at position 0 and on padding."""
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
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


def stop_string_prefix(tokenizer, tokens: Sequence[int], stop: str) -> list[int] | None:
    """The shortest prefix of ``tokens`` whose text (special tokens skipped) contains
    ``stop``, decoding every prefix in full; None when there is none."""
    for end in range(1, len(tokens) + 1):
        if stop in tokenizer.decode(list(tokens[:end]), skip_special_tokens=True):
            return list(tokens[:end])
    return None
