"""Beam search over HTTP (`use_beam_search`, frontend/http_beam.py) against LLM.beam_search on the same tiny model
folders: the same hypotheses, token for token and in the same order, on /v1/completions and /v1/chat/completions,
through plain HTTP and the official `openai` client; the fields it cannot honour refused with a 400 naming them;
a client that leaves mid-search leaving nothing running.

Two servers: a llama with a 24-token vocabulary, whose eos ids are often among a round's best candidates (so
hypotheses end at many lengths, and length_penalty and early_stopping decide what is returned; its prompts are token
ids, since text tokenizes outside its vocabulary), and the tiny llama with its whole vocabulary for text and chat.
"""

from __future__ import annotations

import json
import random
import shutil
from http.client import HTTPConnection

import pytest

from metrale import LLM, BeamSearchParams
from metrale.frontend.chat import ChatTemplate
from metrale.frontend.tokenizer import Tokenizer

from serve_fixture import http_server, openai_client
from test_http_api import assert_error, http, scrape, wait_until

SMALL_VOCAB = 24
SMALL = "tiny-beams-24"
LLAMA = "tiny-beams"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Random token-id prompts inside the small vocabulary (test_beam_search.py's)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, SMALL_VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _serve(model_dir):
    with http_server(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def small_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("beams") / SMALL
    shutil.copytree(tiny_model_dir("llama", vocab_size=SMALL_VOCAB), out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("beams") / LLAMA
    shutil.copytree(tiny_model_dir("llama"), out)
    return out


@pytest.fixture(scope="module")
def small_server(small_dir):
    yield from _serve(small_dir)


@pytest.fixture(scope="module")
def llama_server(llama_dir):
    yield from _serve(llama_dir)


@pytest.fixture(scope="module")
def small_llm(small_dir):
    with LLM(str(small_dir), show_progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def llama_llm(llama_dir):
    with LLM(str(llama_dir), show_progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def api(llama_server):
    with openai_client(llama_server, timeout=120) as client:
        yield client


def beam_body(n: int, max_tokens: int | None, **fields) -> dict:
    """A beam search request's fields, token ids returned."""
    return {"use_beam_search": True, "n": n, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            **fields}


def assert_choices_equal(choices: list[dict], prompts: list[list[int]], outputs, n: int, text_of=None) -> None:
    """Prompt p's choices p*n .. p*n+n-1 are its offline hypotheses, best first: ids, text, finish_reason."""
    assert [c["index"] for c in choices] == list(range(len(prompts) * n))
    text_of = text_of or (lambda c: c["text"])
    for p, out in enumerate(outputs):
        mine = choices[p * n:(p + 1) * n]
        assert [c["token_ids"] for c in mine] == [s.output_ids for s in out.sequences]
        assert [text_of(c) for c in mine] == [s.text for s in out.sequences]
        assert [c["finish_reason"] for c in mine] == [s.finish_reason for s in out.sequences]


def assert_usage(answer: dict, prompts: list[list[int]]) -> None:
    """Each prompt counted once; the returned choices' tokens."""
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in answer["choices"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def finished_early(outputs, max_tokens: int) -> int:
    """How many hypotheses ended in an eos before max_tokens."""
    return sum(s.finish_reason == "stop" and len(s.output_ids) < max_tokens for o in outputs for s in o.sequences)


# ---- the same hypotheses as LLM.beam_search -------------------------------------------------------------------


@pytest.mark.parametrize("n,max_tokens,length_penalty,early_stopping,include_eos", [
    (1, 16, 1.0, False, True),
    (3, 10, 1.0, False, False),
    (3, 10, 0.0, False, True),
    (3, 10, 2.0, False, False),
    (3, 12, 1.5, True, True),
    (3, 12, 1.5, "never", False),
])
def test_completions_equal_llm_beam_search(small_server, small_llm, n, max_tokens, length_penalty, early_stopping,
                                           include_eos):
    """Several token-id prompts in one request: each prompt's n choices are LLM.beam_search's hypotheses, in order."""
    prompts = _prompts(4, seed=2) if early_stopping is False else _prompts(6, seed=5)
    params = BeamSearchParams(n, max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                              include_stop_str_in_output=include_eos)
    outputs = small_llm.beam_search(prompts, params)
    status, answer = http("POST", small_server.http + "/v1/completions", {"prompt": prompts, **beam_body(
        n, max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
        include_stop_str_in_output=include_eos)})
    assert status == 200, answer
    assert_choices_equal(answer["choices"], prompts, outputs, n)
    assert_usage(answer, prompts)


def test_the_parameters_change_the_offline_hypotheses(small_llm):
    """What the test above compares is decided by its fields: eos ends hypotheses early, and the length penalty
    and each early-stopping mode return hypotheses another value does not."""
    prompts = _prompts(4, seed=2)

    def ids(prompts, **kw):
        outputs = small_llm.beam_search(prompts, BeamSearchParams(**kw))
        return outputs, [[s.output_ids for s in o.sequences] for o in outputs]

    outputs, _ = ids(prompts, beam_width=3, max_tokens=10)
    assert finished_early(outputs, 10) > 0
    assert ids(prompts, beam_width=3, max_tokens=10, length_penalty=0.0)[1] != ids(
        prompts, beam_width=3, max_tokens=10, length_penalty=2.0)[1]
    prompts = _prompts(6, seed=5)
    modes = {m: ids(prompts, beam_width=3, max_tokens=12, length_penalty=1.5, early_stopping=m)[1]
             for m in (False, True, "never")}
    assert modes[True] != modes[False] and modes["never"] != modes[False]


def test_width_1_is_greedy(small_server):
    """n=1 is greedy decoding: the ids of a temperature-0 request, its eos included with include_stop_str_in_output."""
    prompts = _prompts(4, seed=1)
    status, greedy = http("POST", small_server.http + "/v1/completions",
                          {"prompt": prompts, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
    assert status == 200
    status, beams = http("POST", small_server.http + "/v1/completions",
                         {"prompt": prompts, **beam_body(1, 16, include_stop_str_in_output=True)})
    assert status == 200, beams
    assert [c["token_ids"] for c in beams["choices"]] == [c["token_ids"] for c in greedy["choices"]]
    assert [c["finish_reason"] for c in beams["choices"]] == [c["finish_reason"] for c in greedy["choices"]]
    assert "stop" in [c["finish_reason"] for c in greedy["choices"]]


def test_text_completion_through_the_openai_client(api, llama_llm):
    """A text prompt, tokenized as the engine path does, through `openai` with extra_body."""
    prompt = "def fibonacci(n):\n    "
    outputs = llama_llm.beam_search([prompt], BeamSearchParams(3, 12, length_penalty=0.5))
    out = api.completions.create(model=LLAMA, prompt=prompt, n=3, max_tokens=12, temperature=0,
                                 extra_body={"use_beam_search": True, "length_penalty": 0.5, "return_token_ids": True})
    choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                "token_ids": c.model_extra["token_ids"]} for c in out.choices]
    ids = llama_llm.tokenizer.encode(prompt)
    assert_choices_equal(choices, [ids], outputs, 3)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == sum(len(c["token_ids"]) for c in choices)


def test_chat_equals_llm_beam_search_over_the_rendered_template(api, llama_llm, llama_dir):
    """The prompt is the chat template rendered (tokenized without special tokens added), as the chat route's."""
    tokenizer = Tokenizer.from_dir(llama_dir)
    ids = tokenizer.encode(ChatTemplate.load(llama_dir, tokenizer).render(CHAT, add_generation_prompt=True),
                           add_special_tokens=False)
    outputs = llama_llm.beam_search([ids], BeamSearchParams(3, 10, length_penalty=2.0, early_stopping=True))
    out = api.chat.completions.create(model=LLAMA, messages=CHAT, n=3, max_completion_tokens=10, temperature=0,
                                      extra_body={"use_beam_search": True, "length_penalty": 2.0,
                                                  "early_stopping": True, "return_token_ids": True})
    assert out.object == "chat.completion"
    choices = [{"index": c.index, "finish_reason": c.finish_reason, "token_ids": c.model_extra["token_ids"],
                "content": c.message.content, "reasoning": c.message.model_extra.get("reasoning")} for c in out.choices]
    # The chat route splits reasoning off the text; the offline text is the whole decode.
    assert_choices_equal(choices, [ids], outputs, 3, text_of=lambda c: (c["reasoning"] or "") + c["content"])
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == sum(len(c["token_ids"]) for c in choices)


def test_logprobs_come_in_each_routes_shape(small_server, llama_server, small_llm):
    """logprobs list each returned token with the top-N asked for, more than the search itself needs (2n)."""
    prompts = _prompts(2, seed=2)
    outputs = small_llm.beam_search(prompts, BeamSearchParams(2, 10))
    status, answer = http("POST", small_server.http + "/v1/completions",
                          {"prompt": prompts, **beam_body(2, 10, logprobs=6)})
    assert status == 200, answer
    assert_choices_equal(answer["choices"], prompts, outputs, 2)
    for c, seq in zip(answer["choices"], [s for o in outputs for s in o.sequences]):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(c["token_ids"])
        assert lp["token_logprobs"] == pytest.approx([t.logprob for t in seq.logprobs], abs=1e-4)
        assert all(len(top) == 6 for top in lp["top_logprobs"])
        # The offline search's 2n alternatives are the best of the 6.
        for top, t in zip(lp["top_logprobs"], seq.logprobs):
            assert sorted(top.values(), reverse=True)[:4] == pytest.approx(t.top_logprobs, abs=1e-4)
    status, chat = http("POST", llama_server.http + "/v1/chat/completions",
                        {"messages": CHAT, **beam_body(2, 6, logprobs=True, top_logprobs=3)})
    assert status == 200, chat
    for c in chat["choices"]:
        content = c["logprobs"]["content"]
        assert len(content) == len(c["token_ids"]) and all(len(t["top_logprobs"]) == 3 for t in content)


# ---- streams --------------------------------------------------------------------------------------------------


def sse(url: str, body: dict) -> list[dict]:
    """A streamed request's chunks (the data lines before [DONE])."""
    status, text = _post_raw(url, body)
    assert status == 200, text
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _post_raw(url: str, body: dict) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    conn = HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/" + url.split("/", 3)[3], json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_stream_sends_the_final_beams_as_the_whole_answer(llama_server, route):
    """stream: true (vLLM streams the final beams at the end): the chunks add up to the whole answer, usage last."""
    body = {"prompt": "def sort(xs):"} if route == "completions" else {"messages": CHAT}
    body |= beam_body(3, 8, length_penalty=0.5)
    status, whole = http("POST", f"{llama_server.http}/v1/{route}", body)
    assert status == 200, whole
    chunks = sse(f"{llama_server.http}/v1/{route}", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    texts, ids, reasons = ["" for _ in range(3)], [[] for _ in range(3)], [None] * 3
    for chunk in chunks[:-1]:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"] if route == "completions" else c["delta"].get("content") or ""
            ids[c["index"]] += c["token_ids"]
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    content = [c["text"] if route == "completions" else c["message"]["content"] for c in whole["choices"]]
    assert texts == content
    assert ids == [c["token_ids"] for c in whole["choices"]]
    assert reasons == [c["finish_reason"] for c in whole["choices"]]


# ---- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route,fields,param", [
    ("completions", {"temperature": 0.7}, "temperature"),
    ("chat/completions", {"temperature": 1.0}, "temperature"),
    ("completions", {"top_p": 0.9}, "top_p"),
    ("completions", {"top_k": 5}, "top_k"),
    ("completions", {"min_p": 0.1}, "min_p"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("chat/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("completions", {"stop": ["\n"]}, "stop"),
    ("chat/completions", {"stop": "x"}, "stop"),
    ("completions", {"stop_token_ids": [7]}, "stop_token_ids"),
    ("chat/completions", {"max_thinking_tokens": 4}, "max_thinking_tokens"),
    ("completions", {"adaptive_sampling": True}, "adaptive_sampling"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("completions", {"n": 11}, "n"),
    ("chat/completions", {"n": 11}, "n"),
    ("completions", {"best_of": 4}, "best_of"),
    ("completions", {"early_stopping": "always"}, "early_stopping"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"max_tokens": 600}, "prompt"),
    ("chat/completions", {"max_tokens": 600}, "messages"),
])
def test_what_beam_search_cannot_honour_is_400_naming_it(llama_server, route, fields, param):
    body = {"prompt": "x"} if route == "completions" else {"messages": CHAT}
    status, answer = http("POST", f"{llama_server.http}/v1/{route}", {**body, **beam_body(2, 4), **fields})
    assert_error(status, answer, 400, param=param)


@pytest.mark.parametrize("fields,param", [
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
])
def test_beam_search_fields_without_use_beam_search_are_400(llama_server, fields, param):
    status, answer = http("POST", llama_server.http + "/v1/completions", {"prompt": "x", "max_tokens": 2, **fields})
    assert_error(status, answer, 400, param=param)


def test_neutral_sampling_values_and_a_seed_are_accepted(llama_server):
    """What leaves the search unchanged is no reason to refuse: temperature 0, top_p 1, top_k -1, a seed, best_of n,
    vLLM's defaults for the beam fields."""
    body = {"prompt": "x", **beam_body(2, 4), "top_p": 1.0, "top_k": -1, "seed": 7, "best_of": 2,
            "length_penalty": 1.0, "early_stopping": False, "stop": []}
    status, answer = http("POST", llama_server.http + "/v1/completions", body)
    assert status == 200, answer
    assert len(answer["choices"]) == 2


# ---- disconnects ----------------------------------------------------------------------------------------------


def _finished(server) -> float:
    """Requests the server has finished so far, whatever their reason (each prompt's search is one)."""
    return sum(v for (name, _), v in scrape(server).items() if name == "metrale_requests_total")


def test_a_client_that_leaves_mid_search_leaves_nothing_running(llama_server):
    """Closing the connection while the search runs stops it: the engine ends with nothing running and no KV block
    used; the search ended as one request (aborted); and it makes none afterwards (a search run after it makes as
    many requests as the same search made before it)."""
    probe = {"prompt": "x", **beam_body(2, 4, ignore_eos=True)}
    at = _finished(llama_server)
    status, answer = http("POST", llama_server.http + "/v1/completions", probe)
    assert status == 200 and len(answer["choices"]) == 2
    per_probe = _finished(llama_server) - at
    before = _finished(llama_server)
    port = int(llama_server.http.rsplit(":", 1)[1])
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    # Up to the model's length with no eos: hundreds of steps of four beams.
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", **beam_body(4, None, ignore_eos=True)}),
                 {"Content-Type": "application/json"})
    wait_until(lambda: http("GET", llama_server.http + "/load")[1]["server_load"] >= 1)
    conn.close()
    wait_until(lambda: http("GET", llama_server.http + "/load")[1]["server_load"] == 0)
    after = wait_until(lambda: (m := scrape(llama_server))[("metrale_num_requests_running", ())] == 0 and m)
    assert after[("metrale_kv_cache_blocks", (("state", "used"),))] == 0
    made = _finished(llama_server) - before
    assert made == 1  # one request per prompt's search (the rounds of old made about 4 * max_len)
    # The search stopped: the server goes on serving beam searches, and nothing else finishes meanwhile.
    at = _finished(llama_server)
    status, answer = http("POST", llama_server.http + "/v1/completions", probe)
    assert status == 200 and len(answer["choices"]) == 2
    assert _finished(llama_server) - at == per_probe
