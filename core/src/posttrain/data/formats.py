"""Row formats: recognise a row's format by its keys and check it into a typed example.

Formats (``data.format``):

- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, an OpenAI-style
  conversation with at least one assistant turn (SFT), with optional ``tools`` (JSON
  schemas the chat template renders, for tool-use demonstrations).
- ``prompt_response``: ``{"prompt": str | messages, "response": str, "system"?: str}`` (SFT).
- ``preference``: ``{"prompt": str | messages, "chosen": ..., "rejected": ...}`` where chosen
  and rejected are both strings (one assistant reply each) or both message lists (the
  completion turns, or full conversations that repeat the prompt); ``prompt`` may be left
  out when chosen and rejected are full conversations: their common leading messages are
  the prompt. ``system`` is optional.
- ``prompt``: ``{"messages": [...]}`` not ending with an assistant turn, or
  ``{"prompt": str}``, with optional ``answer`` (any JSON value), ``task`` (environment
  name), ``metadata`` (object) and ``system``. Every other key is kept in the metadata.

A message's ``content`` is a string or, for a vision-language model, a list of ``text`` and
``image`` parts (:mod:`posttrain.data.images`; in a preference row, in its prompt); a row may
carry an ``images`` list for image parts that name no image of their own.

A key whose value is null counts as missing (Arrow writes nulls for absent keys in
parquet), and null-valued keys inside messages are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

FORMATS = ("messages", "prompt_response", "preference", "prompt")

#: Every key a format reads; ``data.columns`` renames dataset columns to these.
ROW_KEYS = ("messages", "prompt", "response", "system", "chosen", "rejected", "answer", "task", "metadata", "tools",
            "images")

#: What each kind of dataset (what an algorithm consumes) accepts.
KIND_FORMATS: dict[str, tuple[str, ...]] = {
    "sft": ("messages", "prompt_response"),
    "preference": ("preference",),
    "prompt": ("prompt",),
}

Message = dict[str, Any]
_PROMPT_KEYS = ("messages", "prompt", "system", "task", "metadata", "images")
#: The kinds of parts a message's content list may hold.
PART_TYPES = ("text", "image")


class RowError(ValueError):
    """A malformed row; the message says what is missing or wrong (without file or row)."""


@attrs.frozen
class SFTExample:
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template (apply_chat_template tools=)
    images: list[Any] | None = None  # the row's images column: for image parts that name no image


@attrs.frozen
class PreferenceExample:
    """``prompt`` plus two alternative completions (each a list of turns)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    images: list[Any] | None = None  # the row's images column: for image parts that name no image


@attrs.frozen
class PromptExample:
    """A prompt for RL: the conversation so far and what the environment needs to score it."""

    messages: list[Message]
    answer: Any = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    task: str | None = None
    images: list[Any] | None = None  # the row's images column: for image parts that name no image


Example = SFTExample | PreferenceExample | PromptExample


def detect_format(row: Mapping[str, Any]) -> str | None:
    """The format a row's keys indicate, or None when they indicate none."""
    keys = {k for k, v in row.items() if v is not None}
    if keys & {"chosen", "rejected"}:
        return "preference"
    if "response" in keys:
        return "prompt_response"
    if "messages" in keys:
        messages = row["messages"]
        ends_with_assistant = (
            isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant"
        )
        return "messages" if ends_with_assistant else "prompt"
    if "prompt" in keys:
        return "prompt"
    return None


def parse_row(row: Any, fmt: str) -> Example:
    """Check ``row`` against ``fmt`` and return its example; raise :class:`RowError` if malformed."""
    if not isinstance(row, Mapping):
        raise RowError(f"expected a JSON object, found {_describe(row)}")
    return _PARSERS[fmt](row)


# ------------------------------------------------------------------------------- formats


def _parse_messages(row: Mapping[str, Any]) -> SFTExample:
    need = "messages rows need 'messages', a list of {'role', 'content'} objects"
    messages = _messages(_require(row, "messages", need), "messages")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("'messages' has no assistant turn to train on")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise RowError(f"'tools' must be a list of JSON schemas (objects), found {_describe(tools)}")
    return SFTExample(messages, [dict(t) for t in tools] if tools else None, _images(row))


def _parse_prompt_response(row: Mapping[str, Any]) -> SFTExample:
    need = "prompt_response rows need 'prompt' and 'response'"
    prompt = _prompt(row, _require(row, "prompt", need))
    response = _string(_require(row, "response", need), "response")
    return SFTExample([*prompt, {"role": "assistant", "content": response}], images=_images(row))


def _images(row: Mapping[str, Any]) -> list[Any] | None:
    images = row.get("images")
    if images is not None and not isinstance(images, list):
        raise RowError(f"'images' must be a list of images (paths, bytes or image values), found {_describe(images)}")
    return list(images) if images else None


def _parse_preference(row: Mapping[str, Any]) -> PreferenceExample:
    need = (
        "preference rows need 'prompt', 'chosen', 'rejected'; "
        "'prompt' may be left out when chosen and rejected are whole conversations"
    )
    chosen = _require(row, "chosen", need)
    rejected = _require(row, "rejected", need)
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = _prompt(row, _require(row, "prompt", need))
        return PreferenceExample(prompt, [_assistant(chosen)], [_assistant(rejected)], _images(row))
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise RowError(
            "'chosen' and 'rejected' must both be strings or both be message lists, "
            f"found {_describe(chosen)} and {_describe(rejected)}"
        )
    chosen_msgs, rejected_msgs = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    if row.get("prompt") is not None:
        prompt = _prompt(row, row["prompt"])
        chosen_msgs = _strip_prefix(chosen_msgs, prompt)
        rejected_msgs = _strip_prefix(rejected_msgs, prompt)
    else:
        shared = 0
        while shared < min(len(chosen_msgs), len(rejected_msgs)) and chosen_msgs[shared] == rejected_msgs[shared]:
            shared += 1
        if shared == 0:
            raise RowError("'chosen' and 'rejected' share no leading prompt messages; add a 'prompt' key")
        prompt = chosen_msgs[:shared]
        chosen_msgs, rejected_msgs = chosen_msgs[shared:], rejected_msgs[shared:]
    for key, completion in (("chosen", chosen_msgs), ("rejected", rejected_msgs)):
        if not any(m["role"] == "assistant" for m in completion):
            raise RowError(f"'{key}' has no assistant turn after the prompt")
    return PreferenceExample(prompt, chosen_msgs, rejected_msgs, _images(row))


def _parse_prompt(row: Mapping[str, Any]) -> PromptExample:
    if row.get("messages") is not None:
        messages = _messages(row["messages"], "messages")
    else:
        messages = _prompt(row, _require(row, "prompt", "prompt rows need 'messages' or 'prompt'"))
    if messages[-1]["role"] == "assistant":
        raise RowError("a prompt must not end with an assistant turn (the policy writes that turn)")
    task = row.get("task")
    if task is not None and not isinstance(task, str):
        raise RowError(f"'task' must be a string (an environment name), found {_describe(task)}")
    metadata = row.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise RowError(f"'metadata' must be an object, found {_describe(metadata)}")
    extra = {k: v for k, v in row.items() if k not in _PROMPT_KEYS and v is not None}
    return PromptExample(messages, row.get("answer"), {**(metadata or {}), **extra}, task, _images(row))


_PARSERS = {
    "messages": _parse_messages,
    "prompt_response": _parse_prompt_response,
    "preference": _parse_preference,
    "prompt": _parse_prompt,
}


# ------------------------------------------------------------------------------- fields


def _require(row: Mapping[str, Any], key: str, need: str) -> Any:
    value = row.get(key)
    if value is None:
        raise RowError(f"missing key '{key}' ({need})")
    return value


def _string(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"'{key}' must be a string, found {_describe(value)}")
    return value


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}


def _prompt(row: Mapping[str, Any], prompt: Any) -> list[Message]:
    """A prompt given as a string (with the row's optional ``system``) or as messages."""
    if isinstance(prompt, list):
        return _messages(prompt, "prompt")
    if not isinstance(prompt, str):
        raise RowError(f"'prompt' must be a string or a message list, found {_describe(prompt)}")
    system = row.get("system")
    head = [{"role": "system", "content": _string(system, "system")}] if system is not None else []
    return [*head, {"role": "user", "content": prompt}]


def _messages(value: Any, key: str) -> list[Message]:
    if not isinstance(value, list):
        raise RowError(f"'{key}' must be a list of messages, found {_describe(value)}")
    if not value:
        raise RowError(f"'{key}' is an empty list; it needs at least one message")
    out = []
    for i, message in enumerate(value):
        where = f"'{key}'[{i}]"
        if not isinstance(message, Mapping):
            raise RowError(f"{where} must be an object with 'role' and 'content', found {_describe(message)}")
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str):
            raise RowError(f"{where} needs a string 'role', found {_describe(message.get('role'))}")
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [_part(part, f"{where}['content'][{j}]") for j, part in enumerate(content)]
        elif not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise RowError(f"{where}['content'] must be a string or a list of parts, found {_describe(content)}")
        out.append(message)
    return out


def _part(part: Any, where: str) -> dict[str, Any]:
    """One part of a content list: ``{"type": "text", "text": str}`` or ``{"type": "image", ...}``."""
    if not isinstance(part, Mapping) or part.get("type") not in PART_TYPES:
        found = part.get("type") if isinstance(part, Mapping) else part
        raise RowError(f"{where} must be an object with 'type' one of {', '.join(PART_TYPES)}, found {_describe(found)}")
    part = {k: v for k, v in part.items() if v is not None}
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise RowError(f"{where} is a text part; its 'text' must be a string, found {_describe(part.get('text'))}")
    return part


def _strip_prefix(messages: list[Message], prompt: list[Message]) -> list[Message]:
    """Completion turns: ``messages`` without a leading copy of the prompt, if it has one."""
    return messages[len(prompt):] if messages[: len(prompt)] == prompt else messages


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
