"""Prompt logprobs to clients, as vLLM gives them: through a real `metrale serve` of the tiny fp32 llama (prefilling
16 tokens a step, so longer prompts run in chunks), checked against `LLM.generate(..., SamplingParams(prompt_logprobs=N,
logprobs=N))` on the same folder — completions' echo with logprobs (the prompt's tokens, then the output's: what
lm-eval's loglikelihood scoring reads), `max_tokens: 0` with echo, vLLM's prompt_logprobs field on completions and
chat, the ZMQ Delta that carries them once — and a frontend that sends them once when an engine core dies after a
request's first tokens (a fake engine core that reports them again)."""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request

import msgspec
import pytest

from metrale import LLM
from metrale.frontend.chat import ChatTemplate
from metrale.frontend.client import Client
from metrale.frontend.tokenizer import Tokenizer
from metrale.ipc.messages import EngineOutputs, TokenLogprob
from metrale.ipc.sampling import SamplingParams

from serve_fixture import http_server, openai_client
from test_frontend_server import WAIT_S, FakeEngine, Script, Stack, start_server, stop_server
from test_http_api import assert_error, http

MODEL = "tiny-prompt-logprobs"
STEP_TOKENS = 16  # the server's --max-num-batched-tokens: a longer prompt is prefilled in chunks
TOL = 1e-4  # fp32 on the CPU, prefilled in other chunks than the offline engine's
SHORT = "def add(a, b): return a + b"  # ASCII: every token's text is whole characters
LONG = " ".join(f"item{i} = compute(item{i - 1}, {i * 7 % 13})" for i in range(1, 25))
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prompt-lp") / MODEL
    shutil.copytree(tiny_model_dir("llama"), out)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with http_server(model_dir, "--max-num-batched-tokens", str(STEP_TOKENS)) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    with openai_client(server, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), show_progress=False) as engine:
        yield engine


def offline(llm, ids: list[int], n: int, max_tokens: int):
    """What the offline engine gives for a greedy request of these prompt ids, with prompt logprobs and logprobs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=n, logprobs=n)
    return llm.generate([{"prompt_token_ids": ids}], params)[0]


def by_id(label: str) -> int:
    """The token id a return_tokens_as_token_ids label names."""
    assert label.startswith("token_id:"), label
    return int(label[len("token_id:"):])


def assert_columns_equal(logprobs, ids: list[int], entries: list[TokenLogprob | None]) -> None:
    """A completions logprobs object (tokens named by id) lists ids with these entries' logprobs and top-N."""
    assert [by_id(t) for t in logprobs.tokens] == ids
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(entries)
    for lp, top, want in zip(logprobs.token_logprobs, logprobs.top_logprobs, entries):
        if want is None:
            assert lp is None and top is None
            continue
        assert lp == pytest.approx(want.logprob, abs=TOL)
        want_top = dict(zip(want.top_ids, want.top_logprobs))
        want_top.setdefault(want.token_id, want.logprob)
        got_top = {by_id(k): v for k, v in top.items()}
        assert set(got_top) == set(want_top)
        for token_id, value in got_top.items():
            assert value == pytest.approx(want_top[token_id], abs=TOL)


def scored(api, prompt, n: int, max_tokens: int, **extra):
    """A completion of prompt with echo and logprobs n, tokens named by id."""
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True, "return_token_ids": True, **extra}
    return api.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=n, max_tokens=max_tokens,
                                  temperature=0, extra_body=body)


def sse(url: str, body: dict) -> list[dict]:
    """A streamed request's chunks (the data lines before [DONE])."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        data = [line.decode().strip()[len("data: "):] for line in resp if line.startswith(b"data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---- completions: echo with logprobs ----------------------------------------------------------


def test_echo_with_logprobs_lists_the_prompt_then_the_output_as_llm_generate(api, llm, tokenizer):
    ids = tokenizer.encode(SHORT)
    want = offline(llm, ids, 3, 4)
    out = scored(api, SHORT, 3, 4)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == want.token_ids  # the output is what it is without prompt logprobs
    assert choice.text == SHORT + want.text
    assert_columns_equal(choice.logprobs, ids + want.token_ids, want.prompt_logprobs + want.logprobs)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4


def test_echoed_tokens_are_named_by_their_text_at_their_place_in_the_echo(api, tokenizer):
    ids = tokenizer.encode(SHORT)
    out = api.completions.create(model=MODEL, prompt=SHORT, echo=True, logprobs=1, max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
    lp, text = out.choices[0].logprobs, out.choices[0].text
    names = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert lp.tokens[: len(ids)] == names
    offsets = lp.text_offset
    assert offsets[0] == offsets[1] == 0  # the BOS the tokenizer adds stands before the text
    for i in range(1, len(ids)):
        assert text[offsets[i]: offsets[i] + len(names[i])] == names[i]
    assert offsets[len(ids)] == len(SHORT)  # the output's offsets count from the prompt's end
    assert offsets == sorted(offsets)


def test_echo_of_token_ids_offsets_count_the_decoded_prompt(api, tokenizer):
    ids = tokenizer.encode(SHORT)
    out = api.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=2, temperature=0,
                                 extra_body={"ignore_eos": True})
    lp, text = out.choices[0].logprobs, out.choices[0].text
    echoed = tokenizer.decode(ids, skip_special_tokens=False)  # "<s>" spelled out
    assert text.startswith(echoed)
    assert lp.text_offset[: len(ids) + 1] == [len(tokenizer.decode(ids[:i], skip_special_tokens=False))
                                              for i in range(len(ids) + 1)]
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])


def test_max_tokens_0_with_echo_scores_the_prompt_alone(api, llm, tokenizer):
    ids = tokenizer.encode(SHORT)
    want = offline(llm, ids, 2, 1)
    out = scored(api, SHORT, 2, 0)
    choice = out.choices[0]
    assert choice.text == SHORT and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == []
    assert_columns_equal(choice.logprobs, ids, want.prompt_logprobs)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)


def test_max_tokens_0_without_echo_is_a_400_naming_it(server):
    status, answer = http("POST", server.http + "/v1/completions", {"prompt": SHORT, "max_tokens": 0})
    assert_error(status, answer, 400, param="max_tokens")


def test_a_long_prompt_prefilled_in_chunks_scores_as_llm_generate(api, llm, tokenizer):
    ids = tokenizer.encode(LONG)
    assert len(ids) > 8 * STEP_TOKENS
    want = offline(llm, ids, 4, 3)
    out = scored(api, LONG, 4, 3)
    assert out.choices[0].model_extra["token_ids"] == want.token_ids
    assert_columns_equal(out.choices[0].logprobs, ids + want.token_ids, want.prompt_logprobs + want.logprobs)


@pytest.mark.parametrize("max_tokens", [3, 0])
def test_streamed_echo_carries_the_prompt_s_logprobs_in_each_choice_s_first_chunk(server, api, max_tokens):
    body = {"prompt": [SHORT, LONG], "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0,
            "n": 2, "ignore_eos": True, "return_tokens_as_token_ids": True}
    whole = http("POST", server.http + "/v1/completions", body)[1]
    chunks = sse(server.http + "/v1/completions", {**body, "stream": True})
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        echo = SHORT if choice["index"] < 2 else LONG
        assert mine[0]["text"].startswith(echo)
        assert "".join(m["text"] for m in mine) == choice["text"]
        streamed = {key: [v for m in mine if m["logprobs"] for v in m["logprobs"][key]] for key in choice["logprobs"]}
        assert streamed["tokens"] == choice["logprobs"]["tokens"]
        assert streamed["text_offset"] == choice["logprobs"]["text_offset"]
        for got, want in zip(streamed["token_logprobs"], choice["logprobs"]["token_logprobs"]):  # other batches
            assert got == want is None or got == pytest.approx(want, abs=TOL)
        for got, want in zip(streamed["top_logprobs"], choice["logprobs"]["top_logprobs"]):
            assert got == want is None or (set(got) == set(want) and list(got.values()) == pytest.approx(
                [want[k] for k in got], abs=TOL))
        assert mine[0]["logprobs"]["token_logprobs"][0] is None  # the prompt's first token opens the first chunk
        assert mine[-1]["finish_reason"] == "length"


# ---- vLLM's prompt_logprobs field ---------------------------------------------------------------


def test_prompt_logprobs_on_completions_in_vllm_s_shape(api, llm, tokenizer):
    """The prompt is a greedy continuation after its first tokens, so those positions' tokens are the top-1 (rank 1)
    and the others are not among the top 2 of the random model (rank unknown: null)."""
    head = tokenizer.encode("x = ")
    ids = head + offline(llm, head, 0, 6).token_ids
    want = offline(llm, ids, 2, 1)
    out = api.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                 extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, w = got[i], want.prompt_logprobs[i]
        assert list(entry)[0] == str(ids[i])  # the prompt token first, then the top 2
        want_ids = [ids[i]] + [t for t in w.top_ids if t != ids[i]]
        assert [int(k) for k in entry] == want_ids
        for k, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert value["decoded_token"] == tokenizer.decode([int(k)], skip_special_tokens=False)
        for r, (t, lp) in enumerate(zip(w.top_ids, w.top_logprobs), 1):
            assert entry[str(t)]["logprob"] == pytest.approx(lp, abs=TOL) and entry[str(t)]["rank"] == r
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(w.logprob, abs=TOL)
        assert own["rank"] == (1 if i >= len(head) else None)
    assert api.completions.create(model=MODEL, prompt=ids, max_tokens=1).choices[0].model_extra["prompt_logprobs"] is None


def test_prompt_logprobs_on_chat_sit_at_the_top_of_the_answer(api, llm, tokenizer, model_dir):
    ids = tokenizer.encode(ChatTemplate.load(model_dir, tokenizer).render(CHAT), add_special_tokens=False)
    want = offline(llm, ids, 1, 2)
    out = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, n=2,
                                      extra_body={"prompt_logprobs": 1})
    got = out.model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        w = want.prompt_logprobs[i]
        assert got[i][str(ids[i])]["logprob"] == pytest.approx(w.logprob, abs=TOL)
        assert got[i][str(w.top_ids[0])]["rank"] == 1
        assert got[i][str(w.top_ids[0])]["logprob"] == pytest.approx(w.top_logprobs[0], abs=TOL)
    assert all("prompt_logprobs" not in c.model_extra for c in out.choices)
    assert api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("route,fields,param,says", [
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
    ("chat/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "not available"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs", "Requested prompt logprobs of 21"),
    ("chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs", "greater than max allowed: 20"),
    ("completions", {"prompt_logprobs": -2}, "prompt_logprobs", "positive value or -1"),
    ("completions", {"prompt_logprobs": 1, "use_beam_search": True, "temperature": 0}, "prompt_logprobs", "beam"),
    ("completions", {"echo": True, "logprobs": 1, "use_beam_search": True, "temperature": 0}, "echo", "beam"),
])
def test_what_is_not_served_is_a_400_naming_the_field(server, route, fields, param, says):
    body = {"prompt": SHORT} if route == "completions" else {"messages": CHAT}
    status, answer = http("POST", f"{server.http}/v1/{route}", {**body, "max_tokens": 2, **fields})
    assert_error(status, answer, 400, param=param)
    assert says in answer["error"]["message"]


# ---- the ZMQ protocol --------------------------------------------------------------------------


def test_the_zmq_client_gets_prompt_logprobs_once_with_the_first_tokens(server, llm, tokenizer):
    ids = tokenizer.encode(LONG)
    want = offline(llm, ids, 2, 5)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    with server.client() as client:
        deltas = list(client.generate(token_ids=ids, params=params))
        done = client.complete(token_ids=ids, params=params)
        plain = client.complete(token_ids=ids, params=SamplingParams(max_tokens=2, temperature=0.0))
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is next(d for d in deltas if d.token_ids)
    for got in (carrying[0].prompt_logprobs, done.prompt_logprobs):
        assert len(got) == len(ids) and got[0] is None
        for g, w in zip(got[1:], want.prompt_logprobs[1:]):
            assert (g.token_id, g.top_ids) == (w.token_id, w.top_ids)
            assert g.logprob == pytest.approx(w.logprob, abs=TOL)
            assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=TOL)
    assert [t for d in deltas for t in d.token_ids] == done.token_ids == want.token_ids
    assert plain.prompt_logprobs is None


class ReportingEngine(FakeEngine):
    """A fake engine core that sends made-up prompt logprobs with the first tokens of every request that asks for
    them (those of a request the frontend resubmitted after its first tokens too)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.reported: set[str] = set()  # engine ids it sent them for

    def _tick(self, push) -> None:
        super()._tick(_Reporting(self, push))


def made_up(prompt_ids: list[int]) -> list[TokenLogprob | None]:
    """The prompt logprobs a ReportingEngine sends for a prompt."""
    return [None] + [TokenLogprob(t, -1.5, [t], [-1.5]) for t in prompt_ids[1:]]


class _Reporting:
    """A ReportingEngine's output socket: adds the prompt logprobs to each request's first tokens."""

    def __init__(self, engine: ReportingEngine, push) -> None:
        self.engine, self.push = engine, push

    def send(self, data: bytes) -> None:
        outputs = msgspec.msgpack.decode(data, type=EngineOutputs)
        for out in outputs.outputs:
            add = self.engine.adds.get(out.request_id)
            if add and add.params.prompt_logprobs is not None and out.new_token_ids \
                    and out.request_id not in self.engine.reported:
                out.prompt_logprobs = made_up(add.prompt_token_ids)
                self.engine.reported.add(out.request_id)
        self.push.send(msgspec.msgpack.encode(outputs))


def test_prompt_logprobs_go_out_once_across_an_engine_core_restart(tiny_model_dir):
    """Dead after the first tokens: the next engine core's report is not sent again. Dead before any token: the next
    engine core's report is the one the client gets."""
    model = tiny_model_dir("llama")
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")
    server, thread = start_server(model, ipc_dir, ready_probe_s=60.0)
    engines: list[ReportingEngine] = []

    def engine() -> ReportingEngine:
        e = ReportingEngine(f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out", s._reply,
                            vocab_size=s.tok.vocab_size, max_model_len=512)
        engines.append(e)
        return e.start()

    try:
        s = Stack(server, None, None, server.tokenizer, server.client_endpoint, ipc_dir, {})
        params = SamplingParams(max_tokens=32, prompt_logprobs=1)
        s.scripts["after"] = Script(tokens=list(range(20, 60)), finish="pause")  # one tick's tokens, then nothing
        s.scripts["before"] = Script(finish="hold")  # no token from the first engine core
        after, before = server.tokenizer.encode("after"), server.tokenizer.encode("before")
        with Client(address=server.client_endpoint, timeout=WAIT_S) as client:
            first_engine = engine()
            stream = client.generate("after", params=params)
            waiting = client.generate("before", params=params)
            first = next(stream)
            assert first.token_ids and first.prompt_logprobs == made_up(after)
            assert first_engine.wait_for(lambda: first_engine.add_for_prompt(before) is not None)
            first_engine.stop()
            s.scripts["before"] = Script(tokens=list(range(20, 30)))
            second_engine = engine()
            resumed = next(stream)
            assert resumed.token_ids and resumed.prompt_logprobs is None
            again = second_engine.add_for_prompt(after)
            assert again.output_token_ids == first.token_ids and again.request_id in second_engine.reported
            deltas = list(waiting)
            assert second_engine.add_for_prompt(before).output_token_ids == []
            assert deltas[0].prompt_logprobs == made_up(before)
            assert all(d.prompt_logprobs is None for d in deltas[1:])
            stream.close()
    finally:
        for e in engines:
            e.stop()
        stop_server(server, thread)
        shutil.rmtree(ipc_dir, ignore_errors=True)
