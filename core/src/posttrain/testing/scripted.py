"""A generation backend that answers from a script, for testing what happens around
generation (multi-turn and tool-calling rollouts, the chat-completions endpoint) without a
model that has learned to say the right thing.

:class:`ScriptedGeneration` decodes each row's prompt (special tokens kept) and samples the
tokens of ``reply(prompt_text)``, then EOS, each with a logprob that depends on the token
(``-(id % 7 + 1) / 8``) so that a test can see logprobs travel unchanged; it reports the
weight version it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.batch import Batch
from posttrain.interfaces import Generation


def scripted_logprob(token_id: int) -> float:
    """The logprob :class:`ScriptedGeneration` gives a sampled token."""
    return -((token_id % 7) + 1) / 8


class ScriptedGeneration(Generation):
    """``reply(prompt_text)`` for every row of every call (see the module docstring); the
    prompts of every call are kept in :attr:`calls`."""

    def __init__(self, tokenizer: Any, reply: Callable[[str], str], version: int = 0):
        self.tokenizer, self.reply, self.version = tokenizer, reply, version
        self.calls: list[list[str]] = []

    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        prompts = [batch["input_ids"][i, : int(batch["input_lengths"][i])].tolist() for i in range(len(batch))]
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.calls.append(texts)
        generated = [self.tokenizer(self.reply(t), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                     for t in texts]
        width = max(len(p) + len(g) for p, g in zip(prompts, generated, strict=True))
        output_ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(prompts), width)
        for i, (prompt, tokens) in enumerate(zip(prompts, generated, strict=True)):
            output_ids[i, : len(prompt) + len(tokens)] = torch.tensor(prompt + tokens)
            logprobs[i, len(prompt) : len(prompt) + len(tokens)] = torch.tensor([scripted_logprob(t) for t in tokens])
        return Batch(
            output_ids=output_ids, logprobs=logprobs,
            generation_lengths=torch.tensor([len(g) for g in generated]),
            unpadded_sequence_lengths=torch.tensor([len(p) + len(g) for p, g in zip(prompts, generated, strict=True)]),
            truncated=torch.zeros(len(prompts), dtype=torch.bool),
            weight_versions=torch.full((len(prompts),), self.version, dtype=torch.long),
        )

    def weight_endpoint(self) -> Any:
        raise NotImplementedError("a scripted generation backend takes no weights")

    def shutdown(self) -> None:
        pass
