"""Tool-call parsers: Hermes <tool_call> blocks, Llama 3 JSON, forced calls; the same calls whatever the chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.frontend.tool_parsers import (
    HermesParser, Llama3JsonParser, NamedCall, RequiredCalls, ToolChoiceError, fold_calls, tool_choice_of,
)  # fmt: skip

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'


def run(parser, chunks: list[str]) -> tuple[str, list[dict]]:
    """Content and folded tool_calls of an output pushed in these chunks."""
    content, deltas = [], []
    for chunk in chunks:
        text, d = parser.push(chunk)
        content.append(text)
        deltas += d
    text, d = parser.flush()
    return "".join(content) + text, fold_calls(deltas + d)


def names_and_args(calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _chunked(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@given(cuts=st.lists(st.integers(0, len(HERMES)), max_size=12))
def test_hermes_calls_and_content_whatever_the_chunks(cuts):
    content, calls = run(HermesParser(), _chunked(HERMES, cuts))
    assert content.strip() == "Let me check."
    assert names_and_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2


@given(cuts=st.lists(st.integers(0, len(LLAMA)), max_size=8))
def test_llama3_json_calls_whatever_the_chunks(cuts):
    content, calls = run(Llama3JsonParser(), _chunked(LLAMA, cuts))
    assert content == "" and names_and_args(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser])
def test_plain_text_is_content(parser):
    text = "The weather is fine <tool and {braces} too."
    assert run(parser(), _chunked(text, [3, 20, 21])) == (text, [])


def test_an_unparsable_call_stays_content():
    text = "<tool_call>{not json</tool_call> ok"
    assert run(HermesParser(), [text]) == (" ok", [])
    assert run(Llama3JsonParser(), ["{not a call}"]) == ("{not a call}", [])


def test_a_named_call_streams_its_arguments_as_they_come():
    parser = NamedCall("get_weather")
    first = parser.push('{"ci')
    assert first[1][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1][1] == {"index": 0, "function": {"arguments": '{"ci'}}
    rest = parser.push('ty": "Rome"}')[1] + parser.flush()[1]
    assert names_and_args(fold_calls(first[1] + rest)) == [("get_weather", {"city": "Rome"})]


def test_required_calls_come_from_the_array():
    out = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Lima"}}]'
    content, calls = run(RequiredCalls(), _chunked(out, [5, 40]))
    assert content == "" and names_and_args(calls) == [("get_time", {}), ("get_weather", {"city": "Lima"})]
    content, calls = run(RequiredCalls(), [out[:60]])  # cut short by max_tokens: the whole calls count
    assert names_and_args(calls) == [("get_time", {})]


def test_tool_choice_modes_and_their_schemas():
    assert tool_choice_of(None, None).mode == "none"
    assert tool_choice_of([WEATHER], None).mode == "auto"
    named = tool_choice_of([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.mode == "named" and named.schema == WEATHER["function"]["parameters"]
    required = tool_choice_of([WEATHER, TIME], "required")
    assert required.schema["type"] == "array" and len(required.schema["items"]["anyOf"]) == 2


# Parameters with their own $defs (what pydantic writes), definitions, and a recursive "#".
PLACE = {"type": "function", "function": {"name": "find_place", "parameters": {
    "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}, "near": {"$ref": "#/$defs/Spot"}},
                        "required": ["city"]},
              "Spot": {"enum": ["north", "south"]}}}}}
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                     "tag": {"$ref": "#/definitions/Tag"}},
    "definitions": {"Tag": {"type": "string", "maxLength": 3}}}}}


def test_required_calls_keep_each_tools_local_refs():
    """In the combined schema "#" is the array of calls: each tool's $defs / definitions (and "#") are hoisted
    and its $refs rewritten, so a call valid for its tool is valid for the whole, and an invalid one is not."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = tool_choice_of([PLACE, TREE, WEATHER], "required").schema
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "find_place", "parameters": {"where": {"city": "Oslo", "near": "north"}}},
            {"name": "tree", "parameters": {"tag": "a", "kids": [{"tag": "b", "kids": []}]}},
            {"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, schema)
    for bad in ([{"name": "find_place", "parameters": {"where": {"city": "Oslo", "near": "east"}}}],
                [{"name": "tree", "parameters": {"kids": [{"tag": "long"}]}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    inner = json.dumps(schema["items"])
    assert '"$defs":' not in inner and '"definitions":' not in inner  # no definitions left inside a call


@pytest.mark.parametrize("tools, choice, why", [
    (None, "required", "needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([WEATHER], "sometimes", "must be none, auto"),
    ([{"type": "function", "function": {}}], "auto", "tools\\[0\\]"),
])  # fmt: skip
def test_bad_tools_or_tool_choice_are_refused(tools, choice, why):
    with pytest.raises(ToolChoiceError, match=why):
        tool_choice_of(tools, choice)
