"""The OpenAI-compatible HTTP API of `metrale serve --http-port`, driven by the official `openai` package and by
plain HTTP; every answer is checked against metrale.frontend.client.Client on the same token ids."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.frontend.chat import ChatTemplate
from metrale.frontend.tokenizer import Tokenizer
from metrale.ipc.sampling import SamplingParams

from conftest import expected_kernels
from serve_fixture import http_server, openai_client

MODEL = "tiny-llama-4k"  # the folder's name is the model id
MAX_MODEL_LEN = 4096  # long enough that an unaborted 3,000-token request runs for seconds
PROMPT = "def fibonacci(n):\n    "
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
WAIT_S = 20.0


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a 4k context, in a folder named MODEL."""
    out = tmp_path_factory.mktemp("http") / MODEL
    shutil.copytree(tiny_model_dir("llama", max_position_embeddings=MAX_MODEL_LEN), out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with http_server(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    with openai_client(server, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def zmq_client(server):
    with server.client() as c:
        yield c


def chat_ids(model_dir, tokenizer, messages, **kw) -> list[int]:
    """The token ids the server must run for a chat: the template rendered, tokenized without adding BOS."""
    text = ChatTemplate.load(model_dir, tokenizer).render(messages, **kw)
    return tokenizer.encode(text, add_special_tokens=False)


def http(method: str, url: str, body: object = None, raw: bytes | None = None) -> tuple[int, dict | str]:
    """One plain HTTP request: (status, JSON body, or text when it is not JSON)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def assert_error(status: int, body: object, want_status: int, code: str | None = None, param: str | None = None):
    """An answer in OpenAI's error shape with this status (and code / param when given)."""
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if want_status < 500 else "server_error")
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels): value}."""
    status, text = http("GET", server.http + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until(predicate, timeout: float = WAIT_S):
    """Poll a condition another process changes (no event crosses the process boundary), up to timeout."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return value


# ---- completions ---------------------------------------------------------------------------


def test_completion_equals_the_zmq_client_for_the_same_token_ids(api, zmq_client, tokenizer):
    got = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.0, seed=3)
    ref = zmq_client.complete(token_ids=tokenizer.encode(PROMPT),
                              params=SamplingParams(max_tokens=20, temperature=0.0, seed=3))
    assert got.choices[0].text == ref.text
    assert got.choices[0].finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == ref.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert got.usage.completion_tokens == len(ref.token_ids)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")


def test_streamed_seeded_completion_with_usage(api, zmq_client, tokenizer):
    stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95,
                                    seed=11, stream=True, stream_options={"include_usage": True},
                                    extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    chunks = list(stream)
    ref = zmq_client.complete(token_ids=tokenizer.encode(PROMPT), params=SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, seed=11, top_k=50, min_p=0.01, ignore_eos=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 24 == len(ref.token_ids)


def test_batch_of_prompts_times_n_with_token_id_prompts(api, zmq_client, tokenizer):
    ids = tokenizer.encode("class Stack:")
    got = api.completions.create(model=MODEL, prompt=[PROMPT, ids], n=2, max_tokens=8, temperature=0.7, seed=5,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for c in got.choices:
        prompt_ids = tokenizer.encode(PROMPT) if c.index < 2 else ids
        ref = zmq_client.complete(token_ids=prompt_ids,
                                  params=SamplingParams(max_tokens=8, temperature=0.7, seed=5 + c.index % 2, ignore_eos=True))
        assert c.text == ref.text, c.index
    assert got.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(ids)
    assert got.usage.completion_tokens == 4 * 8


def test_stop_string_and_logprobs_and_penalties(api, zmq_client, tokenizer):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.1, logprobs=2)
    ref = zmq_client.complete(token_ids=tokenizer.encode(PROMPT), params=params)
    stop = ref.text[5:9]
    assert stop
    got = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.0, stop=stop, logprobs=2,
                                 presence_penalty=0.5, frequency_penalty=0.3,
                                 extra_body={"repetition_penalty": 1.1, "ignore_eos": True})
    choice = got.choices[0]
    assert choice.text == ref.text[: ref.text.index(stop)] and choice.finish_reason == "stop"
    n = len(choice.logprobs.token_logprobs)
    # logprobs and text agree: the tokens listed are those whose text the output holds (the token that
    # completed the stop string, whose text was cut, is not listed), though usage counts it.
    tokens = choice.logprobs.tokens
    assert "".join(tokens).startswith(choice.text) and len("".join(tokens[:-1])) < len(choice.text)
    assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs[:n]], abs=1e-4)
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)


# ---- chat -----------------------------------------------------------------------------------


def test_chat_equals_the_zmq_client_for_the_rendered_prompt(api, zmq_client, model_dir, tokenizer):
    got = api.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0.0, seed=1)
    ref = zmq_client.complete(token_ids=chat_ids(model_dir, tokenizer, CHAT),
                              params=SamplingParams(max_tokens=24, temperature=0.0, seed=1))
    message = got.choices[0].message
    assert message.role == "assistant"
    assert (message.model_extra.get("reasoning_content") or "") + message.content == ref.text
    assert got.usage.prompt_tokens == len(chat_ids(model_dir, tokenizer, CHAT))
    assert got.usage.completion_tokens == len(ref.token_ids)
    assert got.choices[0].finish_reason == ref.finish_reason


def test_streamed_chat_n2_with_usage_and_logprobs(api, zmq_client, model_dir, tokenizer):
    stream = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0.8, seed=21, n=2,
                                         logprobs=True, top_logprobs=1, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, logprobs, roles = {0: "", 1: ""}, {0: [], 1: []}, {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            roles.setdefault(c.index, c.delta.role)
            if c.logprobs:
                logprobs[c.index] += [t.logprob for t in c.logprobs.content]
    ids = chat_ids(model_dir, tokenizer, CHAT)
    for j in (0, 1):
        ref = zmq_client.complete(token_ids=ids, params=SamplingParams(
            max_tokens=16, temperature=0.8, seed=21 + j, ignore_eos=True, logprobs=1))
        assert text[j] == ref.text, j
        assert logprobs[j] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)  # batch shapes differ
        assert roles[j] == "assistant"
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 32


def test_reasoning_content_is_split_and_thinking_budget_applies(api, zmq_client, model_dir, tokenizer):
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>"}]
    kw = dict(add_generation_prompt=False, continue_final_message=True)
    body = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0.0,
                extra_body={**kw, "max_thinking_tokens": 3, "ignore_eos": True})
    whole = api.chat.completions.create(**body).choices[0].message
    pieces = list(api.chat.completions.create(**body, stream=True))
    ref = zmq_client.complete(token_ids=chat_ids(model_dir, tokenizer, messages, **kw),
                              params=SamplingParams(max_tokens=12, temperature=0.0, max_thinking_tokens=3, ignore_eos=True))
    assert ref.token_ids[3] == tokenizer.token_id("</think>")  # the budget forced the end of thinking
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and whole.content and "think>" not in reasoning + whole.content
    assert reasoning + whole.content == ref.text
    streamed_reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in pieces)
    streamed_content = "".join(c.choices[0].delta.content or "" for c in pieces)
    assert (streamed_reasoning, streamed_content) == (reasoning, whole.content)


def test_client_disconnect_after_3_chunks_aborts_the_request(api, server):
    before = scrape(server)
    stream = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3000, temperature=0.0, stream=True,
                                         extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert scrape(server)[("metrale_num_requests_running", ())] == 1
    stream.close()
    after = wait_until(lambda: (m := scrape(server))[("metrale_num_requests_running", ())] == 0 and m)
    assert after[("metrale_kv_cache_blocks", (("state", "used"),))] == 0
    assert after[("metrale_kv_cache_usage_ratio", ())] == 0
    abort = ("metrale_requests_total", (("finish_reason", "abort"),))
    assert after[abort] == before[abort] + 1


# ---- models, health, metrics ------------------------------------------------------------------


def test_models_and_health(api, server, model_dir):
    models = api.models.list().data
    assert [m.id for m in models] == [MODEL]
    status, body = http("GET", server.http + "/health")
    assert status == 200 and body["healthy"] is True
    assert {p["name"] for p in body["processes"]} == {"frontend", "engine_core", "gpu_worker"}


def test_metrics_parse_and_counters_move(api, server):
    before = scrape(server)
    api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0.0, extra_body={"ignore_eos": True})
    after = scrape(server)
    length = ("metrale_requests_total", (("finish_reason", "length"),))
    assert after[length] == before[length] + 1
    assert after[("metrale_generation_tokens_total", ())] == before[("metrale_generation_tokens_total", ())] + 7
    assert after[("metrale_prompt_tokens_total", ())] > before[("metrale_prompt_tokens_total", ())]
    ttft = ("metrale_time_to_first_token_seconds_count", ())
    assert after[ttft] == before[ttft] + 1
    itl = ("metrale_inter_token_latency_seconds_count", ())
    assert after[itl] >= before[itl] + 1
    assert after[("metrale_engine_generated_tokens_total", ())] >= before[("metrale_engine_generated_tokens_total", ())] + 7
    for gauge in ("metrale_num_requests_waiting", "metrale_num_requests_swapped", "metrale_prefix_cache_hit_rate",
                  "metrale_preemptions_total"):
        assert (gauge, ()) in after
    assert after[("metrale_process_restarts_total", (("process", "gpu_worker"),))] == 0
    assert after[("metrale_kernels_info", (("kernels", expected_kernels()),))] == 1


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"prompt": "x", "top_p": 3}, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": [10**6]}, "prompt"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "", "content": "an empty role"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages"),
    ("completions", {"prompt": "x", "priority": 2**40}, "priority"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_parameters_are_400(server, route, body, param):
    status, answer = http("POST", f"{server.http}/v1/{route}", body)
    assert_error(status, answer, 400, param=param)


def test_malformed_json_is_400(server):
    status, body = http("POST", server.http + "/v1/completions", raw=b"{not json")
    assert_error(status, body, 400, code="invalid_json")


def test_unknown_model_is_404(server):
    for route, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": CHAT})):
        status, answer = http("POST", f"{server.http}/v1/{route}", {**body, "model": "gpt-4o"})
        assert_error(status, answer, 404, code="model_not_found", param="model")


def test_unknown_route_is_404_in_openai_shape(server):
    status, body = http("GET", server.http + "/v1/nothing-here")
    assert_error(status, body, 404)


def test_too_long_prompts_are_400_context_length_exceeded(server, tokenizer):
    ids = tokenizer.encode(PROMPT) * (MAX_MODEL_LEN // 4)
    status, body = http("POST", server.http + "/v1/completions", {"prompt": ids, "stream": True})
    assert_error(status, body, 400, code="context_length_exceeded", param="prompt")
    long_chat = [{"role": "user", "content": PROMPT * MAX_MODEL_LEN}]
    status, body = http("POST", server.http + "/v1/chat/completions", {"messages": long_chat})
    assert_error(status, body, 400, code="context_length_exceeded", param="messages")


def test_max_tokens_beyond_the_context_is_400_with_the_numbers(server, tokenizer):
    """A prompt that fits but leaves less room than max_tokens asks for is refused (not silently capped)."""
    ids = tokenizer.encode(PROMPT)
    room = MAX_MODEL_LEN - len(ids)
    status, body = http("POST", server.http + "/v1/completions", {"prompt": ids, "max_tokens": room + 1})
    assert_error(status, body, 400, code="context_length_exceeded", param="prompt")
    assert f"{MAX_MODEL_LEN} tokens" in body["error"]["message"] and f"{len(ids)} in the prompt" in body["error"]["message"]
    assert f"{room + 1} in the completion" in body["error"]["message"]
    status, body = http("POST", server.http + "/v1/completions",
                        {"prompt": ids, "max_tokens": 2, "temperature": 0})  # what fits runs
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    long_chat = [{"role": "user", "content": "hi"}]
    status, body = http("POST", server.http + "/v1/chat/completions", {"messages": long_chat, "max_tokens": MAX_MODEL_LEN})
    assert_error(status, body, 400, code="context_length_exceeded", param="messages")


def test_body_over_the_frame_limit_is_413(server):
    status, body = http("POST", server.http + "/v1/completions", {"prompt": "x" * (2 << 20)})
    assert_error(status, body, 413)


# ---- a second server: one sequence at a time, one waiting, no chat template ----------------------


@pytest.fixture(scope="module")
def narrow_server(model_dir, tmp_path_factory):
    plain = tmp_path_factory.mktemp("no-template") / MODEL
    shutil.copytree(model_dir, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    with http_server(plain, "--max-num-seqs", "1", "--max-waiting", "1") as s:
        yield s


def test_chat_without_template_is_400(narrow_server):
    status, body = http("POST", narrow_server.http + "/v1/chat/completions", {"messages": CHAT})
    assert_error(status, body, 400, code="chat_template_missing")
    assert "chat template" in body["error"]["message"]


def test_full_waiting_queue_is_503(narrow_server):
    url = narrow_server.http + "/v1/completions"
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.update(answer=http("POST", url, {"prompt": PROMPT, "max_tokens": 2})))
    with openai_client(narrow_server, timeout=60) as client:
        running = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, stream=True,
                                            extra_body={"ignore_eos": True})
        try:
            next(iter(running))  # it runs: the one sequence slot is taken
            waiter.start()  # the next request waits: the waiting queue is full
            wait_until(lambda: scrape(narrow_server).get(("metrale_num_requests_waiting", ())) == 1)
            status, body = http("POST", url, {"prompt": PROMPT, "max_tokens": 2})
            assert_error(status, body, 503, code="server_busy")
        finally:
            running.close()  # disconnecting aborts it, so the waiting request runs
            if waiter.is_alive():
                waiter.join(WAIT_S)
    assert queued["answer"][0] == 200
