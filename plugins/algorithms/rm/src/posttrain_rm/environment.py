"""The ``reward_model`` environment: a trained reward model scores each conversation.

Options (``environments.reward_model``, :class:`~posttrain_rm.config.RewardModelOptions`):
``model`` (a Hugging Face sequence-classification folder with one label, e.g. what
``posttrain run rm`` exported), ``tokenizer``, ``chat_template`` and ``batch_size``.

The model runs in the environment's own Ray actor, on its CPU (core starts one actor per
environment), in eval mode and float32. Each conversation (the prompt and the policy's
turns, ``role`` and ``content``) is encoded as the ``rm`` algorithm encodes its preference
rows (core's chat encoder with the same template), so the reward is exactly the score the
trained model gave such a sequence: the model's output at the last token. Single turn: the
reward is that score; every episode ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain.data.chat import ChatEncoder, load_tokenizer, read_chat_template
from posttrain.errors import ConfigError
from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain_rm.config import RewardModelOptions


class RewardModelEnvironment(Environment):
    def __init__(self, options: RewardModelOptions):
        from transformers import AutoModelForSequenceClassification

        self.options = options
        tokenizer = load_tokenizer(options.tokenizer or options.model)
        template = read_chat_template(options.chat_template) if options.chat_template else None
        self.encoder = ChatEncoder(tokenizer, template)
        self.model = AutoModelForSequenceClassification.from_pretrained(options.model, dtype=torch.float32).eval()
        if self.model.config.num_labels != 1:
            raise ConfigError(
                f"environments.reward_model.model: '{options.model}' has {self.model.config.num_labels} labels; a reward "
                "model has one (the folder posttrain run rm exports)"
            )
        if self.model.config.pad_token_id is None:
            raise ConfigError(
                f"environments.reward_model.model: config.json of '{options.model}' has no pad_token_id, which the "
                "sequence classifier needs to find each sequence's last token; set it to the tokenizer's pad id "
                f"({tokenizer.pad_token_id})"
            )

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        sequences = [self.encoder.encode([{"role": m["role"], "content": m["content"]} for m in log]).input_ids
                     for log in message_logs]
        rewards = torch.cat([self.score(sequences[i:i + self.options.batch_size])
                             for i in range(0, len(sequences), self.options.batch_size)])
        return EnvironmentReturn.final(rewards, metadata)

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """The model's score of each token sequence (float32 [n])."""
        pad = self.model.config.pad_token_id
        width = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, ids in enumerate(sequences):
            input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, :len(ids)] = 1
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        """``mean_score``, ``min_score`` and ``max_score`` of the batch."""
        if not len(rewards):
            return {}
        return {"mean_score": float(rewards.mean()), "min_score": float(rewards.min()), "max_score": float(rewards.max())}
