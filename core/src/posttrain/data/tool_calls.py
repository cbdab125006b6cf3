"""Tool calls in the model's text, in two formats (read by the ``tools`` environment and by
the chat-completions endpoint that outside agents call).

- ``hermes`` (Hermes, Qwen): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  a message may hold several. Text around the calls is allowed.
- ``llama3_json`` (Llama 3.1's JSON tool calling): the whole message is one JSON object
  ``{"name": ..., "parameters": {...}}`` (``arguments`` is accepted too), optionally after
  ``<|python_tag|>``.

A parser returns the calls in order, ``[]`` for a message that calls nothing (an answer),
and raises :class:`MalformedToolCall` for a message that tries to call and fails (an open
``<tool_call>`` without its end, JSON that does not parse, no name, arguments that are not
an object).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import attrs

from posttrain.errors import PosttrainError


class MalformedToolCall(PosttrainError):
    """The model tried to call a tool and the call cannot be read."""


@attrs.frozen
class ToolCall:
    name: str
    arguments: dict[str, Any]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    calls = [_call(body, "arguments") for body in _HERMES.findall(text)]
    if text.count("<tool_call>") != len(calls):
        raise MalformedToolCall("a <tool_call> is not closed by </tool_call>")
    return calls


def parse_llama3_json(text: str) -> list[ToolCall]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    return [_call(body, "parameters")]


#: The formats by name, as ``environments.tools.format`` names them.
FORMATS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def text_around_calls(text: str, fmt: str) -> str:
    """What a message that calls tools (in ``fmt``) says besides its calls: the text around
    hermes' ``<tool_call>`` blocks; nothing for llama3_json, whose calls are the whole message."""
    return _HERMES.sub("", text).strip() if fmt == "hermes" else ""


def _call(body: str, arguments_key: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        raise MalformedToolCall(f"the call is not valid JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise MalformedToolCall('the call must be a JSON object with a "name" string')
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise MalformedToolCall(f'the "{arguments_key}" of {value["name"]!r} are not a JSON object') from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f'the "{arguments_key}" of {value["name"]!r} must be a JSON object')
    return ToolCall(value["name"], arguments)
