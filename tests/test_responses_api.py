"""POST /v1/responses (OpenAI's Responses API) through `metrale serve`: the official `openai` client and plain HTTP
on the tiny random llama (its text is random; a grammar makes JSON and tool calls valid whatever the weights), and
the route's pure parts (input items to chat messages, output items and their events) on their own."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request

import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from metrale.frontend.http_errors import ApiError
from metrale.frontend.tokenizer import Tokenizer
from metrale.frontend.http_responses import chat_messages, chat_tool_choice, chat_tools
from metrale.frontend.responses_events import EventStream, OutputItems, reasoning_token_count

from serve_fixture import free_port, http_server, openai_client, running_server
from test_http_api import assert_error, http

MODEL = ""  # the served model's id (its folder's name), set by the server fixture
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
MOVIE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                          "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
         "required": ["title", "year"]}
STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    global MODEL
    model = tiny_model_dir("llama")
    MODEL = model.name
    with http_server(model) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    with openai_client(server, timeout=120) as client:
        yield client


def _loads(text: str):
    """JSON as xgrammar's strings allow it (raw control characters, which a random model picks)."""
    return json.loads(text, strict=False)


def sse_events(url: str, body: dict) -> list[dict]:
    """A streamed response's events, each checked to be the `event:` line's type."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = resp.read().decode()
    events = []
    for record in text.split("\n\n"):
        if record.strip():
            kind, data = record.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: "), record
            events.append(json.loads(data[len("data: "):]))
            assert events[-1]["type"] == kind[len("event: "):]
    return events


def check_event_order(events: list[dict]) -> Response:
    """Assert the events are what the openai client's types accept, numbered 0.., in the Responses API's order
    (created, in_progress, each item added / filled / done in turn, then completed or incomplete); return the
    final response."""
    for event in events:
        STREAM_EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1 and ids.pop().startswith("resp_")
    body = kinds[2:-1]
    at, index = 0, 0
    while at < len(body):
        assert body[at] == "response.output_item.added" and events[2 + at]["output_index"] == index
        kind = events[2 + at]["item"]["type"]
        name = {"message": "output_text", "reasoning": "reasoning_text", "function_call": "function_call_arguments"}[kind]
        at += 1
        if kind != "function_call":
            assert body[at] == "response.content_part.added"
            at += 1
        while body[at] == f"response.{name}.delta":
            assert events[2 + at]["output_index"] == index
            at += 1
        assert body[at] == f"response.{name}.done"
        at += 1
        if kind != "function_call":
            assert body[at] == "response.content_part.done"
            at += 1
        assert body[at] == "response.output_item.done" and events[2 + at]["output_index"] == index
        at, index = at + 1, index + 1
    final = Response.model_validate(events[-1]["response"])
    assert len(final.output) == index and final.status == kinds[-1].split(".")[1]
    return final


def streamed_text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


# ---- answers ----------------------------------------------------------------------------------------


def test_text_input_gets_a_response_the_client_validates(server, api):
    """A string input: the raw JSON validates as openai's Response, and the client's output_text is the message's
    text; usage counts as the chat route counts."""
    status, raw = http("POST", server.http + "/v1/responses", {"model": MODEL, "input": "Hello there",
                                                              "max_output_tokens": 6, "temperature": 0})
    assert status == 200, raw
    reply = Response.model_validate(raw)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert reply.output_text == message.content[0].text and reply.output_text
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=6, temperature=0)
    assert reply.output_text == chat.choices[0].message.content
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert (reply.max_output_tokens, reply.temperature, reply.tool_choice, reply.tools) == (6, 0.0, "auto", [])
    again = api.responses.create(model=MODEL, input="Hello there", max_output_tokens=6, temperature=0)
    assert again.output_text == reply.output_text and again.id != reply.id


def test_instructions_and_messages_render_as_the_chat_route(api):
    """instructions is a system message in front; input messages (text parts joined as the chat route joins
    them, an assistant turn in output_text parts) make the same prompt and the same greedy answer as chat."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Sort"}, {"type": "input_text", "text": "a list."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Which list?"}]},
             {"role": "developer", "content": "Be brief."},
             {"role": "user", "content": "[3, 1, 2]"}]
    reply = api.responses.create(model=MODEL, instructions="You write Python.", input=items, max_output_tokens=8,
                                 temperature=0, metadata={"run": "7"}, user="u-1", parallel_tool_calls=True,
                                 truncation="disabled")
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort\na list."},
                {"role": "assistant", "content": "Which list?"}, {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "[3, 1, 2]"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.output_text == chat.choices[0].message.content
    assert (reply.instructions, reply.metadata, reply.user) == ("You write Python.", {"run": "7"}, "u-1")


def test_max_output_tokens_cut_is_incomplete(api):
    reply = api.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3 and reply.output[0].status == "incomplete"


def test_seed_from_extra_body_is_honoured(api):
    """A seeded sampled answer repeats; another seed gives another answer."""
    def answer(seed):
        return api.responses.create(model=MODEL, input="Tell a story.", max_output_tokens=12, temperature=1.0,
                                    extra_body={"seed": seed, "ignore_eos": True}).output_text
    first = answer(7)
    assert answer(7) == first and answer(8) != first


def test_logprobs_through_include(server, api):
    """include message.output_text.logprobs: one entry per output token with top_logprobs alternatives; streamed,
    the text's done event lists the same ones, the end-of-sequence token's (which has no text) included."""
    reply = api.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0, top_logprobs=2,
                                 include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    logprobs = reply.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert all(lp.top_logprobs[0].logprob == lp.logprob for lp in logprobs)  # greedy: the pick is the top one
    body = {"model": MODEL, "input": "A movie?", "max_output_tokens": 60, "temperature": 0, "top_logprobs": 1,
            "include": ["message.output_text.logprobs"],
            "text": {"format": {"type": "json_schema", "name": "movie", "schema": MOVIE}}}
    whole = Response.model_validate(http("POST", server.http + "/v1/responses", body)[1])
    assert whole.status == "completed"  # ended by the end-of-sequence token the grammar allows last
    listed = [lp.model_dump() for lp in whole.output[0].content[0].logprobs]
    assert len(listed) == whole.usage.output_tokens
    events = sse_events(server.http + "/v1/responses", {**body, "stream": True})
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp["token"] for lp in done["logprobs"]] == [lp["token"] for lp in listed]
    # (a logprob may differ in its last digits between two runs: the batch around it is another)
    assert [lp["logprob"] for lp in done["logprobs"]] == pytest.approx([lp["logprob"] for lp in listed], abs=1e-3)


# ---- streaming ----------------------------------------------------------------------------------------


def test_stream_events_come_in_order_and_add_up_to_the_whole_answer(server, api):
    body = {"model": MODEL, "input": "Write a poem.", "max_output_tokens": 10, "temperature": 0}
    events = sse_events(server.http + "/v1/responses", {**body, "stream": True})
    final = check_event_order(events)
    whole = api.responses.create(**body)
    text = streamed_text(events)
    assert text and text == final.output_text == whole.output_text
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert [e["text"] for e in done] == [text]
    assert final.status == whole.status == "incomplete" and final.usage.output_tokens == whole.usage.output_tokens
    client_stream = api.responses.create(**body, stream=True)
    assert [e.type for e in client_stream] == [e["type"] for e in events]


def test_json_schema_format_gives_json_for_the_schema(api):
    """text.format json_schema: whole and through client.responses.stream, the text validates; the two agree."""
    fmt = {"type": "json_schema", "name": "movie", "schema": MOVIE, "strict": True}
    reply = api.responses.create(model=MODEL, input="A movie, please.", text={"format": fmt}, max_output_tokens=60,
                                 temperature=0)
    assert reply.status == "completed"
    jsonschema.validate(_loads(reply.output_text), MOVIE)
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "movie"
    with api.responses.stream(model=MODEL, input="A movie, please.", text={"format": fmt}, max_output_tokens=60,
                              temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == reply.output_text


def test_json_object_format_opens_an_object(api):
    reply = api.responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}},
                                 max_output_tokens=30, temperature=0)
    assert reply.output_text.startswith("{")
    if reply.status == "completed":
        assert isinstance(_loads(reply.output_text), dict)


# ---- tools --------------------------------------------------------------------------------------------


def test_required_tool_choice_yields_function_calls_that_parse(api):
    reply = api.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER, TIME], tool_choice="required",
                                 max_output_tokens=120, temperature=0)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and len(calls) == len(reply.output)  # forced: no text beside the calls
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(_loads(call.arguments), schemas[call.name])
    assert reply.tools[0].name == "get_weather" and reply.tool_choice == "required"


def test_parallel_tool_calls_false_keeps_the_first_call(api):
    body = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER, TIME], tool_choice="required",
                max_output_tokens=120, temperature=0)
    every = api.responses.create(**body).output
    assert len(every) >= 2, "this prompt must make several calls for the check to mean anything"
    (one,) = api.responses.create(**body, parallel_tool_calls=False).output
    assert (one.name, one.arguments) == (every[0].name, every[0].arguments)


def test_named_tool_streams_its_arguments(server, api):
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER, TIME], "max_output_tokens": 40, "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    events = sse_events(server.http + "/v1/responses", {**body, "stream": True})
    final = check_event_order(events)
    (call,) = final.output
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(pieces) > 1 and "".join(pieces) == done["arguments"] == call.arguments
    jsonschema.validate(_loads(call.arguments), WEATHER["parameters"])
    whole = api.responses.create(**body)
    assert whole.output[0].arguments == call.arguments and whole.output[0].name == "get_weather"


def test_function_call_output_round_trip(api):
    """The calls of one response, fed back with their outputs, make the prompt (and the greedy answer) the chat
    route makes of an assistant turn with tool_calls and a tool message."""
    first = api.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                 temperature=0)
    (call,) = first.output
    items = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}]
    second = api.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": '{"celsius": 21}'}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool], max_tokens=8, temperature=0)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == (chat.choices[0].message.content or "")


# ---- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": 5, "arguments": "{}"}]}, "input[0].name"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
    ({"max_output_tokens": 10**6}, "input"),  # context_length_exceeded: the prompt and the answer do not fit
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
])  # fmt: skip
def test_unservable_or_malformed_fields_are_400_naming_them(server, api, extra, param):
    status, answer = http("POST", server.http + "/v1/responses", {"model": MODEL, "input": "x", **extra})
    assert_error(status, answer, 400, param=param)
    assert api.responses.create(model=MODEL, input="still there?", max_output_tokens=2).output_text is not None


def test_a_missing_input_or_another_model_is_refused(server):
    assert_error(*http("POST", server.http + "/v1/responses", {"model": MODEL}), 400, param="input")
    assert_error(*http("POST", server.http + "/v1/responses", {"model": "gpt-5", "input": "x"}), 404, code="model_not_found")


def test_an_error_after_the_stream_started_ends_it_with_an_error_event(tiny_model_dir):
    """SIGTERM while a response streams: its last event is an `error` (shutting_down), with no response.completed."""
    port = free_port()
    with running_server(tiny_model_dir("llama", max_position_embeddings=4096), "--http-port", str(port)) as s:
        lines: list[str] = []
        started = threading.Event()

        def read() -> None:
            body = {"input": "x", "max_output_tokens": 3000, "stream": True, "ignore_eos": True}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/responses", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        lines.append(line[len("data: "):])
                        if '"response.output_text.delta"' in line:
                            started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(120)
        s.proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert not reader.is_alive()
        assert s.proc.wait(60) == 0
    events = [json.loads(line) for line in lines]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "shutting_down"
    assert events[-1]["sequence_number"] == len(events) - 1
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)


def test_a_reasoning_answer_comes_as_a_reasoning_item(tiny_model_dir):
    """A template that leaves `<think>` open: the output is a reasoning item holding the chat route's reasoning,
    the same whole and streamed, and usage counts its tokens as reasoning tokens."""
    from metrale.gpu_worker.tiny_model import CHAT_TEMPLATE  # (torch comes with it: imported where it is needed)

    model = tiny_model_dir("llama")
    thinking = CHAT_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert thinking != CHAT_TEMPLATE
    port = free_port()
    with running_server(model, "--http-port", str(port), "--chat-template", thinking) as s:
        base = f"http://127.0.0.1:{port}/v1"
        body = {"input": "Think.", "max_output_tokens": 8, "temperature": 0}
        status, raw = http("POST", base + "/responses", body)
        assert status == 200, raw
        whole = Response.model_validate(raw)
        events = sse_events(base + "/responses", {**body, "stream": True})
        status, chat = http("POST", base + "/chat/completions", {"messages": [{"role": "user", "content": "Think."}],
                                                                 "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        assert status == 200, chat
    final = check_event_order(events)
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == chat["choices"][0]["message"]["reasoning"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning.content[0].text
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    tokenizer = Tokenizer.from_dir(model)
    expected = reasoning_token_count(chat["choices"][0]["token_ids"], tokenizer.token_id("<think>"),
                                     tokenizer.token_id("</think>"), opened=True)
    assert whole.usage.output_tokens_details.reasoning_tokens == final.usage.output_tokens_details.reasoning_tokens
    assert whole.usage.output_tokens_details.reasoning_tokens == expected > 0


# ---- the route's parts, without a server -----------------------------------------------------------------


def test_function_calls_and_outputs_become_chat_turns():
    items = [{"role": "user", "content": "Weather and time?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone": "CET"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}]
    assert chat_messages("Be kind.", items) == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "get_time"}]
    assert chat_messages(None, "Hi") == [{"role": "user", "content": "Hi"}]


def test_flat_tools_and_tool_choice_take_the_chat_shape():
    assert chat_tools([WEATHER]) == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER["parameters"]}}]
    assert chat_tool_choice({"type": "function", "name": "f"}, True) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("auto", False) is None and chat_tool_choice("required", True) == "required"
    with pytest.raises(ApiError) as err:
        chat_tools([WEATHER, {"type": "file_search"}])
    assert err.value.param == "tools[1].type"


def test_output_items_follow_the_parts_in_the_order_written():
    """Reasoning, then text, then two calls: each is its own item, opened and closed in turn; the events'
    deltas add up to the items; a call limit of one drops the second call."""
    for limit, calls in ((None, 2), (1, 1)):
        items = OutputItems(limit)
        events = items.add("think ", "", [], [])
        events += items.add("more", "Hel", [], [])
        events += items.add("", "lo", [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": ""}},
                                       {"index": 0, "function": {"arguments": '{"x": 1}'}}], [])
        events += items.add("", "", [{"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}], [])
        events += items.finish("completed")
        assert [i["type"] for i in items.done] == ["reasoning", "message", *["function_call"] * calls]
        assert items.done[0]["content"][0]["text"] == "think more" and items.done[1]["content"][0]["text"] == "Hello"
        assert [(c["call_id"], c["arguments"], c["status"]) for c in items.done[2:]] == [("call_a", '{"x": 1}', "completed"),
                                                                                       ("call_b", "{}", "completed")][:calls]
        stream = EventStream()
        stream.encode(events)
        for event in events:
            STREAM_EVENT.validate_python(event)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        assert added == list(range(2 + calls))


def test_logprobs_of_tokens_without_text_go_with_the_message():
    """Logprobs of tokens before the first text (reasoning) and after the last (end of sequence) are the message's."""
    items = OutputItems()
    items.add("hm", "", [], [{"token": "hm"}])
    items.add("", "Hi", [], [{"token": "Hi"}])
    items.add("", "", [], [{"token": "</s>"}])
    items.finish("completed")
    assert [lp["token"] for lp in items.done[1]["content"][0]["logprobs"]] == ["hm", "Hi", "</s>"]


def test_an_answer_cut_inside_a_call_marks_it_incomplete_and_an_empty_one_has_an_empty_message():
    items = OutputItems()
    items.add("", "", [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": '{"x": '}}], [])
    items.finish("incomplete")
    assert items.done[0]["status"] == "incomplete" and items.done[0]["arguments"] == '{"x": '
    empty = OutputItems()
    events = empty.finish("completed")
    assert [i["type"] for i in empty.done] == ["message"] and empty.done[0]["content"][0]["text"] == ""
    assert events[0]["type"] == "response.output_item.added"


def test_reasoning_tokens_are_the_tags_and_what_lies_between():
    START, END = 5, 6
    assert reasoning_token_count([5, 1, 2, 6, 3, 4], START, END, opened=False) == 4
    assert reasoning_token_count([1, 2, 6, 3], START, END, opened=True) == 3  # the prompt opened it
    assert reasoning_token_count([1, 6, 2, 5, 3], START, END, opened=False) == 2  # a stray end tag is content
    assert reasoning_token_count([1, 2, 3], START, END, opened=False) == 0
    assert reasoning_token_count([], START, END, opened=True) == 0
