"""`metrale serve` end to end: three real processes, driven only through the public client."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from metrale import LLM, SamplingParams
from metrale.frontend.client import AsyncClient, RequestError
from metrale.frontend.tokenizer import Tokenizer

from serve_fixture import running_server

N = 32
PROMPTS = [f"def f{i}(x):\n    return x * {i} + " for i in range(N)]


def params_for(i: int, max_tokens: int = 24) -> SamplingParams:
    """Half greedy, half seeded sampling."""
    if i % 2:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=1000 + i, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    """What the offline engine gives for the same requests."""
    with LLM(str(model_dir), show_progress=False) as llm:
        return llm.generate(PROMPTS, [params_for(i) for i in range(N)])


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir) as s:
        yield s


async def _stream_all(port: int, params=params_for, prompts=PROMPTS, sizes: list | None = None):
    """Run every prompt concurrently; return (token ids, text, finish reason) per prompt (and the token
    count of each of its deltas into sizes[i], when given)."""
    async with AsyncClient("127.0.0.1", port, timeout=120) as client:

        async def one(i: int):
            ids, text, finish = [], [], None
            async for d in client.generate(prompts[i], params=params(i)):
                ids += d.token_ids
                text.append(d.text)
                finish = d.finish_reason or finish
                if sizes is not None:
                    sizes[i].append(len(d.token_ids))
            return ids, "".join(text), finish

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def test_32_concurrent_streams_equal_the_offline_engine(server, reference):
    got = asyncio.run(_stream_all(server.port))
    for i, (ids, text, finish) in enumerate(got):
        assert ids == reference[i].token_ids, f"request {i}"
        assert text == reference[i].text
        assert finish == "length"


def test_stop_string_is_never_streamed(server, reference):
    ref = reference[1]  # greedy
    stop = ref.text[6:10]
    assert stop and stop in ref.text
    with server.client() as client:
        deltas = list(client.generate(PROMPTS[1], params=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])))
    streamed = "".join(d.text for d in deltas)
    assert stop not in streamed
    assert streamed == ref.text[: ref.text.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_multibyte_text_round_trips(server, model_dir):
    tok = Tokenizer.from_dir(model_dir)
    prompt = "naïve café — 世界 🎉: "
    with server.client() as client:
        out = client.complete(prompt, params=SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True, skip_special_tokens=False))
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=False)
    assert "\ufffd" not in out.text or "\ufffd" in tok.decode(out.token_ids, skip_special_tokens=False)
    assert out.prompt_tokens == len(tok.encode(prompt))


def test_abort_frees_its_kv_blocks(server):
    _abort_and_expect_blocks_freed(server)


def _abort_and_expect_blocks_freed(server, after_deltas: int = 3) -> None:
    """Leave a long stream after a few deltas (an abort) and wait until the engine holds no block."""
    with server.client() as client:
        stream = client.generate(PROMPTS[0], params=SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        for i, _ in enumerate(stream):
            if i == after_deltas:
                break
        stream.close()  # closing the stream aborts the request
        deadline = time.monotonic() + 10
        while True:
            stats = client.stats()
            if stats.kv_blocks_used == 0 and stats.running == 0:
                break
            assert time.monotonic() < deadline, f"blocks still used after abort: {stats}"
            time.sleep(0.05)  # polling the server's counters; the abort is asynchronous by design


def test_bad_request_gets_an_error_and_the_server_keeps_serving(server):
    with server.client() as client:
        with pytest.raises(RequestError) as e:
            client.complete(PROMPTS[0], params=SamplingParams(max_tokens=4, top_p=2.0))
        assert e.value.code == "bad_request" and "top_p" in e.value.message
        with pytest.raises(RequestError) as e:
            client.complete(token_ids=[10**6], params=SamplingParams(max_tokens=4))
        assert e.value.code == "bad_request"
        assert client.complete(PROMPTS[0], params=SamplingParams(max_tokens=4, temperature=0.0)).finish_reason == "length"


def test_synchronous_loop_streams_the_same(model_dir, reference):
    with running_server(model_dir, "--no-pipeline") as s:
        got = asyncio.run(_stream_all(s.port))
    assert [g[0] for g in got] == [r.token_ids for r in reference]


def test_a_stream_interval_runs_decode_bursts_and_streams_the_same(model_dir, reference):
    """--stream-interval 4: the worker runs up to 4 decode steps per ticket; every stream is still the
    offline engine's, its first token at once, then 4 a delta until the last."""
    sizes = [[] for _ in range(N)]
    with running_server(model_dir, "--stream-interval", "4") as s:
        got = asyncio.run(_stream_all(s.port, sizes=sizes))
        with s.client() as c:
            ticks = c.stats().steps
        _abort_and_expect_blocks_freed(s, after_deltas=2)  # the abort lands while a burst runs
    for i, (ids, text, finish) in enumerate(got):
        assert (ids, text, finish) == (reference[i].token_ids, reference[i].text, "length"), f"request {i}"
        assert sizes[i][0] == 1 and all(n >= 4 for n in sizes[i][1:-1]), sizes[i]
    # 24 tokens a request: one tick a token would be 24 decode ticks or more; bursts of 4 need about 6.
    assert ticks < 20, f"{ticks} engine ticks: the decode steps did not run as bursts"


@pytest.mark.parametrize("flags", [(), ("--stream-interval", "4")], ids=["steps", "bursts"])
def test_worker_sigkill_under_32_streams_loses_nothing(model_dir, flags):
    """SIGKILL the worker mid-stream (a step or a decode burst in flight): every stream completes,
    identical to the run without the kill."""
    long = lambda i: params_for(i, max_tokens=64)  # noqa: E731
    with LLM(str(model_dir), show_progress=False) as llm:
        expected = llm.generate(PROMPTS, [long(i) for i in range(N)])
    with running_server(model_dir, *flags) as s:
        worker = s.children()["gpu_worker"]

        async def run_and_kill():
            task = asyncio.ensure_future(_stream_all(s.port, params=long))
            await _wait_for_progress(s)
            os.kill(worker, signal.SIGKILL)
            return await task

        got = asyncio.run(run_and_kill())
        assert s.children()["gpu_worker"] != worker  # restarted
    assert [g[0] for g in got] == [r.token_ids for r in expected]
    assert all(g[2] == "length" for g in got)


async def _wait_for_progress(s, min_tokens: int = 200, timeout: float = 60):
    """Wait until the engine has generated some tokens (so the kill lands mid-stream)."""
    async with AsyncClient("127.0.0.1", s.port, timeout=10) as c:
        deadline = time.monotonic() + timeout
        while (await c.stats()).generated_tokens < min_tokens:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
