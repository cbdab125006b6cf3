"""The two judges: a local model (:class:`ModelJudge`) and an OpenAI-compatible endpoint
(:class:`EndpointJudge`). Both take judge prompts (plain text, sent as one user message) and
return, per prompt, a :class:`Reply`: the reply's text, or the probability of each label as
its first token, or the reason it could not be had."""

from __future__ import annotations

import json
import math
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from posttrain.errors import ConfigError
from posttrain_env_judge.options import JudgeOptions

#: Alternatives asked of an endpoint for the reply's first token (verdict token_probability).
TOP_LOGPROBS = 20


@attrs.frozen
class Reply:
    """What the judge said to one prompt: ``text`` (its reply, with an endpoint's ``logprobs``
    object), ``probabilities`` (label -> probability as its first token), or ``failure``
    (``timeout`` or ``error``) with ``detail``."""

    text: str | None = None
    probabilities: dict[str, float] | None = None
    failure: str | None = None
    detail: str = ""
    logprobs: Any = None


class ModelJudge:
    """A causal LM from a local folder, in this process, float32 and greedy. The prompt is
    rendered with the tokenizer's chat template when it has one (a user message and the
    generation prompt), else used as it is."""

    def __init__(self, options: JudgeOptions):
        import torch
        from transformers import AutoModelForCausalLM

        from posttrain.data.chat import load_tokenizer

        self.options = options
        self.tokenizer = load_tokenizer(options.model)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32).eval()
        self.label_tokens = self._label_tokens() if options.verdict == "token_probability" else {}

    def _label_tokens(self) -> dict[str, int]:
        """Each label's first token (its reply would start with it); labels must not share one."""
        tokens = {label: self.tokenizer(label, add_special_tokens=False)["input_ids"][0] for label in self.options.labels}
        shared = len(set(tokens.values())) < len(tokens)
        if shared:
            raise ConfigError(
                f"environments.judge.labels: {', '.join(map(repr, tokens))} begin with the same token of the judge's "
                f"tokenizer ({tokens}); token_probability tells labels apart by their first token: choose labels "
                "that begin differently"
            )
        return tokens

    def render(self, prompt: str) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
        return prompt

    def ask(self, prompts: Sequence[str]) -> list[Reply]:
        replies: list[Reply] = []
        size = self.options.batch_size
        for start in range(0, len(prompts), size):
            chunk = [self.render(p) for p in prompts[start:start + size]]
            replies += self._probabilities(chunk) if self.label_tokens else self._generate(chunk)
        return replies

    def _encode(self, texts: Sequence[str]) -> Any:
        return self.tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)

    def _generate(self, texts: Sequence[str]) -> list[Reply]:
        import torch

        batch = self._encode(texts)
        with torch.no_grad():
            out = self.model.generate(**batch, do_sample=False, max_new_tokens=self.options.max_new_tokens,
                                      pad_token_id=self.tokenizer.pad_token_id)
        new = out[:, batch["input_ids"].shape[1]:]
        return [Reply(text=text) for text in self.tokenizer.batch_decode(new, skip_special_tokens=True)]

    def _probabilities(self, texts: Sequence[str]) -> list[Reply]:
        import torch

        batch = self._encode(texts)
        with torch.no_grad():
            logits = self.model(**batch).logits[:, -1].float()
        probs = torch.softmax(logits, dim=-1)
        return [Reply(probabilities={label: float(row[token]) for label, token in self.label_tokens.items()})
                for row in probs]


class EndpointJudge:
    """An OpenAI-compatible API (``/chat/completions``), ``batch_size`` requests at once, each
    sent again up to ``retries`` times after a timeout (``timeout_s``) or an error."""

    def __init__(self, options: JudgeOptions):
        self.options = options
        self.url = options.url.rstrip("/") + "/chat/completions"
        key = os.environ.get(options.api_key_var, "") if options.api_key_var else ""
        if options.api_key_var and not key:
            raise ConfigError(f"environments.judge.api_key_var: the environment variable {options.api_key_var} is "
                              "not set in the judge's process; export it before the run starts")
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def ask(self, prompts: Sequence[str]) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.options.batch_size) as pool:
            return list(pool.map(self._ask_one, prompts))

    def _ask_one(self, prompt: str) -> Reply:
        probabilities = self.options.verdict == "token_probability"
        body: dict[str, Any] = {
            "model": self.options.served_model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": 1 if probabilities else self.options.max_new_tokens,
            **({"logprobs": True, "top_logprobs": TOP_LOGPROBS} if probabilities else {}),
        }
        reply = Reply(failure="error")
        for _ in range(self.options.retries + 1):
            reply = self._post(body)
            if reply.failure is None:
                break
        if reply.failure is not None or not probabilities:
            return reply
        return self._label_probabilities(reply.logprobs)

    def _post(self, body: dict[str, Any]) -> Reply:
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout_s) as response:
                answer = json.loads(response.read())
            choice = answer["choices"][0]
        except TimeoutError as error:
            return Reply(failure="timeout", detail=str(error) or f"no answer within {self.options.timeout_s:g} s")
        except urllib.error.URLError as error:
            timed_out = isinstance(error.reason, TimeoutError | socket.timeout)
            return Reply(failure="timeout" if timed_out else "error", detail=str(error))
        except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
            return Reply(failure="error", detail=f"{type(error).__name__}: {error}")
        return Reply(text=choice["message"].get("content") or "", logprobs=choice.get("logprobs"))

    def _label_probabilities(self, logprobs: Any) -> Reply:
        """The labels' probabilities from the first token's ``top_logprobs`` (a token matches a
        label it begins, spaces and case aside); an answer without them is an error."""
        try:
            top = logprobs["content"][0]["top_logprobs"]
        except (TypeError, KeyError, IndexError):
            return Reply(failure="error", detail="the endpoint returned no top_logprobs for the first token; "
                                                 "token_probability needs them (or use verdict: label)")
        probabilities: dict[str, float] = {}
        for entry in top:
            token = str(entry["token"]).strip().lower()
            for label in self.options.labels:
                if token and label.lower().startswith(token):
                    probabilities[label] = probabilities.get(label, 0.0) + math.exp(float(entry["logprob"]))
        return Reply(probabilities=probabilities)
