"""Tools: plain Python functions the model may call, each with a JSON schema.

A tool is named by a reference: a built-in name (``calculator``, ``python``: see
:mod:`posttrain_env_tools.builtin`) or ``"package.module:function"``. Its schema, in the OpenAI
function format that chat templates render, is derived from the function's signature and
its Google-style docstring (transformers' ``get_json_schema``), or given; a given schema
must name exactly the function's parameters. Functions must be importable by that reference
(worker processes import them to run a call) and return something ``str()`` can show.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from posttrain.errors import ConfigError

#: Built-in tools by name: the function each one runs.
BUILTIN = {
    "calculator": "posttrain_env_tools.builtin:calculator",
    "python": "posttrain_env_tools.builtin:python",
}


@attrs.frozen
class Tool:
    """One tool: its name (as the model calls it), its schema and where its function lives."""

    name: str
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    target: str  # "package.module:function"


def load_function(target: str) -> Callable[..., Any]:
    """The function a ``"package.module:function"`` reference names."""
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"tool '{target}': expected a built-in tool ({', '.join(BUILTIN)}) or 'package.module:function'")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"tool '{target}': cannot import it ({type(error).__name__}: {error})") from None
    if not callable(function):
        raise ConfigError(f"tool '{target}': {type(function).__name__} is not a function")
    return function


def resolve_tool(reference: str, schema: Mapping[str, Any] | None = None) -> Tool:
    """The tool ``reference`` names, with ``schema`` or one derived from its function."""
    target = BUILTIN.get(reference, reference)
    function = load_function(target)
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(function)
        except Exception as error:  # no docstring, an argument without a type or a description
            raise ConfigError(
                f"tool '{reference}': cannot derive its JSON schema from the function ({error}); give every "
                "parameter a type hint and a Google-style docstring (an 'Args:' section), or give the schema"
            ) from None
        schema = {"type": "function", "function": {k: v for k, v in schema["function"].items() if k != "return"}}
    check_schema(reference, dict(schema), function)
    return Tool(schema["function"]["name"], dict(schema), target)


def check_schema(reference: str, schema: dict[str, Any], function: Callable[..., Any]) -> None:
    """Refuse a schema that is not an OpenAI function schema or whose parameters are not
    exactly the function's (names, and which ones are required)."""
    spec = schema.get("function") if schema.get("type") == "function" else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ConfigError(
            f"tool '{reference}': its schema must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
            f"\"description\": ..., \"parameters\": {{...}}}}}}, got {schema!r}"
        )
    parameters = spec.get("parameters") or {}
    declared = set((parameters.get("properties") or {}).keys())
    required = set(parameters.get("required") or [])
    signature = inspect.signature(function)
    takes = {n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    needs = {n for n in takes if signature.parameters[n].default is inspect.Parameter.empty}
    problems = []
    if declared != takes:
        problems.append(f"the schema declares parameters {sorted(declared)}, the function takes {sorted(takes)}")
    if required != needs:
        problems.append(f"the schema requires {sorted(required)}, the function requires {sorted(needs)}")
    if problems:
        raise ConfigError(f"tool '{reference}': its schema does not match the function: {'; '.join(problems)}")
