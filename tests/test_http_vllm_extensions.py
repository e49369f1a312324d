"""vLLM's newer OpenAI-server extensions that its own tests (0.33) send, answered as vLLM answers them, through the
official `openai` package on one server of the tiny llama started as those tests start theirs:
--enable-per-request-metrics (a "metrics" object of timings beside the usage), --enable-prompt-tokens-details and
--return-tokens-as-token-ids; and a chat's kv_transfer_params.prompt_token_ids (the prefill stage's tokens, used as
the prompt)."""

from __future__ import annotations

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
