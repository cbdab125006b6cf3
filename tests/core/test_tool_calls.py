"""Tool calls read from the model's text in the hermes and llama3_json formats."""

from __future__ import annotations

import pytest

from posttrain.data.tool_calls import MalformedToolCall, ToolCall, parse_hermes, parse_llama3_json


def test_hermes_calls_in_order_with_text_around_them():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>')
    assert parse_hermes(text) == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("add", {"a": 1, "b": 2})]


def test_an_answer_calls_nothing():
    assert parse_hermes("The sum is 5.") == [] and parse_llama3_json("The sum is 5.") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('<tool_call>{"name": "calculator"', "a <tool_call> is not closed by </tool_call>"),
        ("<tool_call>{name: calculator}</tool_call>", "the call is not valid JSON (Expecting property name enclosed in double quotes at character 1)"),
        ('<tool_call>["calculator"]</tool_call>', 'the call must be a JSON object with a "name" string'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "the \"arguments\" of 'add' must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', "the \"arguments\" of 'add' are not a JSON object"),
    ],
)
def test_malformed_hermes_calls_say_what_is_wrong(text, message):
    with pytest.raises(MalformedToolCall) as error:
        parse_hermes(text)
    assert str(error.value) == message


def test_llama3_json_is_the_whole_message():
    assert parse_llama3_json(' {"name": "add", "parameters": {"a": 1, "b": 2}} ') == [ToolCall("add", {"a": 1, "b": 2})]
    assert parse_llama3_json('<|python_tag|>{"name": "calculator", "arguments": {"expression": "1"}}') == [
        ToolCall("calculator", {"expression": "1"})
    ]
    with pytest.raises(MalformedToolCall, match="not valid JSON"):
        parse_llama3_json('{"name": "add", "parameters": {"a": 1')
