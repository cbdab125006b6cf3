"""Rollouts driven by agents written outside posttrain, through the chat-completions endpoint.

An *agent* is a function ``agent(task, base_url) -> reward``: ``task`` is a data row's
``messages`` and ``metadata`` (plain JSON values), ``base_url`` the OpenAI-compatible
endpoint of its own session (:mod:`posttrain_grpo.endpoint`). It talks to the policy with any
OpenAI client (tools included), does whatever its harness does between calls, and returns
its reward (a number). It is named in the config as ``"package.module:function"`` and needs
no posttrain import.

:func:`run_agent_rollout` runs one agent per sample, at most ``max_concurrency`` at once in
threads of this process, each within ``timeout_s`` seconds of its start. A sample's training
data is its session's token sequence, exactly as the engines saw and sampled it; its reward
is what the agent returned. An agent that raises, returns something that is not a number,
or passes its deadline scores 0 and is counted (``agent/errors``, ``agent/timeouts``); its
session ends, so its later requests get HTTP 410. A sample whose agent never called the
endpoint trains nothing (its prompt alone, rendered from the task's messages).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from posttrain.batch import Batch
from posttrain.errors import ConfigError
from posttrain.log import get_logger
from posttrain.run.rollout import Conversation, rollout_metrics, training_batch
from posttrain_grpo.endpoint import ChatEndpoint, Session

Agent = Callable[[dict[str, Any], str], float]
_log = get_logger(__name__)


def load_agent(entry: str, key: str) -> Agent:
    """The agent function ``entry`` (``"package.module:function"``) names; ``key`` is the
    config key that set it, for the error."""
    module, sep, name = entry.partition(":")
    try:
        if not sep:
            raise ValueError("expected 'package.module:function'")
        agent = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"{key}: cannot load the agent '{entry}' ({type(error).__name__}: {error})") from None
    if not callable(agent):
        raise ConfigError(f"{key}: '{entry}' is a {type(agent).__name__}, not a function")
    return agent


@attrs.frozen
class AgentRollout:
    """A rollout of prompt batches (``messages``, ``metadata``, ``answer``) by ``agent``
    through ``endpoint``: each prompt ``repeats`` times in a row, one episode each
    (:func:`run_agent_rollout`); argmax completions when ``greedy`` (validation)."""

    endpoint: ChatEndpoint
    agent: Agent
    max_concurrency: int
    timeout_s: float

    def __call__(self, prompts: Batch, *, greedy: bool, repeats: int) -> tuple[Batch, dict[str, float]]:
        samples = prompts.fields([name for name in ("messages", "metadata", "answer") if name in prompts])
        return run_agent_rollout(samples.repeat_interleave(repeats), self.endpoint, self.agent,
                                 max_concurrency=self.max_concurrency, timeout_s=self.timeout_s, greedy=greedy)


def run_agent_rollout(
    samples: Mapping[str, Sequence[Any]],
    endpoint: ChatEndpoint,
    agent: Agent,
    *,
    max_concurrency: int,
    timeout_s: float,
    greedy: bool = False,
) -> tuple[Batch, dict[str, float]]:
    """One agent episode per sample of ``samples`` (``messages``, optional ``metadata`` and
    ``answer``); return the training batch (the layout of
    :func:`~posttrain.run.rollout.run_rollout`, ``task`` "agent") and its metrics: the
    ``rollout/*`` ones, ``agent/errors`` and ``agent/timeouts`` (samples) and
    ``agent/mean_requests`` (per sample). A sample whose agent raised, returned no finite
    reward or passed its deadline has no reward: it is marked ``failed`` (left out of the
    loss and the reward metrics, as a sample an environment could not score)."""
    messages = list(samples["messages"])
    metadata = list(samples["metadata"]) if "metadata" in samples else [{} for _ in messages]
    answers = list(samples["answer"]) if "answer" in samples else [None] * len(messages)
    tasks = [
        {"messages": [{"role": m["role"], "content": m["content"]} for m in log],
         "metadata": {**(meta or {}), **({"answer": answer} if answer is not None and "answer" not in (meta or {}) else {})}}
        for log, meta, answer in zip(messages, metadata, answers, strict=True)
    ]
    sessions = [endpoint.open(greedy=greedy) for _ in tasks]
    rewards, failures, errors, timeouts = _run_agents(agent, tasks, sessions, endpoint, max_concurrency, timeout_s)
    conversations = [_finished(session, task, endpoint) for session, task in zip(sessions, tasks, strict=True)]
    for i, (conversation, reward) in enumerate(zip(conversations, rewards, strict=True)):
        conversation.reward, conversation.failed = reward, failures.get(i)
    with_versions = all(v >= 0 for c in conversations for v, m in zip(c.versions, c.mask, strict=True) if m)
    batch = training_batch(conversations, endpoint.chat.pad_token_id, with_versions=with_versions)
    metrics = rollout_metrics(batch)
    metrics.update({
        "agent/errors": float(errors), "agent/timeouts": float(timeouts),
        "agent/mean_requests": sum(s.requests for s in sessions) / max(1, len(sessions)),
    })
    return batch, metrics


def _run_agents(
    agent: Agent, tasks: list[dict[str, Any]], sessions: list[Session], endpoint: ChatEndpoint,
    max_concurrency: int, timeout_s: float,
) -> tuple[list[float], dict[int, str], int, int]:
    """Run every agent; its reward (0 for one that failed), why each failed one failed (by
    sample), and the counts of errors and timeouts."""
    started: dict[int, float] = {}
    lock = threading.Lock()

    def episode(i: int) -> float:
        with lock:
            started[i] = time.monotonic()
        return agent(tasks[i], endpoint.base_url(sessions[i]))

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="posttrain-agent")
    futures = {pool.submit(episode, i): i for i in range(len(tasks))}
    rewards, errors, timeouts = [0.0] * len(tasks), 0, 0
    failures: dict[int, str] = {}
    pending = set(futures)
    try:
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                i = futures[future]
                endpoint.end(sessions[i], "its agent returned")
                try:
                    reward = float(future.result())
                    if not math.isfinite(reward):
                        raise ValueError(f"reward {reward}")
                    rewards[i] = reward
                except Exception as error:  # contained: this sample is left out
                    errors += 1
                    failures[i] = f"{type(error).__name__}: {error}"
                    _log.warning("agent failed", sample=i, error=failures[i])
            now = time.monotonic()
            with lock:
                late = [f for f in pending if futures[f] in started and now - started[futures[f]] > timeout_s]
            for future in late:
                i = futures[future]
                endpoint.end(sessions[i], f"its agent passed its deadline of {timeout_s:g} s (grpo.agent.timeout_s)")
                timeouts += 1
                failures[i] = f"its agent passed its deadline of {timeout_s:g} s (grpo.agent.timeout_s)"
                pending.discard(future)
                _log.warning("agent timed out", sample=i, timeout_s=timeout_s)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return rewards, failures, errors, timeouts


def _finished(session: Session, task: dict[str, Any], endpoint: ChatEndpoint) -> Conversation:
    """The sample of a session: its conversation, or the task's prompt alone when its agent
    never called the endpoint."""
    endpoint.end(session, "its rollout finished")
    with session.lock:
        conversation = session.conversation
    if conversation is None:
        prompt = endpoint.chat.prompt_ids(task["messages"])
        conversation = Conversation(list(task["messages"]), "agent", task["metadata"], prompt, prompt_length=len(prompt))
    else:
        conversation.metadata = task["metadata"]
        conversation.done = True
    return conversation

