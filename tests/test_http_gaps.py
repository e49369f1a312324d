"""The rows of issue 28's "gaps found by a peer's API tests": each answer as vLLM (or OpenAI) gives it, through the
official `openai` package or plain HTTP, on one server of the tiny llama (its text is random; the checks are about
shapes, counts and offsets)."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import openai
import pytest

from metrale.frontend.tokenizer import Tokenizer

from serve_fixture import http_server, openai_client
from test_http_api import assert_error, http

MODEL = "tiny-gaps"
CHAT = [{"role": "user", "content": "Sort a list."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
EMPTY_OUTPUT = {"grammar": 'root ::= ""'}  # a grammar whose only output is end-of-sequence


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gaps") / MODEL
    shutil.copytree(tiny_model_dir("llama"), out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with http_server(model_dir, "--enable-force-include-usage") as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    with openai_client(server, timeout=60) as client:
        yield client


def sse(url: str, body: dict) -> list[dict]:
    """A streamed request's chunks (the data lines before [DONE])."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [line.decode().strip() for line in resp]
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---- 1: logit_bias ----------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_logit_bias_names_an_id_outside_the_vocabulary(server, tokenizer, route):
    body = {"prompt": "x"} if route == "completions" else {"messages": CHAT}
    bad = str(tokenizer.vocab_size + 5)
    status, answer = http("POST", f"{server.http}/v1/{route}", {**body, "logit_bias": {"1": 5, bad: -5}})
    assert_error(status, answer, 400, param="logit_bias")
    assert bad in answer["error"]["message"]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_logit_bias_plus_100_makes_its_token_every_greedy_pick(api, tokenizer):
    token = tokenizer.encode(" hello")[-1]
    bias = {str(token): 100}
    extra = {"return_token_ids": True, "ignore_eos": True}
    out = api.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0, logit_bias=bias, extra_body=extra)
    assert _ids(out.choices[0]) == [token] * 5
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logit_bias=bias,
                                       extra_body=extra)
    assert _ids(chat.choices[0]) == [token] * 5
    sampled = api.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=1.0, seed=3, logit_bias=bias,
                                     extra_body=extra)
    assert _ids(sampled.choices[0]) == [token] * 5


def test_logit_bias_minus_100_bans_a_token_and_logprobs_stay_raw(api):
    extra = {"return_token_ids": True, "ignore_eos": True}
    plain = api.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0, logprobs=2, extra_body=extra)
    first = _ids(plain.choices[0])[0]
    banned = api.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0, logprobs=1,
                                    logit_bias={str(first): -100}, extra_body=extra)
    ids = _ids(banned.choices[0])
    assert first not in ids and len(ids) == 6
    # The ban leaves the raw distribution's second choice as the first greedy pick, and its logprob is the raw one:
    # the number the unbiased request reports for that token among its top 2.
    second = min(plain.choices[0].logprobs.top_logprobs[0].values())
    assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(second, abs=1e-5)


def test_logit_bias_leaves_the_other_requests_of_a_batch_alone(api, tokenizer):
    """Greedy requests without a bias answer the same while biased ones run beside them (batch invariance)."""
    from concurrent.futures import ThreadPoolExecutor

    extra = {"return_token_ids": True, "ignore_eos": True}
    alone = _ids(api.completions.create(model=MODEL, prompt="Sort a list", max_tokens=8, temperature=0,
                                        extra_body=extra).choices[0])
    token = tokenizer.encode(" hello")[-1]

    def run(biased: bool) -> list[int]:
        bias = {str(token): 100} if biased else None
        out = api.completions.create(model=MODEL, prompt="Sort a list", max_tokens=8, temperature=0, logit_bias=bias,
                                     extra_body=extra)
        return _ids(out.choices[0])

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(run, [False, True] * 3))
    assert answers[0::2] == [alone] * 3 and answers[1::2] == [[token] * 8] * 3


def test_logit_bias_over_zmq(server, tokenizer):
    """The ZeroMQ protocol's SamplingParams.logit_bias (integer keys) steers the picks as over HTTP; a bad id is a
    bad_request naming logit_bias."""
    from metrale.frontend.client import RequestError
    from metrale.ipc.sampling import SamplingParams

    token = tokenizer.encode(" hello")[-1]
    with server.client(timeout=60) as client:
        done = client.complete("x", params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                          logit_bias={token: 100.0}))
        assert done.token_ids == [token] * 4
        with pytest.raises(RequestError) as err:
            client.complete("x", params=SamplingParams(max_tokens=4, logit_bias={tokenizer.vocab_size: 1.0}))
        assert err.value.code == "bad_request" and "logit_bias" in err.value.message


@pytest.mark.parametrize("bias, says", [({"1": 101}, "[-100, 100]"), ({str(i): 1 for i in range(301)}, "at most 300")])
def test_logit_bias_out_of_range_or_too_many_ids_is_a_400(server, bias, says):
    status, answer = http("POST", f"{server.http}/v1/completions", {"prompt": "x", "logit_bias": bias})
    assert_error(status, answer, 400, param="logit_bias")
    assert says in answer["error"]["message"]


# ---- 4: GET /v1/models/{id} -------------------------------------------------------------------


def test_models_retrieve_gives_the_card_and_404_for_an_unknown_id(api, model_dir):
    card = api.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "metrale")
    assert api.models.retrieve(str(model_dir)).id == str(model_dir)  # the folder's path names it too
    with pytest.raises(openai.NotFoundError) as err:
        api.models.retrieve("no-such-model")
    assert "does not exist" in err.value.message


# ---- 5, 6: logprobs: text offsets, end-of-sequence ---------------------------------------------


def test_text_offsets_point_into_the_returned_text(api, tokenizer):
    # A choice of text with a character of several byte tokens: each token's offset is where its text starts.
    want = "\U0001f4a1\n\nI'm excited to help"
    out = api.completions.create(model=MODEL, prompt="Say it:", max_tokens=40, temperature=0, logprobs=0,
                                 extra_body={"structured_outputs": {"choice": [want]}, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == want
    ids = choice.model_extra["token_ids"]
    offsets = choice.logprobs.text_offset
    assert len(offsets) == len(ids) and any("\ufffd" in tokenizer.decode([t]) for t in ids)  # a split character
    for i, (t, off) in enumerate(zip(ids, offsets)):
        assert off == len(tokenizer.decode(ids[:i]).rstrip("\ufffd"))
        token = tokenizer.decode([t])
        if "\ufffd" not in token and not tokenizer.decode([t], skip_special_tokens=True) == "":
            assert want[off:off + len(token)] == token
    streamed = [c.choices[0].logprobs.text_offset for c in api.completions.create(
        model=MODEL, prompt="Say it:", max_tokens=40, temperature=0, logprobs=0, stream=True,
        extra_body={"structured_outputs": {"choice": [want]}}) if c.choices and c.choices[0].logprobs]
    assert [o for piece in streamed for o in piece] == offsets


def test_an_end_of_sequence_only_choice_lists_its_token(api, tokenizer):
    out = api.completions.create(model=MODEL, prompt="x", max_tokens=5, logprobs=0, n=3, temperature=1, seed=42,
                                 extra_body={"structured_outputs": EMPTY_OUTPUT})
    eos = tokenizer.decode([tokenizer.eos_token_ids[0]], skip_special_tokens=False)
    assert out.usage.completion_tokens == 3
    for choice in out.choices:
        assert (choice.text, choice.finish_reason) == ("", "stop")
        assert choice.logprobs.tokens == [eos] and choice.logprobs.text_offset == [0]
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True,
                                       extra_body={"structured_outputs": EMPTY_OUTPUT})
    assert [t.token for t in chat.choices[0].logprobs.content] == [eos]


# ---- 7, 12: tool calls ------------------------------------------------------------------------


def test_a_tool_call_cut_by_max_tokens_is_not_a_call(api):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        out = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[TOOL], tool_choice=choice,
                                          max_completion_tokens=1)
        message = out.choices[0]
        assert message.finish_reason == "length"
        # vLLM's test: tool_calls absent, content empty ("", as beside any required or named call)
        assert message.message.tool_calls is None and message.message.content == ""


def test_a_streamed_named_call_has_one_entry_per_index_per_chunk(api):
    chunks = list(api.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_completion_tokens=60, stream=True, temperature=0))  # greedy: xgrammar's JSON strings admit raw control
    # characters, which a random draw of this tiny model hits (about 1 in 7), and json.loads refuses
    entries = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert entries and all(len({e.index for e in es}) == len(es) for es in entries)
    assert entries[0][0].function.name == "get_weather" and entries[0][0].id
    arguments = "".join(e.function.arguments or "" for es in entries for e in es)
    assert json.loads(arguments)["city"] is not None  # every piece read from tool_calls[0] makes the whole text


# ---- 8, 9: stream_options and usage -----------------------------------------------------------


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_stream_options_without_stream_is_400(server, route):
    body = {"prompt": "x"} if route == "completions" else {"messages": CHAT}
    status, answer = http("POST", f"{server.http}/v1/{route}", {**body, "stream_options": {"include_usage": True}})
    assert_error(status, answer, 400, param="stream_options")


def test_continuous_usage_stats_on_every_chunk(server):
    chunks = sse(server.http + "/v1/completions", {"prompt": "def f(", "max_tokens": 6, "temperature": 0,
                 "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    counted = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert counted == sorted(counted) and counted[-1] == chunks[-1]["usage"]["completion_tokens"] == 6


def test_force_include_usage_ends_every_stream_with_usage(server):
    chunks = sse(server.http + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


# ---- 10: vLLM's extensions --------------------------------------------------------------------


def test_return_token_ids_and_truncate_prompt_tokens(api, tokenizer):
    prompt = "def fibonacci(n): return n"
    ids = tokenizer.encode(prompt)
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                 extra_body={"return_token_ids": True, "truncate_prompt_tokens": 3})
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids[-3:] and out.usage.prompt_tokens == 3
    assert len(choice["token_ids"]) == out.usage.completion_tokens
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens


def test_return_tokens_as_token_ids_names_logprobs_by_id(api):
    out = api.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logprobs=1,
                                 extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    ids = out.choices[0].model_extra["token_ids"]
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]


@pytest.mark.parametrize("route,field,fields", [
    ("completions", "prompt_logprobs", {"prompt_logprobs": 1, "stream": True}),  # served in whole answers only
    ("completions", "truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("completions", "bad_words", {"bad_words": ["x"], "use_beam_search": True, "n": 2}),  # a search bans nothing
    ("completions", "allowed_token_ids", {"allowed_token_ids": []}),  # served, but an empty set allows nothing
    ("chat/completions", "allowed_token_ids", {"allowed_token_ids": [1], "use_beam_search": True, "n": 2}),
])
def test_unserved_extensions_are_400_naming_them(server, route, field, fields):
    body = {"prompt": "x"} if route == "completions" else {"messages": CHAT}
    status, answer = http("POST", f"{server.http}/v1/{route}", {**body, **fields})
    assert_error(status, answer, 400, param=field)


def test_echo_with_logprobs_and_prompt_logprobs_are_served(server, tokenizer):
    """Once refused: now each prompt token is listed (tests/test_http_prompt_logprobs.py checks the numbers)."""
    ids = tokenizer.encode("Sort a list")
    status, answer = http("POST", server.http + "/v1/completions", {"prompt": "Sort a list", "echo": True,
                                                                   "logprobs": 1, "max_tokens": 0})
    assert status == 200 and answer["choices"][0]["text"] == "Sort a list"
    assert len(answer["choices"][0]["logprobs"]["tokens"]) == len(ids)
    status, answer = http("POST", server.http + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                                        "prompt_logprobs": 0})
    assert status == 200 and answer["prompt_logprobs"][0] is None
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]


# ---- 11: lax values ---------------------------------------------------------------------------


def test_logprobs_as_a_string_and_top_logprobs_minus_one(server):
    status, answer = http("POST", server.http + "/v1/chat/completions",
                          {"messages": CHAT, "max_tokens": 2, "logprobs": "true", "top_logprobs": 2})
    assert status == 200 and len(answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    # -1 is the whole vocabulary, which is over the server's 20: vLLM's answer, word for word
    status, answer = http("POST", server.http + "/v1/chat/completions",
                          {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": -1})
    assert_error(status, answer, 400, param="logprobs")
    assert "greater than max allowed: 20" in answer["error"]["message"]


# ---- 13: media type ---------------------------------------------------------------------------


def test_a_form_encoded_body_is_415(server):
    req = urllib.request.Request(server.http + "/v1/completions", data=json.dumps({"prompt": "x"}).encode(),
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 415
    assert json.loads(err.value.read())["error"]["code"] == "unsupported_media_type"


# ---- 14: vLLM's other routes ------------------------------------------------------------------


def test_version_ping_and_load(server):
    status, answer = http("GET", server.http + "/version")
    assert status == 200 and isinstance(answer["version"], str)
    for method in ("GET", "POST"):
        assert http(method, server.http + "/ping") == (200, "")
    status, answer = http("GET", server.http + "/load")
    assert status == 200 and answer == {"server_load": 0}


def test_tokenize_and_detokenize(server, tokenizer, model_dir):
    from metrale.frontend.chat import ChatTemplate

    status, answer = http("POST", server.http + "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                                             "return_token_strs": True})
    ids = tokenizer.encode("Hello world")
    assert status == 200 and answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["max_model_len"] > 0 and len(answer["token_strs"]) == len(ids)
    rendered = ChatTemplate.load(model_dir, tokenizer).render(CHAT)
    status, answer = http("POST", server.http + "/tokenize", {"messages": CHAT})
    assert status == 200 and answer["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert answer["token_strs"] is None
    status, answer = http("POST", server.http + "/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and answer == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
    status, answer = http("POST", server.http + "/detokenize", {"tokens": [10**7]})
    assert_error(status, answer, 400, param="tokens")


def test_invocations_routes_by_the_body(server):
    status, answer = http("POST", server.http + "/invocations", {"messages": CHAT, "max_tokens": 2})
    assert status == 200 and answer["object"] == "chat.completion"
    status, answer = http("POST", server.http + "/invocations", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and answer["object"] == "text_completion"
    status, answer = http("POST", server.http + "/invocations", {"input": "x"})
    assert_error(status, answer, 400)


# ---- 15: reasoning ----------------------------------------------------------------------------


def test_reasoning_is_also_returned_as_reasoning(api):
    messages = [{"role": "user", "content": "Think first."}]
    out = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"choice": ["<think>hmm</think>ok"]}})
    message = out.choices[0].message.model_extra
    assert message["reasoning"] == message["reasoning_content"] == "hmm"
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              stream=True,
                                              extra_body={"structured_outputs": {"choice": ["<think>hmm</think>ok"]}}))
    deltas = [c.choices[0].delta.model_extra for c in chunks if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "hmm"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
