"""Options of the ``tools`` environment (the mapping under ``environments.tools``), declared on
its factory in :mod:`posttrain_env_tools.plugin` and read by core like a config section.
Torch-free: the plugin module imports this at entry-point load."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from posttrain.config.environments import above, at_least


def _scoring_environment(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    """attrs validator: a registered environment other than ``tools``."""
    from posttrain.plugins import plugin_host

    registry = plugin_host().environments
    if value == "tools":
        raise ValueError("the tools environment cannot score its own answers; name the one that does, e.g. math")
    if value not in registry:
        raise ValueError(registry.unknown_message(value))


@attrs.frozen
class ToolsOptions:
    """Options of the ``tools`` environment (``environments.tools``).

    - ``reward``: the registered environment that scores an episode's answer (its last
      assistant message without a tool call), e.g. ``math``; built inside this environment.
    - ``reward_options``: that environment's options.
    - ``tools``: the tools the model may call: built-in names (``calculator``, ``python``) or
      ``package.module:function`` references to your own functions.
    - ``schemas``: JSON schemas (OpenAI function format) by tool reference, for tools whose
      schema should not be derived from the function's signature and docstring.
    - ``format``: how the model writes a call: ``hermes`` (``<tool_call>{...}</tool_call>``)
      or ``llama3_json`` (the whole message is one JSON object). Use the one your chat
      template teaches.
    - ``max_tool_calls``: calls an episode may make; one more ends it with reward 0.
    - ``tool_timeout_s``: seconds one call may run (in a worker process, killed past it).
    - ``num_workers``: worker processes running calls.
    - ``malformed_call``: a call that cannot be read: ``feedback`` answers it with what is
      wrong and the episode goes on; ``end`` ends the episode with reward 0.
    """

    reward: str = attrs.field(default="math", validator=_scoring_environment)
    reward_options: dict[str, Any] = attrs.field(factory=dict)
    tools: list[str] = attrs.field(factory=lambda: ["calculator"])
    schemas: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    format: Literal["hermes", "llama3_json"] = "hermes"
    max_tool_calls: int = attrs.field(default=4, validator=at_least(1))
    tool_timeout_s: float = attrs.field(default=5.0, validator=above(0))
    num_workers: int = attrs.field(default=2, validator=at_least(1))
    malformed_call: Literal["feedback", "end"] = "feedback"
