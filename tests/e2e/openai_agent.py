"""An agent written only against the ``openai`` client (no posttrain import), as an outside
harness would be: it offers a calculator, runs the calls the model makes itself, answers
with the model's last message, and rewards an answer that contains the expected number.

With ``record`` in the task's metadata, it appends one JSON line per episode: per request,
the prompt token ids, sampled token ids and logprobs the endpoint returned.
"""

from __future__ import annotations

import ast
import json
import operator

from openai import OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _arithmetic(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    raise ValueError("not arithmetic")


def solve(task: dict, base_url: str) -> float:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(task["messages"])
    requests = []
    for _ in range(3):
        response = client.chat.completions.create(model="posttrain-policy", messages=messages, tools=[CALCULATOR],
                                                  logprobs=True)
        choice = response.choices[0]
        requests.append({"prompt_token_ids": choice.prompt_token_ids, "token_ids": choice.token_ids,
                         "logprobs": [t.logprob for t in choice.logprobs.content]})
        message = choice.message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = str(_arithmetic(ast.parse(json.loads(call.function.arguments)["expression"], mode="eval").body))
            except (ValueError, KeyError, SyntaxError) as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if "record" in task["metadata"]:
        with open(task["metadata"]["record"], "a") as f:
            f.write(json.dumps({"messages": messages, "requests": requests}) + "\n")
    answer = messages[-1].get("content") or ""
    return float(str(task["metadata"]["answer"]) in answer)


def fails(task: dict, base_url: str) -> float:
    raise RuntimeError("the harness crashed")


def dawdles(task: dict, base_url: str) -> float:
    import time

    time.sleep(3)
    return solve(task, base_url)
