"""The ``tools`` environment: episodes in which the model may call tools before it answers.

Each step looks at every sample's last assistant message:

- it calls tools (in ``format``): each call runs in a worker process with a deadline of
  ``tool_timeout_s`` (:class:`~posttrain.deadline_pool.DeadlinePool`) and the
  results, one line per call in order, come back as one ``tool`` message; the episode goes
  on. A call to a tool that does not exist, a call that raises and a call past its deadline
  are answered with an ``error: ...`` line and counted;
- the call cannot be read: with ``malformed_call: feedback`` the reply says what is wrong
  and the episode goes on; with ``end`` the episode ends with reward 0;
- it calls nothing: it is the answer, scored by the ``reward`` environment (built here,
  in this process, with ``reward_options``), and the episode ends;
- calling past ``max_tool_calls`` ends the episode with reward 0.

An episode's counts travel in its metadata under ``"tools"``; :meth:`ToolsEnvironment.metrics`
reports them per episode next to the reward environment's own metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain.data.tool_calls import FORMATS, MalformedToolCall, ToolCall
from posttrain.deadline_pool import DeadlinePool
from posttrain.interfaces import Environment, EnvironmentReturn, Message
from posttrain.plugins import plugin_host
from posttrain_env_tools.invoke import invoke
from posttrain_env_tools.options import ToolsOptions
from posttrain_env_tools.tool import Tool, resolve_tool

#: The per-episode counts kept in metadata["tools"] and reported by metrics().
COUNTS = ("tool_calls", "malformed_calls", "unknown_tool_calls", "tool_errors", "tool_timeouts", "over_budget")


class ToolsEnvironment(Environment):
    """See the module docstring; options in :class:`~posttrain_env_tools.options.ToolsOptions`."""

    def __init__(self, options: ToolsOptions):
        self.options = options
        self.parse = FORMATS[options.format]
        tools = [resolve_tool(reference, options.schemas.get(reference)) for reference in options.tools]
        self.tools: dict[str, Tool] = {tool.name: tool for tool in tools}
        self.reward = plugin_host().environments[options.reward](dict(options.reward_options))
        self.pool = DeadlinePool(invoke, num_workers=options.num_workers, timeout_s=options.tool_timeout_s)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self.tools.values()]

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> EnvironmentReturn:
        n = len(message_logs)
        meta = [{**(m or {}), "tools": dict.fromkeys(COUNTS, 0) | dict((m or {}).get("tools", {}))} for m in metadata]
        replies: list[list[str] | None] = [None] * n  # per sample: one line per call, or None (answered / ended)
        rewards, ended, answers = torch.zeros(n), torch.zeros(n, dtype=torch.bool), []
        jobs: list[tuple[int, int, ToolCall]] = []  # (sample, line, call) of the calls to run
        for i, log in enumerate(message_logs):
            counts = meta[i]["tools"]
            try:
                calls = self.parse(_last_assistant(log))
            except MalformedToolCall as error:
                counts["malformed_calls"] += 1
                if self.options.malformed_call == "end":
                    ended[i] = True
                else:
                    replies[i] = [f"error: malformed tool call: {error}"]
                continue
            if not calls:
                answers.append(i)
                continue
            counts["tool_calls"] += len(calls)
            if counts["tool_calls"] > self.options.max_tool_calls:
                counts["over_budget"] += 1
                ended[i] = True
                continue
            replies[i] = [self._refusal(call, counts) for call in calls]
            jobs += [(i, k, call) for k, call in enumerate(calls) if call.name in self.tools]
        self._run(jobs, replies, meta)
        if answers:
            scored = self.reward.step([message_logs[i] for i in answers], [meta[i] for i in answers])
            for k, i in enumerate(answers):
                rewards[i], meta[i] = scored.rewards[k], {**scored.metadata[k], "tools": meta[i]["tools"]}
        done = torch.tensor([r is None for r in replies])
        return EnvironmentReturn(
            observations=[{"role": "tool", "content": "\n".join(r) if r else ""} for r in replies],
            metadata=meta,
            next_stop_strings=[None] * n,
            rewards=rewards,
            terminateds=done | ended,
        )

    def metrics(self, rewards: torch.Tensor, metadata: Sequence[Any]) -> dict[str, float]:
        """The reward environment's metrics, and each count of :data:`COUNTS` per episode."""
        out = dict(self.reward.metrics(rewards, metadata))
        for name in COUNTS:
            out[name] = sum((m or {}).get("tools", {}).get(name, 0) for m in metadata) / max(1, len(metadata))
        return out

    def shutdown(self) -> None:
        self.pool.close()
        self.reward.shutdown()

    def _refusal(self, call: ToolCall, counts: dict[str, int]) -> str:
        """The reply to a call of a tool that does not exist; "" for one that does."""
        if call.name in self.tools:
            return ""
        counts["unknown_tool_calls"] += 1
        return f"error: there is no tool {call.name!r}; the tools are {', '.join(self.tools)}"

    def _run(self, jobs: list[tuple[int, int, ToolCall]], replies: list[list[str] | None], meta: list[dict]) -> None:
        results = self.pool.map([(self.tools[call.name].target, call.arguments) for _, _, call in jobs])
        for (i, k, call), result in zip(jobs, results, strict=True):
            counts = meta[i]["tools"]
            if result.status == "ok":
                line = result.value
            elif result.status == "timeout":
                counts["tool_timeouts"] += 1
                line = f"error: {call.name} did not finish within {self.options.tool_timeout_s:g} s"
            else:
                counts["tool_errors"] += 1
                line = f"error: {result.error}"
            assert replies[i] is not None
            replies[i][k] = line  # type: ignore[index]


def _last_assistant(log: Sequence[Message]) -> str:
    return next((m["content"] for m in reversed(log) if m["role"] == "assistant"), "")
