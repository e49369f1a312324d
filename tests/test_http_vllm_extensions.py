"""vLLM's newer OpenAI-server extensions that its own tests (0.33) send, answered as vLLM answers them, through the
official `openai` package on one server of the tiny llama started as those tests start theirs:
--enable-per-request-metrics (a "metrics" object of timings beside the usage), --enable-prompt-tokens-details and
--return-tokens-as-token-ids; and a chat's kv_transfer_params.prompt_token_ids (the prefill stage's tokens, used as
the prompt)."""

from __future__ import annotations

import math
import shutil
import time

import pytest

from serve_fixture import http_server, openai_client
from test_http_api import assert_error, http

MODEL = "tiny-vllm-extensions"
TIMINGS = {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms", "tokens_per_second"}
HELLO = [{"role": "user", "content": "Hello, how are you today?"}]
OTHER = [{"role": "user", "content": "unrelated decode-side text"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("vllm-extensions") / MODEL
    shutil.copytree(tiny_model_dir("llama"), model)
    with http_server(model, "--enable-per-request-metrics", "--enable-prompt-tokens-details",
                     "--return-tokens-as-token-ids") as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    with openai_client(server, timeout=120) as client:
        yield client


# ---- kv_transfer_params.prompt_token_ids --------------------------------------------------------


def test_forwarded_prompt_token_ids_are_the_prompt_not_the_messages(api):
    first = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                        extra_body={"return_token_ids": True})
    ids = first.prompt_token_ids
    decode = api.chat.completions.create(model=MODEL, messages=OTHER, max_tokens=4, temperature=0,
                                         extra_body={"kv_transfer_params": {"prompt_token_ids": ids},
                                                     "return_token_ids": True})
    assert decode.prompt_token_ids == ids and decode.usage.prompt_tokens == len(ids)
    assert decode.choices[0].token_ids
    own = api.chat.completions.create(model=MODEL, messages=OTHER, max_tokens=1, extra_body={"return_token_ids": True})
    assert own.prompt_token_ids != ids  # the messages alone make another prompt


def test_forwarded_prompt_token_ids_streamed(api):
    ids = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                      extra_body={"return_token_ids": True}).prompt_token_ids
    chunks = list(api.chat.completions.create(model=MODEL, messages=OTHER, max_tokens=4, temperature=0, stream=True,
                                              extra_body={"kv_transfer_params": {"prompt_token_ids": ids},
                                                          "return_token_ids": True}))
    assert chunks[0].prompt_token_ids == ids
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids or ()]


@pytest.mark.parametrize("ids", [[10**9], [], "1 2"])
def test_forwarded_prompt_token_ids_that_are_not_the_vocabularys_are_a_400_naming_them(server, ids):
    status, out = http("POST", f"{server.http}/v1/chat/completions",
                       {"model": MODEL, "messages": OTHER, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert_error(status, out, 400, param="kv_transfer_params.prompt_token_ids")


# ---- --enable-per-request-metrics ---------------------------------------------------------------


def _check_timings(metrics: dict, tokens: int) -> None:
    assert metrics.keys() == (TIMINGS if tokens > 1 else TIMINGS - {"mean_itl_ms"}), metrics
    assert all(v >= 0 for v in metrics.values()), metrics
    if tokens > 1:  # the mean gap is the decode time over the gaps
        assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (tokens - 1))


def test_a_whole_answer_carries_its_timings(api):
    out = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                      extra_body={"min_tokens": 4})
    _check_timings(out.model_extra["metrics"], 4)
    text = api.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"min_tokens": 3})
    _check_timings(text.model_extra["metrics"], 3)


def test_a_stream_carries_its_timings_on_the_usage_chunk_only(api):
    chunks = list(api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"min_tokens": 1}))
    assert len(chunks) > 1 and all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    _check_timings(chunks[-1].model_extra["metrics"], 1)


def test_several_choices_carry_no_timings(api):
    out = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=2)
    assert "metrics" not in (out.model_extra or {})


# ---- --enable-prompt-tokens-details -------------------------------------------------------------


def test_prompt_tokens_details_count_the_prefix_cache_hit(api):
    prompt = "the same long prompt " * 8
    api.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = api.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens



# ---- --return-tokens-as-token-ids ---------------------------------------------------------------


def test_logprobs_name_tokens_by_id_unless_the_request_says_not(api):
    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2,
                                 extra_body={"return_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in out.choices[0].token_ids]
    chat = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, logprobs=True, top_logprobs=1)
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
    told = api.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2,
                                  extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in told.choices[0].logprobs.tokens)


def test_each_positions_own_token_is_its_first_listed_alternative(api):
    """vLLM lists a position's token first among its alternatives (clients read the token from the first key); an
    echoed prompt's tokens are mostly not the model's top pick, so the order shows there."""
    out = api.completions.create(model=MODEL, prompt="Say 'Hello, world! 🎉' and more words here", echo=True,
                                 max_tokens=4, temperature=0, logprobs=1)
    logprobs = out.choices[0].logprobs
    tops = logprobs.top_logprobs[1:]
    assert [next(iter(t)) for t in tops] == logprobs.tokens[1:]
    assert any(len(t) == 2 for t in tops)  # some token was not the top pick: listed beside it, after it


# ---- allowed_token_ids and logprob_token_ids (vLLM's test_logprob_token_ids.py shapes) -------------------------


def _id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def test_allowed_token_ids_hold_every_sampled_token_among_them(api):
    allowed = [7, 19, 300, 301]
    chat = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, seed=5,
                                       extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                                   "ignore_eos": True})
    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0.8, seed=5, stream=True,
                                 extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                             "ignore_eos": True})
    streamed = [t for chunk in out for t in chunk.choices[0].model_extra["token_ids"] or ()]
    for ids in (chat.choices[0].token_ids, streamed):
        assert len(ids) == 12 and set(ids) <= set(allowed)
    assert len(set(streamed)) > 1  # sampled: the mask leaves a choice, it does not force one token


@pytest.mark.parametrize("asked, sampled", [([50], 42), ([100, 1000, 500], 42), ([100, 1000, 500], 500)])
def test_logprob_token_ids_list_the_token_and_those_ids_with_finite_logprobs(api, asked, sampled):
    """vLLM's test: the only allowed id is the pick, and its alternatives are the asked ids and itself, each a finite
    logprob of the raw distribution (the mask changes the pick, not the logprobs). The server lists 20 alternatives
    at most (--max-logprobs): the engine reports the asked ids' logprobs, not the whole vocabulary's."""
    extra = {"logprob_token_ids": asked, "allowed_token_ids": [sampled]}
    chat = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body=extra)
    token = chat.choices[0].logprobs.content[0]
    assert _id(token.token) == sampled
    assert [_id(e.token) for e in token.top_logprobs] == [sampled, *(i for i in asked if i != sampled)]
    assert all(math.isfinite(e.logprob) and e.logprob < 0 for e in token.top_logprobs)
    for stream in (False, True):
        out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0, logprobs=5,
                                     stream=stream, extra_body=extra)
        chunks = out if stream else [out]
        tops = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs or ()]
        assert len(tops) == 1 and {_id(k) for k in tops[0]} == {*asked, sampled}
        assert all(math.isfinite(v) for v in tops[0].values())


def test_logprob_token_ids_are_the_logprobs_the_top_n_gives_them(api):
    top = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0, logprobs=True,
                                      top_logprobs=5)
    for position, entry in enumerate(top.choices[0].logprobs.content):
        of = {_id(e.token): e.logprob for e in entry.top_logprobs}
        asked = list(of)[::-1]  # another order than the ranking's
        pinned = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0, logprobs=True,
                                             extra_body={"logprob_token_ids": asked})
        listed = pinned.choices[0].logprobs.content[position].top_logprobs
        token = _id(entry.token)
        assert [_id(e.token) for e in listed] == [token, *(i for i in asked if i != token)]
        assert [e.logprob for e in listed[1:]] == pytest.approx([of[i] for i in asked if i != token], abs=1e-5)


def test_bad_words_are_never_generated(server, api):
    """A word the logit_bias makes the pick at every step (both spellings: alone and after a space) is never
    generated once it is a bad word; the frontend tokenizes it as vLLM does."""
    ids = {t for text in ("the", " the") for t in http("POST", f"{server.http}/tokenize",
                                                         {"prompt": text, "add_special_tokens": False})[1]["tokens"]}
    bias = {str(t): 100 for t in ids}
    kw = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logit_bias=bias)
    free = api.completions.create(**kw, extra_body={"return_token_ids": True})
    assert set(free.choices[0].token_ids) <= ids
    banned = api.completions.create(**kw, extra_body={"return_token_ids": True, "bad_words": ["the"]})
    chat = api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logit_bias=bias,
                                       stream=True, extra_body={"return_token_ids": True, "bad_words": [" the"]})
    streamed = [t for chunk in chat if chunk.choices for t in chunk.choices[0].model_extra["token_ids"] or ()]
    for out in (banned.choices[0].token_ids, streamed):
        assert len(out) == 6 and not set(out) & ids


@pytest.mark.parametrize("field, value, words", [
    ("allowed_token_ids", [], "1 to"),
    ("allowed_token_ids", [3, 10**7], "vocabulary"),
    ("logprob_token_ids", list(range(21)), "1 to 20 distinct"),
    ("bad_words", ["  "], "non-empty"),
    ("bad_words", [f"w{i}" for i in range(30)], "at most 24"),
])
def test_token_id_lists_that_cannot_be_served_are_a_400_naming_them(server, field, value, words):
    for route, body in (("chat/completions", {"messages": HELLO, "logprobs": True}),
                        ("completions", {"prompt": "Hello", "logprobs": 1})):
        status, out = http("POST", f"{server.http}/v1/{route}", {"model": MODEL, "max_tokens": 1, **body,
                                                                 field: value})
        assert_error(status, out, 400, param=field)
        assert words in out["error"]["message"]


# ---- fields the server does not know ------------------------------------------------------------


def test_an_unknown_field_is_ignored_with_a_warning_naming_it(server, api):
    out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body={"vllm_xargs_unheard_of": 1})
    assert out.choices[0].finish_reason in ("stop", "length")
    assert _log_says(server, "ignored: {'vllm_xargs_unheard_of'}")  # that field alone: the known ones are not named


def _log_says(server, words: str, timeout_s: float = 10.0) -> bool:
    """Whether the server's log says `words` within timeout_s (the frontend writes it before the answer goes, but
    through its own process's buffered stream)."""
    deadline = time.monotonic() + timeout_s
    while words not in server.log():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling a file another process writes; no event to wait on
    return True
