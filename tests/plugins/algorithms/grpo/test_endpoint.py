"""The chat-completions endpoint and agent rollouts, with an agent that knows only the openai
client (tests/e2e/openai_agent.py) and a scripted generation backend (no Ray): what the agent
received is exactly what trains, the token sequence is the template's rendering of the whole
episode (no re-tokenisation), only sampled tokens train, and failures are contained."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from posttrain.batch import Batch
from posttrain.models.tiny import TOOL_CHAT_TEMPLATES, build_tokenizer
from posttrain.testing.scripted import ScriptedGeneration
from posttrain_grpo.agents import load_agent, run_agent_rollout
from posttrain_grpo.endpoint import ChatEndpoint
from tests.e2e import openai_agent

TEMPLATE = TOOL_CHAT_TEMPLATES["hermes"]


def reply(prompt: str) -> str:
    """Call the calculator first; once a tool answered, say the last result."""
    if "<tool_response>" in prompt:
        return "It is " + prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0] + "."
    question = prompt.rsplit("<|user|>", 1)[1].split("=?")[0]
    return f'Let me compute. <tool_call>{{"name": "calculator", "arguments": {{"expression": "{question}"}}}}</tool_call>'


@pytest.fixture
def endpoint():
    tokenizer = build_tokenizer()
    served = ChatEndpoint(ScriptedGeneration(tokenizer, reply, version=3), tokenizer, chat_template=TEMPLATE,
                          max_total_length=1024, tool_call_format="hermes")
    yield served
    served.shutdown()


def problems(count: int, record=None) -> Batch:
    pairs = [(1000 + 7 * i, 2000 + 11 * i) for i in range(count)]
    return Batch(
        messages=[[{"role": "user", "content": f"{a}+{b}=?"}] for a, b in pairs],
        metadata=[{"record": str(record)} if record else {} for _ in pairs],
        answer=[str(a + b) for a, b in pairs],
    )


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_an_outside_agent_trains_exactly_what_the_engines_sampled(endpoint, tmp_path):
    record = tmp_path / "record.jsonl"
    batch, metrics = run_agent_rollout(problems(3, record), endpoint, openai_agent.solve, max_concurrency=3, timeout_s=60)

    assert batch["rewards"].tolist() == [1.0, 1.0, 1.0]  # the tool call, the agent's own calculator, the answer
    assert metrics["agent/mean_requests"] == 2.0 and metrics["agent/errors"] == 0.0
    tokenizer = endpoint.chat.tokenizer
    episodes = {json.loads(line)["messages"][0]["content"]: json.loads(line) for line in record.read_text().splitlines()}
    for i in range(3):
        episode = episodes[batch["messages"][i][0]["content"]]
        n = int(batch["input_lengths"][i])
        ids = batch["input_ids"][i, :n].tolist()
        # The sequence is the template's own rendering of the whole episode, tool call and tool reply included.
        plain = [{"role": m["role"], "content": _text(m)} for m in episode["messages"]]
        rendered = tokenizer.apply_chat_template(plain, tools=[openai_agent.CALCULATOR], chat_template=TEMPLATE,
                                                 return_dict=True, return_assistant_tokens_mask=True)
        assert ids == rendered["input_ids"]
        assert batch["token_mask"][i, :n].tolist() == [float(m) for m in rendered["assistant_masks"]]
        # What the agent received per request is exactly what trains.
        for request in episode["requests"]:
            prompt, sampled = request["prompt_token_ids"], request["token_ids"]
            assert ids[: len(prompt)] == prompt and ids[len(prompt) : len(prompt) + len(sampled)] == sampled
            logprobs = batch["generation_logprobs"][i, len(prompt) : len(prompt) + len(sampled)].tolist()
            assert logprobs == pytest.approx(request["logprobs"], abs=0, rel=1e-7)
        assert (batch["generation_versions"][i, :n][batch["token_mask"][i, :n] > 0] == 3).all()
    assert episode["messages"][1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "1014+2022"}'}


def _text(message: dict) -> str:
    return message.get("content") or "" if message["role"] != "assistant" else _assistant_text(message)


def _assistant_text(message: dict) -> str:
    """The assistant's raw text as the model wrote it (the endpoint split it into content and tool_calls)."""
    calls = "".join(f'<tool_call>{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}</tool_call>'
                    for c in message.get("tool_calls", []))
    content = message.get("content") or ""
    return f"{content} {calls}" if content and calls else content + calls


def test_failing_and_late_agents_are_left_out_and_their_sessions_end(endpoint):
    batch, metrics = run_agent_rollout(problems(2), endpoint, openai_agent.fails, max_concurrency=2, timeout_s=60)
    assert batch["rewards"].tolist() == [0.0, 0.0] and metrics["agent/errors"] == 2.0
    assert batch["failed"].tolist() == [True, True]  # no reward: left out of the loss, not trained as 0
    assert batch["token_mask"].sum() == 0  # nothing was generated: nothing trains

    batch, metrics = run_agent_rollout(problems(1), endpoint, openai_agent.dawdles, max_concurrency=1, timeout_s=1)
    assert metrics["agent/timeouts"] == 1.0 and batch["failed"].tolist() == [True]


def test_requests_the_endpoint_refuses(endpoint):
    session = endpoint.open()
    url = endpoint.base_url(session) + "/chat/completions"
    question = [{"role": "user", "content": "1+2=?"}]
    status, first = post(url, {"messages": question})
    assert status == 200 and first["choices"][0]["finish_reason"] == "tool_calls"
    status, error = post(url, {"messages": [{"role": "user", "content": "something else"}]})
    assert status == 400 and error["error"]["message"] == (
        "this session's conversation so far has 2 messages, and a request must repeat them before adding new ones; "
        "message 0 differs from it (or is missing). Start a new session for another conversation"
    )
    endpoint.end(session, "its rollout finished")
    status, error = post(url, {"messages": question})
    assert (status, error["error"]["type"]) == (410, "session_ended")
    assert error["error"]["message"] == f"session '{session.id}' has ended: its rollout finished"
    status, error = post(endpoint.address + "/sessions/nope/v1/chat/completions", {"messages": question})
    assert status == 404 and error["error"]["message"] == "no session 'nope' on this endpoint"
    with urllib.request.urlopen(endpoint.base_url(endpoint.open()) + "/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == "posttrain-policy"


def test_max_tokens_cuts_the_sample_where_the_agent_saw_it_end(endpoint):
    session = endpoint.open()
    status, body = post(endpoint.base_url(session) + "/chat/completions",
                        {"messages": [{"role": "user", "content": "1+2=?"}], "max_tokens": 5, "logprobs": True})
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length" and choice["message"]["content"] == "Let m"
    assert len(choice["token_ids"]) == 5 and len(choice["logprobs"]["content"]) == 5
    conversation = session.conversation
    assert conversation.token_ids == choice["prompt_token_ids"] + choice["token_ids"]
    assert sum(conversation.mask) == 5


def test_an_agent_is_named_by_its_module_and_function():
    assert load_agent("tests.e2e.openai_agent:solve", "grpo.agent.entry") is openai_agent.solve
    with pytest.raises(Exception, match=r"grpo.agent.entry: cannot load the agent 'tests.e2e.openai_agent:solves' "):
        load_agent("tests.e2e.openai_agent:solves", "grpo.agent.entry")
