"""Structured outputs and tool calls through `metrale serve`: the official openai client, plain HTTP and the ZMQ
client, on the tiny random model (a grammar makes the output valid whatever the weights)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from metrale.ipc.sampling import SamplingParams, StructuredOutputs

from serve_fixture import http_server, openai_client
from test_grammar_compiler import SLOW

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["title", "year", "genres"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = ""  # the served model's id (its folder's name), set by the server fixture


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    global MODEL
    model = tiny_model_dir("llama")
    MODEL = model.name
    with http_server(model, "--grammar-timeout", "1") as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    with openai_client(server, timeout=120) as client:
        yield client


def _loads(text: str):
    """JSON as xgrammar's strings allow it (raw control characters, which a random model picks)."""
    return json.loads(text, strict=False)


def test_json_schema_through_response_format_validates(api):
    """Chat, greedy and seeded, whole and streamed: the content is JSON that validates against the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}
    for seed in (None, 7):
        reply = api.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, max_tokens=80,
                                            temperature=0.0 if seed is None else 0.9, seed=seed)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(_loads(reply.choices[0].message.content), SCHEMA)
    stream = api.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, max_tokens=80, stream=True,
                                         temperature=0.0)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reply_text(api, fmt)


def reply_text(api, fmt) -> str:
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, max_tokens=80, temperature=0.0)
    return reply.choices[0].message.content


def test_structured_outputs_regex_and_choice_on_completions(api):
    """vLLM's structured_outputs field: a regex and a choice hold on the completions route."""
    reply = api.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.8, seed=1,
                                   extra_body={"structured_outputs": {"regex": r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"\+[0-9]{2} [0-9]{3}-[0-9]{4}", reply.choices[0].text)
    reply = api.completions.create(model=MODEL, prompt="Is it?", max_tokens=8, n=3, temperature=1.0, seed=2,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no", "perhaps"]}})
    assert {c.text for c in reply.choices} <= {"yes", "no", "perhaps"}


def test_json_object_mode_on_chat(api):
    """response_format json_object: the reply opens an object (it closes it when the model stops in time)."""
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "json_object"}, max_tokens=40)
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(_loads(text), dict)


@pytest.mark.parametrize("body, why", [
    ({"structured_outputs": {"regex": "(("}}, "invalid regex grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nothing"}}}}, "invalid json grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"structured_outputs": {"json": SLOW.json}}, "did not compile within 1 s"),
])  # fmt: skip
def test_a_bad_or_slow_grammar_is_a_400_for_that_request_only(api, body, why):
    """Invalid, malformed or too slow to compile: a 400 naming why; the server answers the next request."""
    with pytest.raises(openai.BadRequestError, match=why):
        api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, extra_body=body)
    ok = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, extra_body={"structured_outputs": {"choice": ["fine"]}})
    assert ok.choices[0].message.content == "fine"


def test_structured_outputs_over_zmq(server):
    """The ZMQ protocol's sampling.structured_outputs: the regex holds; an invalid one is Error bad_request."""
    with server.client() as client:
        params = SamplingParams(max_tokens=12, temperature=0.7, seed=3, structured_outputs=StructuredOutputs(regex="[a-f]{3,6}!"))
        assert re.fullmatch("[a-f]{3,6}!", client.complete("Say", params=params).text)
        bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(grammar="root ::= nowhere"))
        with pytest.raises(Exception, match="bad_request|invalid grammar"):
            client.complete("Say", params=bad)


def test_a_named_tool_call_parses_and_streams(api):
    """tool_choice naming a function: the call always parses, its arguments validate; streamed, the deltas
    carry the name first and the arguments in pieces, which add up to the whole reply's."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice=choice,
                                        max_tokens=40, temperature=0.0)
    msg = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and msg.content == ""  # vLLM's and OpenAI's "", not null
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(_loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice=choice,
                                         max_tokens=40, temperature=0.0, stream=True)
    deltas = [tc for chunk in stream if chunk.choices for tc in (chunk.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id and len(deltas) > 2
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_tool_choice_required_makes_at_least_one_call(api):
    """tool_choice required: one or more calls of the given tools, each with arguments of its schema."""
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER, TIME], tool_choice="required",
                                        max_tokens=120, temperature=0.9, seed=5)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason in ("tool_calls", "length")  # the model may call on and on
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(_loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_with_a_tool_whose_parameters_use_local_refs(api):
    """$ref "#/$defs/..." inside a tool's parameters (as pydantic writes them) works under "required" too."""
    place = {"type": "function", "function": {"name": "find_place", "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}}}}}
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[place, TIME], tool_choice="required",
                                        max_tokens=120, temperature=0.0)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason in ("tool_calls", "length")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (place, TIME)}
    for call in calls:
        jsonschema.validate(_loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_auto_and_none_leave_plain_text_as_content(api):
    """The random model writes no <tool_call> block: auto and none answer with content and no calls."""
    for choice in ("auto", "none"):
        reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice=choice, max_tokens=8)
        assert reply.choices[0].message.tool_calls in (None, []) and reply.choices[0].finish_reason == "length"


def test_bad_tool_choice_is_a_400(api):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "launch_rocket"}})
