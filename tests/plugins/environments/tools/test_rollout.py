"""Tool-calling episodes through core's rollout, for the tiny model's two tool chat templates
(hermes and llama3_json formats): the trained token sequence is exactly the prompt (with
the tools rendered by the template), the sampled tokens and the tool replies, in order;
only sampled tokens train; failing calls are contained and counted.

Generation is scripted (the untrained model writes no tool calls): each case's turns say
the given texts, ended by the EOS token the template closes an assistant turn with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from posttrain.batch import Batch
from posttrain.models.tiny import TOOL_CHAT_TEMPLATES, build_tokenizer
from posttrain.run.rollout import run_rollout
from posttrain.testing.scripted import ScriptedGeneration, scripted_logprob
from posttrain_env_tools.environment import ToolsEnvironment
from posttrain_env_tools.options import ToolsOptions

REPO = Path(__file__).resolve().parents[4]
FUNCTIONS = "tests.plugins.environments.tools.tool_functions"


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
    script = [  # per case, what each assistant turn says
        [tool_call(fmt, "calculator", expression="12345+67890"), "The answer is 80235."],
        [malformed, "80235"],
        [tool_call(fmt, "hang", seconds=30), "I give up."],
        ["80235"],
    ]

    def reply(prompt: str) -> str:
        case = int(prompt.split("case ")[1][0])
        return script[case][prompt.count("<|assistant|>") - 1]

    env = ToolsEnvironment(ToolsOptions(tools=["calculator", f"{FUNCTIONS}:hang"], format=fmt, tool_timeout_s=1.0))
    questions = [[{"role": "system", "content": "Use tools."}, {"role": "user", "content": f"case {i}: 12345+67890=?"}]
                 for i in range(4)]
    samples = Batch(messages=questions, task=["tools"] * 4, metadata=[{"answer": "80235"}] * 4)
    try:
        batch, metrics = run_rollout(samples, ScriptedGeneration(tokenizer, reply), {"tools": env}, tokenizer,
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
        sampled = batch["token_mask"][i, :n] > 0
        expected = [scripted_logprob(t) for t in batch["input_ids"][i, :n][sampled].tolist()]
        assert batch["generation_logprobs"][i, :n][sampled].tolist() == expected
    replies = [[m["content"] for m in batch["messages"][i] if m["role"] == "tool"] for i in range(3)]
    assert replies[0] == ["80235"]
    assert replies[1][0].startswith("error: malformed tool call: ")
    assert replies[2] == ["error: hang did not finish within 1 s"]
    assert metrics["env/tools/tool_timeouts"] == 0.25 and metrics["env/tools/malformed_calls"] == 0.25
    assert metrics["env/tools/accuracy"] == 0.75
