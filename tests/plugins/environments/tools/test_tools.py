"""Tools: schemas derived from functions or given and checked, the built-in tools."""

from __future__ import annotations

import pytest

from posttrain.errors import ConfigError
from posttrain_env_tools.builtin import calculator, python
from posttrain_env_tools.tool import resolve_tool

FUNCTIONS = "tests.plugins.environments.tools.tool_functions"


def test_a_schema_is_derived_from_the_signature_and_docstring():
    tool = resolve_tool(f"{FUNCTIONS}:add")
    assert tool.name == "add" and tool.target == f"{FUNCTIONS}:add"
    assert tool.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first"},
                                                        "b": {"type": "integer", "description": "the second"}},
                       "required": ["a", "b"]},
    }}
    assert resolve_tool("calculator").schema["function"]["parameters"]["required"] == ["expression"]


def test_a_given_schema_must_match_the_function():
    schema = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "c": {"type": "integer"}}, "required": ["a"]}}}
    with pytest.raises(ConfigError) as error:
        resolve_tool(f"{FUNCTIONS}:add", schema)
    assert str(error.value) == (
        f"tool '{FUNCTIONS}:add': its schema does not match the function: the schema declares parameters ['a', 'c'], "
        "the function takes ['a', 'b']; the schema requires ['a'], the function requires ['a', 'b']"
    )
    given = resolve_tool(f"{FUNCTIONS}:undocumented", {"type": "function", "function": {
        "name": "echo", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}})
    assert given.name == "echo"  # the model calls it by the schema's name


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("abacus", "tool 'abacus': expected a built-in tool (calculator, python) or 'package.module:function'"),
        ("no_such_module:f", "tool 'no_such_module:f': cannot import it (ModuleNotFoundError: No module named 'no_such_module')"),
        (f"{FUNCTIONS}:undocumented", f"tool '{FUNCTIONS}:undocumented': cannot derive its JSON schema from the function"),
    ],
)
def test_tools_that_cannot_be_used_are_refused(reference, message):
    with pytest.raises(ConfigError) as error:
        resolve_tool(reference)
    assert str(error.value).startswith(message)


def test_the_calculator_is_exact_and_only_does_arithmetic():
    assert calculator("123456789 * 987654321") == "121932631112635269"
    assert calculator("(12 + 30) / 2") == "21" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    with pytest.raises(ValueError, match="not arithmetic: \"__import__\\('os'\\)\""):
        calculator("__import__('os')")
    with pytest.raises(ValueError, match="exponent 100000 is larger than 1000"):
        calculator("2 ** 100000")


def test_the_python_tool_runs_in_the_code_sandbox():
    assert python("print(sum(range(101)))") == "5050\n"
    assert python("raise KeyError('x')") == "error: KeyError: 'x'"
