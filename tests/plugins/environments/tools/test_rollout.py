"""Tool-calling episodes through core's rollout, for the tiny model's two tool chat templates
(hermes and llama3_json formats): the trained token sequence is exactly the prompt (with
the tools rendered by the template), the sampled tokens and the tool replies, in order;
only sampled tokens train; failing calls are contained and counted.

Generation is scripted (the untrained model writes no tool calls): each call returns the
given texts, tokenized, ended by the EOS token the template closes an assistant turn with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from posttrain.batch import Batch
from posttrain.interfaces import Generation
from posttrain.models.tiny import TOOL_CHAT_TEMPLATES, build_tokenizer
from posttrain.run.rollout import run_rollout
from posttrain_env_tools.environment import ToolsEnvironment
from posttrain_env_tools.options import ToolsOptions

REPO = Path(__file__).resolve().parents[4]
FUNCTIONS = "tests.plugins.environments.tools.tool_functions"


class ScriptedGeneration(Generation):
    """Row r of the n-th ``generate`` call samples ``turns[n][r]`` (then EOS), logprob -0.25 per token."""

    def __init__(self, tokenizer, turns: list[list[str]]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, 0

    def generate(self, batch: Batch, *, greedy: bool = False) -> Batch:
        texts = self.turns[self.calls]
        self.calls += 1
        rows = []
        for i, text in enumerate(texts):
            prompt = batch["input_ids"][i, : int(batch["input_lengths"][i])].tolist()
            rows.append((prompt, self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]))
        width = max(len(p) + len(g) for p, g in rows)
        out = torch.zeros(len(rows), width, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width)
        for i, (prompt, generated) in enumerate(rows):
            out[i, : len(prompt) + len(generated)] = torch.tensor(prompt + generated)
            logprobs[i, len(prompt) : len(prompt) + len(generated)] = -0.25
        return Batch(output_ids=out, logprobs=logprobs, generation_lengths=torch.tensor([len(g) for _, g in rows]),
                     unpadded_sequence_lengths=torch.tensor([len(p) + len(g) for p, g in rows]),
                     truncated=torch.zeros(len(rows), dtype=torch.bool))

    def weight_endpoint(self):
        raise NotImplementedError("a scripted generator takes no weights")

    def shutdown(self) -> None:
        pass


def tool_call(fmt: str, name: str, **arguments) -> str:
    if fmt == "hermes":
        return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
    return json.dumps({"name": name, "parameters": arguments})


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_tool_episodes_train_exactly_the_sampled_tokens_between_prompt_and_tool_replies(fmt, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    tokenizer = build_tokenizer()
    template = TOOL_CHAT_TEMPLATES[fmt]
    malformed = "<tool_call>{</tool_call>" if fmt == "hermes" else '{"name": "calculator", "parameters": '
    turns = [
        [tool_call(fmt, "calculator", expression="12345+67890"), malformed, tool_call(fmt, "hang", seconds=30),
         "80235"],
        ["The answer is 80235.", "80235", "I give up."],
    ]
    env = ToolsEnvironment(ToolsOptions(tools=["calculator", f"{FUNCTIONS}:hang"], format=fmt, tool_timeout_s=1.0))
    question = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "12345+67890=?"}]
    samples = Batch(messages=[question] * 4, task=["tools"] * 4, metadata=[{"answer": "80235"}] * 4)
    try:
        batch, metrics = run_rollout(samples, ScriptedGeneration(tokenizer, turns), {"tools": env}, tokenizer,
                                     max_total_length=1024, max_turns=3, chat_template=template)
    finally:
        env.shutdown()

    assert batch["turns"].tolist() == [2, 2, 2, 1]
    assert batch["rewards"].tolist() == [1.0, 1.0, 0.0, 1.0]  # a malformed call got feedback, not a crash
    tools = env.tool_schemas()
    for i in range(4):
        log = [{"role": m["role"], "content": m["content"]} for m in batch["messages"][i]]
        n = int(batch["input_lengths"][i])
        rendered = tokenizer.apply_chat_template(log, tools=tools, chat_template=template, tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True)
        # the whole sequence is the template's rendering of the episode, tools and tool replies included
        assert batch["input_ids"][i, :n].tolist() == rendered["input_ids"]
        # only the sampled tokens (each assistant turn's text and its EOS) train
        assert batch["token_mask"][i, :n].tolist() == [float(m) for m in rendered["assistant_masks"]]
        assert batch["generation_logprobs"][i, :n][batch["token_mask"][i, :n] > 0].eq(-0.25).all()
    replies = [[m["content"] for m in batch["messages"][i] if m["role"] == "tool"] for i in range(3)]
    assert replies[0] == ["80235"]
    assert replies[1][0].startswith("error: malformed tool call: ")
    assert replies[2] == ["error: hang did not finish within 1 s"]
    assert metrics["env/tools/tool_timeouts"] == 0.25 and metrics["env/tools/malformed_calls"] == 0.25
    assert metrics["env/tools/accuracy"] == 0.75
