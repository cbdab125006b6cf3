"""The ``judge`` environment: verdicts parsed from replies, a scripted OpenAI-compatible endpoint
(timeouts, errors, unparsable replies, the cache, top_logprobs), a local tiny model whose
verdicts equal a plain transformers forward's, and the options' errors."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.testing import EnvironmentCase, EnvironmentContract
from posttrain_env_judge.environment import OUTCOME_KEY, JudgeEnvironment
from posttrain_env_judge.options import JudgeOptions
from posttrain_env_judge.verdicts import label_verdict, number_verdict, probability_verdict

pytest_plugins = ["posttrain.testing.pytest_plugin"]

PROMPT = "Q: {question} R: {response} A: {reference}"


def log(response: str, question: str = "1+1=") -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": response}]


def test_verdicts_are_read_from_the_reply():
    assert number_verdict("I give it 7.5 / 10", 10) == 0.75
    assert number_verdict("Score: 12", 10) == 1.0 and number_verdict("-3", 10) == 0.0
    assert number_verdict("no score here", 10) is None
    labels = {"yes": 1.0, "no": 0.0, "partly": 0.5}
    assert label_verdict("No. Well, yes.", labels) == 0.0  # the first label word
    assert label_verdict("It is PARTLY right", labels) == 0.5
    assert label_verdict("nope, yesterday", labels) is None  # whole words only
    assert probability_verdict({"yes": 0.3, "no": 0.1}, {"yes": 1.0, "no": 0.0}) == pytest.approx(0.75)
    assert probability_verdict({}, {"yes": 1.0, "no": 0.0}) is None


# ----------------------------------------------------------------------------- a scripted endpoint


class Script:
    """What the endpoint answers to a judge prompt, by the response it quotes."""

    replies = {"good": "Score: 8 of 10", "vague": "I cannot tell.", "slow": None, "broken": None}

    def __init__(self):
        self.requests: Counter[str] = Counter()

    def answer(self, body: dict) -> tuple[int, dict]:
        prompt = body["messages"][0]["content"]
        response = prompt.split("R: ")[1].split(" A:")[0]
        self.requests[response] += 1
        if response == "slow":
            time.sleep(1.0)
        if response == "broken":
            return 500, {"error": "internal"}
        if body.get("logprobs"):
            top = [{"token": "Yes", "logprob": math.log(0.6)}, {"token": " no", "logprob": math.log(0.2)},
                   {"token": "maybe", "logprob": math.log(0.1)}]
            return 200, {"choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [{"top_logprobs": top}]}}]}
        return 200, {"choices": [{"message": {"content": self.replies[response]}}]}


@pytest.fixture
def endpoint() -> Iterator[tuple[str, Script]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the http.server name)
            assert self.path == "/v1/chat/completions"
            status, answer = script.answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1", script
    server.shutdown()
    server.server_close()


def test_endpoint_verdicts_failures_and_the_cache(endpoint):
    url, script = endpoint
    env = JudgeEnvironment(JudgeOptions(url=url, prompt=PROMPT, verdict="number", max_score=10, timeout_s=0.3,
                                        retries=1, batch_size=4))
    logs = [log("good"), log("vague"), log("slow"), log("broken")]
    result = env.step(logs, [{"answer": "2"}] * 4)
    assert result.rewards.tolist() == [pytest.approx(0.8), 0.0, 0.0, 0.0] and result.terminateds.all()
    outcomes = [meta[OUTCOME_KEY] for meta in result.metadata]
    assert outcomes == ["ok", "unparsable", "timeout", "error"]
    assert script.requests == {"good": 1, "vague": 1, "slow": 2, "broken": 2}  # each failure sent again once
    assert env.metrics(result.rewards, result.metadata) == {
        "mean_score": pytest.approx(0.2), "unparsable": 1.0, "request_timeouts": 1.0, "request_errors": 1.0,
        "cached": 0.0}

    again = env.step([log("good"), log("good"), log("vague")], [{"answer": "2"}] * 3)
    assert again.rewards.tolist() == [pytest.approx(0.8), pytest.approx(0.8), 0.0]
    assert [meta[OUTCOME_KEY] for meta in again.metadata] == ["cached", "cached", "unparsable"]
    assert script.requests["good"] == 1 and script.requests["vague"] == 1  # both judged once


def test_an_endpoints_first_token_probabilities_weigh_the_labels(endpoint):
    url, _ = endpoint
    env = JudgeEnvironment(JudgeOptions(url=url, prompt=PROMPT, verdict="token_probability"))
    result = env.step([log("good")], [{}])
    assert result.rewards.tolist() == [pytest.approx(0.6 / 0.8)]  # yes 0.6, no 0.2; "maybe" is no label


def test_a_key_variable_that_is_not_set_is_named(monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(ConfigError, match="the environment variable JUDGE_KEY is not set in the judge's process"):
        JudgeEnvironment(JudgeOptions(url="http://127.0.0.1:9/v1", api_key_var="JUDGE_KEY"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "set exactly one of model (a local model folder) and url (an OpenAI-compatible endpoint), found neither"),
        ({"model": "m", "url": "u"}, "found both"),
        ({"url": "u", "prompt": "{question} {answer}"},
         "prompt names {answer}; a judge prompt may name {question}, {response}, {reference}"),
        ({"url": "u", "verdict": "label", "labels": {}}, "verdict label needs at least one label"),
    ],
)
def test_options_are_checked(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        JudgeOptions(**options)


# ----------------------------------------------------------------------------- a local model


def reference_probabilities(model_path: str, texts: list[str], labels: list[str]) -> list[dict[str, float]]:
    """Each label's first-token probability after each rendered prompt, from a plain transformers forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            probs = torch.softmax(model(ids).logits[0, -1].float(), dim=-1)
        out.append({label: float(probs[tokenizer(label, add_special_tokens=False)["input_ids"][0]]) for label in labels})
    return out


def test_a_local_models_verdicts_equal_a_plain_forward(tiny_model_path):
    options = JudgeOptions(model=tiny_model_path, prompt=PROMPT, verdict="token_probability",
                           labels={"y": 1.0, "n": 0.0}, batch_size=2)
    env = JudgeEnvironment(options)
    logs, metadata = [log("2"), log("two, I think"), log("3")], [{"answer": "2"}, {"answer": "2"}, {}]
    result = env.step(logs, metadata)
    texts = [env.judge.render(env.prompt_of(entry, meta)) for entry, meta in zip(logs, metadata, strict=True)]
    expected = [probability_verdict(p, options.labels) for p in reference_probabilities(tiny_model_path, texts, ["y", "n"])]
    assert result.rewards.tolist() == pytest.approx(expected, abs=1e-6)  # left-padded batches of 2 and 1
    assert len(set(result.rewards.tolist())) == 3


def test_labels_that_begin_with_one_token_are_refused(tiny_model_path):
    with pytest.raises(ConfigError, match="token_probability tells labels apart by their first token"):
        JudgeEnvironment(JudgeOptions(model=tiny_model_path, verdict="token_probability", labels={"yes": 1.0, "yeah": 0.5}))


class TestJudgeContract(EnvironmentContract):
    """The conformance kit's contract, with the endpoint replaced by a local tiny model's
    label verdicts (its replies are random text: every one is unparsable, scored 0)."""

    name = "judge"

    @pytest.fixture(autouse=True)
    def _model(self, tiny_model_path):
        type(self).options = {"model": tiny_model_path, "verdict": "label", "max_new_tokens": 4}

    sample_inputs = EnvironmentCase(message_logs=[log("2"), log("3")], metadata=[{"answer": "2"}, {"answer": "2"}],
                                    expected_rewards=[0.0, 0.0])
