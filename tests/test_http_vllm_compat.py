"""The rows of issue 35's "API gaps": requests that vLLM's own OpenAI-server tests send, each answered as vLLM answers
it, through the official `openai` package or plain HTTP, on one server of the tiny llama (its text is random; the
checks are about shapes, ids, counts and wording). The server runs with --enable-force-include-usage and
--max-logprobs -1 (the tiny vocabulary whole), as vLLM's tests start theirs for those rows."""

from __future__ import annotations

import json
import shutil
import urllib.request

import openai
import pytest

from metrale.frontend.tokenizer import Tokenizer

from serve_fixture import http_server, openai_client
from test_http_api import assert_error, http

MODEL = "tiny-vllm-compat"
SAYING = "Here is a common saying about apple. An apple a day, keeps"
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-compat") / MODEL
    shutil.copytree(tiny_model_dir("llama"), out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with http_server(model_dir, "--enable-force-include-usage", "--max-logprobs", "-1") as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    with openai_client(server, timeout=120) as client:
        yield client


def post(server, route: str, body: dict) -> tuple[int, dict]:
    return http("POST", f"{server.http}/{route}", body)


# ---- 1: chat echo -----------------------------------------------------------------------------


def _saying_chat(api, echo: bool, stream: bool = False):
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": SAYING}]
    return api.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=stream,
                                       extra_body={"echo": echo, **CONTINUE})


def test_chat_echo_puts_the_final_message_in_front_of_its_continuation(api):
    echoed = _saying_chat(api, echo=True).choices[0]
    plain = _saying_chat(api, echo=False).choices[0]
    assert echoed.message.role == plain.message.role == "assistant"
    assert echoed.finish_reason in ("stop", "length")
    assert echoed.message.content == SAYING + plain.message.content  # greedy: the same continuation
    assert not plain.message.content.startswith(SAYING)


def test_streamed_chat_echo_sends_the_final_message_first(api):
    chunks = [c for c in _saying_chat(api, echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content for c in chunks)
    assert text == _saying_chat(api, echo=True).choices[0].message.content


def test_chat_echo_leaves_out_a_final_message_the_answer_does_not_continue(api):
    """With a generation prompt the answer is the assistant's, so a final user message is not echoed (vLLM's rule)."""
    messages = [{"role": "user", "content": "tell me a common saying"}]
    out = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                      extra_body={"echo": True})
    plain = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert out.choices[0].message.content == plain.choices[0].message.content


def test_chat_without_a_generation_prompt_answers_in_the_final_messages_role(api):
    messages = [{"role": "user", "content": "An apple a day"}]
    out = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                      extra_body={"echo": True, **CONTINUE})
    assert out.choices[0].message.role == "user"
    assert out.choices[0].message.content.startswith("An apple a day")


# ---- 2 and 3: prompt_logprobs on completions, --max-logprobs --------------------------------------


@pytest.mark.parametrize("top", [0, 1, 2])
def test_completion_choices_carry_prompt_logprobs_as_vllm_does(api, tokenizer, top):
    prompts = ["A robot may not injure another robot", "My name is"]
    out = api.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0,
                                 extra_body={"prompt_logprobs": top})
    for choice, prompt in zip(out.choices, prompts):
        entries = choice.model_extra["prompt_logprobs"]
        ids = tokenizer.encode(prompt)
        assert len(entries) == len(ids) and entries[0] is None
        for token_id, entry in zip(ids[1:], entries[1:]):
            assert str(token_id) in entry and top <= len(entry) <= top + 1
            assert set(entry[str(token_id)]) == {"logprob", "rank", "decoded_token"}
    plain = api.completions.create(model=MODEL, prompt=prompts, max_tokens=3)
    assert plain.choices[0].prompt_logprobs is None  # present, null: clients read it as an attribute


def test_max_logprobs_minus_one_serves_the_whole_vocabulary(api, tokenizer):
    vocab = tokenizer.vocab_size
    out = api.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=vocab, temperature=0,
                                 extra_body={"return_tokens_as_token_ids": True})  # token texts may collide, ids not
    assert [len(top) for top in out.choices[0].logprobs.top_logprobs] == [vocab, vocab]
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=True, top_logprobs=-1)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == vocab


def test_logprob_token_ids_lists_the_token_then_those_ids_with_their_logprobs(api):
    """vLLM's logprob_token_ids on chat: each token's alternatives are the token itself, then the given ids in the
    given order (the token not twice), wherever they rank, with the same log-probabilities the whole vocabulary's
    list gives them."""
    asked = [100, 1000, 5, 1500]
    messages = [{"role": "user", "content": "Hello"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True)
    pinned = api.chat.completions.create(**kw, top_logprobs=2, extra_body={"logprob_token_ids": asked,
                                                                            "return_tokens_as_token_ids": True})
    whole = api.chat.completions.create(**kw, top_logprobs=-1, extra_body={"return_tokens_as_token_ids": True})
    assert pinned.choices[0].message.content == whole.choices[0].message.content
    listed = []
    for p, w in zip(pinned.choices[0].logprobs.content, whole.choices[0].logprobs.content, strict=True):
        assert p.token == w.token and p.logprob == pytest.approx(w.logprob)
        of = {e.token: e.logprob for e in w.top_logprobs}
        names = [p.token] + [n for n in (f"token_id:{i}" for i in asked) if n != p.token]
        assert [e.token for e in p.top_logprobs] == names
        assert [e.logprob for e in p.top_logprobs] == pytest.approx([of[n] for n in names])
        listed.append(names)
    streamed = api.chat.completions.create(**kw, top_logprobs=2, stream=True,
                                           extra_body={"logprob_token_ids": asked, "return_tokens_as_token_ids": True})
    tops = [[e.token for e in t.top_logprobs] for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content]
    assert tops == listed


@pytest.mark.parametrize("body, words", [
    ({"logprob_token_ids": [3, 4]}, "needs logprobs"),
    ({"logprob_token_ids": [3, 99999], "logprobs": True}, "out of vocabulary"),
    ({"logprob_token_ids": [], "logprobs": True}, "distinct token ids"),
])
def test_a_logprob_token_ids_that_cannot_be_served_is_a_400_naming_it(server, body, words):
    status, out = post(server, "v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 1, **body})
    assert_error(status, out, 400, param="logprob_token_ids")
    assert words in out["error"]["message"]
    status, out = post(server, "v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                  **body, "logprobs": 0 if "logprobs" in body else None})
    assert_error(status, out, 400, param="logprob_token_ids")
    assert words in out["error"]["message"]


def test_prompt_logprobs_follow_max_logprobs_past_twenty(api, tokenizer):
    """prompt_logprobs above the default 20 (vLLM's tests ask for the vocabulary): the worker's plan check and the
    ring follow --max-logprobs, not a fixed 20."""
    prompt = "A robot may not injure"
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 32})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(tokenizer.encode(prompt)) and entries[0] is None
    assert all(32 <= len(entry) <= 33 for entry in entries[1:])


# ---- 4: truncation_side --------------------------------------------------------------------------


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_truncate_prompt_tokens_keeps_the_side_asked_for(server, side):
    ids = list(range(10, 30))
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5, "return_token_ids": True}
    if side is not None:
        body["truncation_side"] = side
    status, out = post(server, "v1/completions", body)
    assert status == 200, out
    assert out["choices"][0]["prompt_token_ids"] == (ids[:5] if side == "right" else ids[-5:])
    assert out["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("side", ["left", "right"])
def test_chat_truncation_keeps_the_side_asked_for(server, tokenizer, side):
    messages = [{"role": "user", "content": "one two three four five six seven eight"}]
    status, full = post(server, "v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                         "return_token_ids": True})
    ids = full["prompt_token_ids"]
    status, out = post(server, "v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                        "return_token_ids": True, "truncate_prompt_tokens": 4,
                                                        "truncation_side": side})
    assert status == 200, out
    assert out["prompt_token_ids"] == (ids[:4] if side == "right" else ids[-4:])


def test_a_truncation_side_of_another_name_is_a_400(server):
    status, out = post(server, "v1/completions", {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 2,
                                                   "truncation_side": "middle"})
    assert_error(status, out, 400, param="truncation_side")


# ---- 5: custom roles ----------------------------------------------------------------------------


def test_a_custom_role_reaches_the_chat_template(api, tokenizer):
    parts = [{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}]
    text = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    one = api.chat.completions.create(model=MODEL, messages=parts, max_tokens=5, temperature=0, seed=0,
                                      extra_body={"return_token_ids": True})
    two = api.chat.completions.create(model=MODEL, messages=text, max_tokens=5, temperature=0, seed=0)
    assert one.choices[0].message.content == two.choices[0].message.content
    assert "<|im_start|>my-custom-role\nwhat is 1+1?" in tokenizer.decode(one.model_extra["prompt_token_ids"],
                                                                            skip_special_tokens=False)


# ---- 6 and 7: forced usage; streamed content is never null --------------------------------------


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_forced_usage_counts_every_chunk(api, route):
    kw = dict(model=MODEL, max_tokens=6, temperature=0, stream=True, extra_body={"min_tokens": 6})
    if route == "chat":
        stream = api.chat.completions.create(messages=[{"role": "user", "content": "capital of France?"}], **kw)
    else:
        stream = api.completions.create(prompt="The capital of France is", **kw)
    last = 0
    chunks = list(stream)
    for chunk in chunks:
        assert chunk.usage is not None and chunk.usage.prompt_tokens > 0
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        assert chunk.usage.completion_tokens > last or (not chunk.choices and chunk.usage.completion_tokens == last)
        last = chunk.usage.completion_tokens
    assert not chunks[-1].choices and last == 6


def test_forced_usage_is_on_every_whole_answer(api):
    out = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.usage.completion_tokens == 3 and out.usage.prompt_tokens > 0


def test_streamed_chat_content_is_a_string_in_every_chunk(api):
    stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                         max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         logprobs=True)
    chunks = [c for c in stream if c.choices]
    assert chunks and all(isinstance(c.choices[0].delta.content, str) for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


# ---- 8: return_token_ids ------------------------------------------------------------------------


EMOJI = "Complete this sentence with emojis: I love coding 🚀"


def test_completion_token_ids_with_an_emoji_prompt(api, tokenizer):
    out = api.completions.create(model=MODEL, prompt=EMOJI, max_tokens=10, temperature=0, logprobs=1,
                                 extra_body={"return_token_ids": True})
    choice = out.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(EMOJI)
    assert choice["token_ids"] and tokenizer.decode(choice["token_ids"]).startswith(choice["text"])
    without = api.completions.create(model=MODEL, prompt=EMOJI, max_tokens=10, temperature=0, logprobs=1,
                                     extra_body={"return_token_ids": False}).model_dump()
    assert without["choices"][0]["token_ids"] is None and without["choices"][0]["prompt_token_ids"] is None


def test_completion_token_ids_agree_with_echoed_logprobs_and_the_stream(api, tokenizer):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1}
    out = api.completions.create(model=MODEL, prompt="Hello, world! How are you today?", max_tokens=20,
                                 temperature=0, echo=True, logprobs=1, extra_body=extra).choices[0]
    named = [int(t.removeprefix("token_id:")) for t in out.logprobs.tokens]
    assert named == out.prompt_token_ids + out.token_ids
    assert out.model_extra["prompt_logprobs"][0] is None
    assert out.text.endswith(tokenizer.decode(out.token_ids))
    stream = api.completions.create(model=MODEL, prompt="Tell me a short fact about Python:", max_tokens=30,
                                    temperature=0, stream=True, logprobs=1,
                                    extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].prompt_token_ids == tokenizer.encode("Tell me a short fact about Python:")
    streamed = [i for c in chunks for i in c.choices[0].token_ids]
    named = [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == named and len(streamed) > 0


def test_chat_token_ids_with_an_emoji_prompt_whole_and_streamed(api, tokenizer):
    messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    out = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                      extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(out.prompt_token_ids)
    assert "I love cats 🐱" in prompt and out.choices[0].token_ids
    without = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert without.choices[0].token_ids is None and without.prompt_token_ids is None  # present, null
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                              stream=True, extra_body={"return_token_ids": True}))
    assert tokenizer.decode(chunks[0].prompt_token_ids) == prompt
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    assert [i for c in chunks if c.choices for i in c.choices[0].token_ids] == out.choices[0].token_ids


# ---- 9: /invocations ----------------------------------------------------------------------------


def test_invocations_answers_with_the_keys_the_client_parses(server, api):
    body = {"model": MODEL, "messages": [{"role": "system", "content": "you are a helpful assistant"},
                                         {"role": "user", "content": "what is 1+1?"}],
            "max_completion_tokens": 5, "temperature": 0.0, "logprobs": False}
    parsed = api.chat.completions.create(**body).model_dump()
    status, raw = post(server, "invocations", body)
    assert status == 200, raw
    assert parsed.keys() == raw.keys()
    assert parsed["choices"] == raw["choices"]
    completion = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 5, "temperature": 0.0}
    parsed = api.completions.create(**completion).model_dump()
    status, raw = post(server, "invocations", completion)
    assert parsed.keys() == raw.keys() and parsed["choices"] == raw["choices"]


# ---- 10 and 11: errors a person reads ------------------------------------------------------------


def test_every_bad_logit_bias_key_is_named(server):
    status, out = post(server, "v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                        "logit_bias": {"bad1": 50.0, "bad2": 20.0, "3": 1.0}})
    assert_error(status, out, 400, param="logit_bias")
    assert "bad1" in out["error"]["message"] and "bad2" in out["error"]["message"]


def test_a_missing_prompt_is_a_sentence(api, server):
    with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds must be provided and non-empty."):
        api.completions.create(model=MODEL, prompt=None, max_tokens=5, extra_body={"prompt_embeds": []})
    status, out = post(server, "v1/completions", {"model": MODEL})
    assert_error(status, out, 400, param="prompt")
    assert "`" not in out["error"]["message"]


def test_out_of_vocabulary_ids_are_named_in_vllms_words(api):
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        api.completions.create(model=MODEL, prompt=[999999], max_tokens=5)


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_a_seed_out_of_range_is_a_sentence(api, seed):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "hi"}], seed=seed)
    message = caught.value.message
    assert "greater_than_equal" in message or "less_than_equal" in message
    assert "seed" in message and "2**63" not in message


def test_a_field_of_the_wrong_type_is_a_sentence(server):
    status, out = post(server, "v1/completions", {"model": MODEL, "prompt": "x", "n": "two"})
    assert_error(status, out, 400, param="n")
    assert out["error"]["message"] == "n must be an integer, not a string"


def test_a_whole_vocabulary_max_logprobs_is_served_as_given():
    """-1, or the vocabulary's size, on SmolLM2's 49,152 tokens with the defaults (2,048 tokens, 64 rows a step):
    the ring's alternatives regions hold a bounded number of rows, so it fits and is not lowered (it was, to ~32,700)."""
    from metrale.cli import max_logprobs_that_fit
    from metrale.config import EngineArgs

    assert max_logprobs_that_fit(EngineArgs(), 49152, 8192) == (20, None)
    assert max_logprobs_that_fit(EngineArgs(max_logprobs=-1), 49152, 8192) == (-1, None)
    assert max_logprobs_that_fit(EngineArgs(max_logprobs=151936, max_model_len=4080), 49152, 4080) == (151936, None)


def test_metrale_serve_lowers_a_max_logprobs_that_does_not_fit(tiny_model_dir, capsys, monkeypatch):
    """Through the CLI's own step: the engine arguments the supervisor gets carry the fitted count."""
    from metrale import cli
    from metrale.config import EngineArgs

    monkeypatch.setattr(cli, "_RING_LIMIT_BYTES", 64 << 20)  # a small /dev/shm: the tiny vocabulary's -1 no longer fits
    engine = cli._fitted_max_logprobs(EngineArgs(model=str(tiny_model_dir("llama")), max_logprobs=-1))
    err = capsys.readouterr().err.strip()
    assert 20 <= engine.max_logprobs < 2048 and err.startswith("metrale serve: warning: --max-logprobs -1")
    assert f"serving up to {engine.max_logprobs}" in err and "\n" not in err


# ---- 12: a schema-bound answer ends --------------------------------------------------------------


def test_a_json_schema_integer_ends_even_when_the_model_wants_digits_forever(api, tokenizer):
    """The digit 1 biased to the top: an unbounded integer would take every token up to max_tokens; the 18-digit
    bound the server adds (the schema gave none) makes the answer close."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    one = tokenizer.encode("1", add_special_tokens=False)
    assert len(one) == 1
    out = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a big number"}], max_tokens=200, temperature=0,
        logit_bias={str(one[0]): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": schema}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and out.usage.completion_tokens < 60
    n = json.loads(choice.message.content)["n"]
    assert len(str(n)) == 18 and str(n).endswith("1" * 16)  # digits to the bound, then closed
