"""FrontendServer against a fake engine core, driven through metrale.frontend.client."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import pytest
import uvloop
import zmq

from metrale.frontend import live_requests
from metrale.frontend.client import AsyncClient, Client, RequestError
from metrale.frontend.server import FrontendConfig, FrontendServer
from metrale.frontend.tokenizer import Tokenizer
from metrale.ipc.messages import (
    AbortRequest,
    AddRequest,
    EngineInput,
    EngineOutputs,
    EngineReady,
    EngineStats,
    Health,
    ProcessHealth,
    RequestOutputDelta,
    StatsRequest,
    StatsResponse,
    TokenLogprob,
    WorkerBack,
    WorkerLost,
)
from metrale.ipc.sampling import SamplingParams

WAIT_S = 10.0  # upper bound on any wait; tests finish far sooner
STORY = "The quick brown fox jumps over the lazy dog. 東京 🙂 naïve café"
MAX_FRAME = 64 * 1024


@dataclass
class Script:
    """What the fake engine core generates for one request."""

    tokens: list[int] = field(default_factory=list)
    # "length" | "stop" | "error" | "endless" (cycle tokens forever) | "hold" (emit nothing) | "pause" (one tick's
    # tokens after each AddRequest, then nothing)
    finish: str = "length"
    error: str | None = None
    error_code: str | None = None


class FakeEngine:
    """An engine core stand-in: a thread that connects to the frontend's ipc sockets and streams scripted tokens.

    Each tick (every `tick_s`) it sends every live request its next `tokens_per_tick` tokens, as a real engine
    core would; it records every AddRequest and every aborted id, and answers StatsRequest.
    """

    def __init__(self, input_address: str, output_address: str, reply: Callable[[AddRequest], Script],
                 *, vocab_size: int, max_model_len: int, tokens_per_tick: int = 2, tick_s: float = 0.002) -> None:
        self.input_address, self.output_address = input_address, output_address
        self.reply = reply
        self.ready = EngineReady(vocab_size=vocab_size, max_model_len=max_model_len, num_kv_blocks=64, block_size=16)
        self.tokens_per_tick, self.tick_s = tokens_per_tick, tick_s
        self.adds: dict[str, AddRequest] = {}
        self.aborted: set[str] = set()
        self.stats_requests = 0
        self.cond = threading.Condition()
        self._live: dict[str, list] = {}  # engine id -> [script, position, max_tokens, wants_logprobs, paused]
        self._say: list[msgspec.Struct] = []  # messages to send as they are (WorkerLost, WorkerBack)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)

    def start(self) -> FakeEngine:
        self._thread.start()
        return self

    def say(self, msg: msgspec.Struct) -> None:
        """Send msg to the frontend from the engine's thread (at its next turn)."""
        with self.cond:
            self._say.append(msg)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)

    def wait_for(self, predicate: Callable[[], bool]) -> bool:
        """Block until predicate() holds (checked whenever the engine's state changes)."""
        with self.cond:
            return self.cond.wait_for(predicate, WAIT_S)

    def add_for_prompt(self, prompt_ids: list[int]) -> AddRequest | None:
        with self.cond:
            return next((a for a in self.adds.values() if a.prompt_token_ids == prompt_ids), None)

    def _run(self) -> None:
        ctx = zmq.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        try:
            pull.connect(self.input_address)
            push.connect(self.output_address)
            push.send(msgspec.msgpack.encode(self.ready))
            decoder = msgspec.msgpack.Decoder(EngineInput)
            while not self._stop.is_set():
                timeout_ms = int(self.tick_s * 1000) if self._live else 20
                while pull.poll(timeout_ms):
                    self._on_input(decoder.decode(pull.recv()), push)
                    timeout_ms = 0
                with self.cond:
                    said, self._say = self._say, []
                for msg in said:
                    push.send(msgspec.msgpack.encode(msg))
                if self._live:
                    self._tick(push)
        finally:
            pull.close(linger=0)
            push.close(linger=0)
            ctx.term()

    def _on_input(self, msg, push: zmq.Socket) -> None:
        with self.cond:
            if isinstance(msg, AddRequest):
                self.adds[msg.request_id] = msg
                script = self.reply(msg)
                self._live[msg.request_id] = [script, len(msg.output_token_ids), msg.params.max_tokens,
                                              msg.params.logprobs is not None, False]
            elif isinstance(msg, AbortRequest):
                for rid in msg.request_ids:
                    self.aborted.add(rid)
                    self._live.pop(rid, None)
            elif isinstance(msg, StatsRequest):
                self.stats_requests += 1
                stats = EngineStats(running=len(self._live), kv_blocks_total=64, steps=7)
                push.send(msgspec.msgpack.encode(StatsResponse(id=msg.id, stats=stats)))
            self.cond.notify_all()

    def _tick(self, push: zmq.Socket) -> None:
        outputs = []
        with self.cond:
            for rid, entry in list(self._live.items()):
                script, pos, max_tokens, wants_logprobs, paused = entry
                if script.finish == "hold" or paused:
                    continue
                entry[4] = script.finish == "pause"
                if script.finish == "error":
                    outputs.append(RequestOutputDelta(rid, [], "error", None, script.error, script.error_code))
                    del self._live[rid]
                    continue
                n = min(self.tokens_per_tick, max_tokens - pos)
                if script.finish == "endless":
                    new = [script.tokens[(pos + i) % len(script.tokens)] for i in range(n)]
                else:
                    new = script.tokens[pos : pos + n]
                pos = entry[1] = pos + len(new)
                finish = None
                if pos >= max_tokens:
                    finish = "length"
                elif script.finish not in ("endless", "pause") and pos >= len(script.tokens):
                    finish = script.finish
                logprobs = [TokenLogprob(t, -0.25) for t in new] if wants_logprobs else None
                outputs.append(RequestOutputDelta(rid, new, finish, logprobs))
                if finish is not None:
                    del self._live[rid]
        if outputs:
            push.send(msgspec.msgpack.encode(EngineOutputs(outputs=outputs)))


@dataclass
class Stack:
    """A running frontend with its fake engine core and a client."""

    server: FrontendServer
    engine: FakeEngine
    client: Client
    tok: Tokenizer
    endpoint: str
    ipc_dir: str
    scripts: dict[str, Script]
    max_model_len: int = 512

    def story_ids(self) -> list[int]:
        return self.tok.encode(STORY, add_special_tokens=False)

    def new_engine(self) -> FakeEngine:
        return FakeEngine(
            f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out", self._reply,
            vocab_size=self.tok.vocab_size, max_model_len=self.max_model_len,
        )

    def _reply(self, add: AddRequest) -> Script:
        """The script for a request: by its prompt text, else the story's tokens."""
        text = self.tok.decode(add.prompt_token_ids, skip_special_tokens=True)
        return self.scripts.get(text, Script(self.story_ids()))


def start_server(model_dir, ipc_dir: str, **overrides) -> tuple[FrontendServer, threading.Thread]:
    """Run a FrontendServer on uvloop in a thread; return once it is bound."""
    config = FrontendConfig(
        model_dir=str(model_dir),
        engine_input_address=f"ipc://{ipc_dir}/in",
        engine_output_address=f"ipc://{ipc_dir}/out",
        client_address="tcp://127.0.0.1:*",
        max_frame_bytes=MAX_FRAME,
        **overrides,
    )
    server = FrontendServer(config)
    thread = threading.Thread(target=lambda: uvloop.run(server.run()), name="frontend", daemon=True)
    thread.start()
    assert server.bound.wait(WAIT_S) and server.client_endpoint
    return server, thread


def stop_server(server: FrontendServer, thread: threading.Thread) -> None:
    server.shutdown()
    thread.join(WAIT_S)
    assert not thread.is_alive()


@pytest.fixture
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@contextlib.contextmanager
def running_stack(model_dir, max_model_len: int = 512, **overrides):
    """Frontend (FrontendConfig overrides) + fake engine core + Client; all stopped on any path."""
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")  # short: ipc:// paths are limited to ~100 bytes
    server, thread = start_server(model_dir, ipc_dir, **overrides)
    engine = client = None
    try:
        tok = server.tokenizer
        s = Stack(server, None, None, tok, server.client_endpoint, ipc_dir, {}, max_model_len)
        engine = s.engine = s.new_engine().start()
        assert server.engine_ready.wait(WAIT_S)
        client = s.client = Client(address=server.client_endpoint, timeout=WAIT_S)
        yield s
    finally:
        if client is not None:
            client.close()
        if engine is not None:
            engine.stop()
        stop_server(server, thread)
        shutil.rmtree(ipc_dir, ignore_errors=True)


@pytest.fixture
def stack(model_dir, request):
    """running_stack with max_model_len 512 or the indirect parameter."""
    with running_stack(model_dir, getattr(request, "param", 512)) as s:
        yield s


def raw_dealer(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    sock.connect(endpoint)
    return ctx, sock


def raw_ask(sock: zmq.Socket, message: dict | bytes) -> dict:
    sock.send(message if isinstance(message, bytes) else msgspec.msgpack.encode(message))
    return msgspec.msgpack.decode(sock.recv())


# ---- streaming -------------------------------------------------------------------------


def test_stream_text_matches_the_engine_tokens(stack):
    story = stack.story_ids()
    deltas = list(stack.client.generate("Tell me a story", params=SamplingParams(max_tokens=12)))
    assert len(deltas) > 2
    assert all(d.finish_reason is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == story[:12]
    assert "".join(d.text for d in deltas) == stack.tok.decode(story[:12])
    assert last.prompt_tokens == len(stack.tok.encode("Tell me a story"))
    assert last.completion_tokens == 12


def test_a_stream_interval_sends_the_first_tokens_at_once_then_every_n(model_dir):
    """--stream-interval 4: the first tick's tokens go at once, then at least 4 per Delta, and the whole
    stream (ids, text, logprobs) is what an interval of 1 gives. The fake engine sends 2 tokens a tick."""
    with running_stack(model_dir, stream_interval=4) as s:
        story = s.story_ids()
        deltas = list(s.client.generate("Tell me a story", params=SamplingParams(max_tokens=12, logprobs=0)))
        sizes = [len(d.token_ids) for d in deltas]
        assert sizes[0] == 2 and all(n >= 4 for n in sizes[1:-1]) and len(deltas) < 6, sizes
        assert [t for d in deltas for t in d.token_ids] == story[:12]
        assert "".join(d.text for d in deltas) == s.tok.decode(story[:12])
        assert [lp.token_id for d in deltas for lp in d.logprobs] == story[:12]
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 12


def test_complete_with_token_ids_and_logprobs(stack):
    story = stack.story_ids()
    prompt = stack.tok.encode("from ids")
    done = stack.client.complete(token_ids=prompt, params=SamplingParams(max_tokens=100, logprobs=0))
    assert done.finish_reason == "length" and done.token_ids == story
    assert done.text == stack.tok.decode(story) and "🙂" in done.text
    assert [lp.token_id for lp in done.logprobs] == story
    assert done.prompt_tokens == len(prompt) and done.completion_tokens == len(story)
    assert stack.engine.add_for_prompt(prompt) is not None


def test_engine_finish_stop_is_passed_through(stack):
    ids = stack.tok.encode("short answer", add_special_tokens=False)
    stack.scripts["stop me"] = Script(ids, finish="stop")
    done = stack.client.complete("stop me", params=SamplingParams(max_tokens=50))
    assert (done.text, done.finish_reason) == ("short answer", "stop")


def test_32_concurrent_requests_over_one_client(stack):
    story = stack.story_ids()

    def run(i: int):
        return i, stack.client.complete(f"request {i}", params=SamplingParams(max_tokens=1 + i % 20))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(32)))
    for i, done in results:
        assert done.token_ids == story[: 1 + i % 20]
        assert done.text == stack.tok.decode(story[: 1 + i % 20])
        assert done.finish_reason == "length"


def test_32_concurrent_requests_over_one_async_client(stack):
    story = stack.story_ids()

    async def main():
        async with AsyncClient(address=stack.endpoint, timeout=WAIT_S) as client:
            runs = [client.complete(f"async {i}", params=SamplingParams(max_tokens=1 + i % 20)) for i in range(32)]
            return await asyncio.gather(*runs)

    for i, done in enumerate(asyncio.run(main())):
        assert done.token_ids == story[: 1 + i % 20] and done.finish_reason == "length"


def test_async_client_errors_and_early_exit(stack):
    stack.scripts["async forever"] = Script(stack.story_ids(), finish="endless")

    async def main():
        async with AsyncClient(address=stack.endpoint, timeout=WAIT_S) as client:
            with pytest.raises(RequestError) as err:
                await client.complete("x", params=SamplingParams(temperature=-1.0))
            assert err.value.code == "bad_request"
            stream = client.generate("async forever", params=SamplingParams(max_tokens=100_000))
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    assert delta.token_ids
                    break
            assert (await client.stats()).steps == 7
            assert (await client.health()).healthy

    asyncio.run(main())
    add = stack.engine.add_for_prompt(stack.tok.encode("async forever"))
    assert stack.engine.wait_for(lambda: add.request_id in stack.engine.aborted)


def test_two_clients_may_use_the_same_id(stack):
    with Client(address=stack.endpoint, timeout=WAIT_S) as other:
        a = stack.client.generate("first", params=SamplingParams(max_tokens=5), request_id="same")
        b = other.generate("second", params=SamplingParams(max_tokens=9), request_id="same")
        assert sum(len(d.token_ids) for d in b) == 9
        assert sum(len(d.token_ids) for d in a) == 5


# ---- stop strings and aborts --------------------------------------------------------------


def test_stop_string_is_never_streamed_and_the_engine_request_is_aborted(stack):
    stack.scripts["endless fox"] = Script(stack.story_ids(), finish="endless")
    deltas = list(stack.client.generate("endless fox", params=SamplingParams(max_tokens=10_000, stop=["lazy"])))
    assert "".join(d.text for d in deltas) == "The quick brown fox jumps over the "
    assert all("lazy" not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    add = stack.engine.add_for_prompt(stack.tok.encode("endless fox"))
    assert stack.engine.wait_for(lambda: add.request_id in stack.engine.aborted)


def test_client_abort_ends_the_stream_and_the_engine_request(stack):
    stack.scripts["abort me"] = Script(stack.story_ids(), finish="endless")
    stream = stack.client.generate("abort me", params=SamplingParams(max_tokens=100_000), request_id="ab")
    first = next(stream)
    assert first.finish_reason is None
    stack.client.abort("ab")
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].completion_tokens == len(first.token_ids) + sum(len(d.token_ids) for d in rest)
    add = stack.engine.add_for_prompt(stack.tok.encode("abort me"))
    assert stack.engine.wait_for(lambda: add.request_id in stack.engine.aborted)


def test_closing_a_stream_early_aborts_the_request(stack):
    stack.scripts["leave early"] = Script(stack.story_ids(), finish="endless")
    with stack.client.generate("leave early", params=SamplingParams(max_tokens=100_000)) as stream:
        next(stream)
    add = stack.engine.add_for_prompt(stack.tok.encode("leave early"))
    assert stack.engine.wait_for(lambda: add.request_id in stack.engine.aborted)


@pytest.mark.parametrize("finish", ["endless", "hold"])
def test_a_vanished_client_has_its_request_aborted(stack, finish):
    """Streaming ("endless") is caught by the next send; an idle request ("hold") by the disconnect probe."""
    prompt = f"vanish {finish}"
    stack.scripts[prompt] = Script(stack.story_ids(), finish=finish)
    ctx, sock = raw_dealer(stack.endpoint)
    try:
        sock.send(msgspec.msgpack.encode({"type": "generate", "id": "v", "prompt": prompt,
                                          "sampling": {"max_tokens": 100_000}}))
        ids = stack.tok.encode(prompt)
        assert stack.engine.wait_for(lambda: stack.engine.add_for_prompt(ids) is not None)
        if finish == "endless":
            assert msgspec.msgpack.decode(sock.recv())["id"] == "v"
    finally:
        sock.close(linger=0)
        ctx.term()
    add = stack.engine.add_for_prompt(ids)
    assert stack.engine.wait_for(lambda: add.request_id in stack.engine.aborted)
    assert stack.client.complete("still fine", params=SamplingParams(max_tokens=3)).finish_reason == "length"


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, field_name",
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_bad_sampling_values_raise_request_error(stack, params, field_name):
    with pytest.raises(RequestError) as err:
        stack.client.complete("hello", params=params)
    assert err.value.code == "bad_request" and field_name in err.value.message
    assert stack.client.complete("hello", params=SamplingParams(max_tokens=2)).finish_reason == "length"


def test_token_id_out_of_vocab_and_too_long_prompt(stack):
    with pytest.raises(RequestError) as err:
        stack.client.complete(token_ids=[1, stack.tok.vocab_size])
    assert err.value.code == "bad_request" and "token_ids" in err.value.message
    with pytest.raises(RequestError) as err:
        stack.client.complete(token_ids=[5] * 512)  # the fake engine core's max_model_len
    assert err.value.code == "too_long"
    assert stack.client.complete(token_ids=[5] * 511, params=SamplingParams(max_tokens=1)).finish_reason == "length"


def test_long_text_prompt_too_long_for_the_model(stack):
    with pytest.raises(RequestError) as err:
        stack.client.complete("word " * 3000)  # tokenized off the event loop, then measured
    assert err.value.code == "too_long" and "max_model_len is 512" in err.value.message


@pytest.mark.parametrize("stack", [100_000], indirect=True)
def test_long_text_prompt_is_served_while_others_stream(stack):
    long_prompt = "lorem ipsum dolor sit amet " * 2000
    stack.scripts[long_prompt] = Script(stack.story_ids()[:3], finish="stop")
    long_stream = stack.client.generate(long_prompt, params=SamplingParams(max_tokens=8))
    short = stack.client.complete("short one", params=SamplingParams(max_tokens=5))
    assert short.completion_tokens == 5
    done = list(long_stream)
    assert done[-1].finish_reason == "stop"
    assert done[-1].prompt_tokens == len(stack.tok.encode(long_prompt))


def test_engine_error_becomes_request_error(stack):
    # The code travels in its own field: a message that looks like "<code>: ..." is not parsed.
    stack.scripts["fail me"] = Script(finish="error", error="the worker died", error_code="worker_fault")
    stack.scripts["looks coded"] = Script(finish="error", error="worker_fault: not a code")
    stack.scripts["fail plainly"] = Script(finish="error", error="out of blocks")
    with pytest.raises(RequestError) as err:
        stack.client.complete("fail me")
    assert (err.value.code, err.value.message) == ("worker_fault", "the worker died")
    with pytest.raises(RequestError) as err:
        stack.client.complete("fail plainly")
    assert (err.value.code, err.value.message) == ("internal", "out of blocks")
    with pytest.raises(RequestError) as err:
        stack.client.complete("looks coded")
    assert (err.value.code, err.value.message) == ("internal", "worker_fault: not a code")


def test_malformed_frames_get_an_error_and_the_server_keeps_serving(stack):
    ctx, sock = raw_dealer(stack.endpoint)
    try:
        garbage = raw_ask(sock, b"\xc1\xff not msgpack")
        assert garbage["type"] == "error" and garbage["id"] == "" and garbage["code"] == "bad_request"
        cases = {
            "wrong type": {"type": "generate", "id": "w1", "prompt": 5},
            "unknown tag": {"type": "teleport", "id": "w2"},
            "no tag": {"id": "w3", "prompt": "x"},
            "sampling type": {"type": "generate", "id": "w4", "prompt": "x", "sampling": {"max_tokens": "many"}},
            "neither": {"type": "generate", "id": "w5"},
            "both": {"type": "generate", "id": "w6", "prompt": "x", "token_ids": [1]},
            "bad value": {"type": "generate", "id": "w7", "prompt": "x", "sampling": {"top_k": -5}},
            "big id": {"type": "generate", "id": 5, "prompt": "x"},
        }
        for name, frame in cases.items():
            reply = raw_ask(sock, frame)
            assert reply["type"] == "error" and reply["code"] == "bad_request", name
            assert reply["id"] == (frame["id"] if isinstance(frame["id"], str) else ""), name
        oversized = raw_ask(sock, {"type": "generate", "id": "big", "prompt": "x" * (MAX_FRAME + 10)})
        assert (oversized["id"], oversized["code"]) == ("big", "too_long")
        unknown = raw_ask(sock, {"type": "abort", "id": "nobody"})
        assert (unknown["id"], unknown["code"]) == ("nobody", "unknown_id")
    finally:
        sock.close(linger=0)
        ctx.term()
    assert stack.client.complete("after the garbage", params=SamplingParams(max_tokens=4)).completion_tokens == 4


def test_duplicate_live_id_is_rejected_without_ending_the_first(stack):
    stack.scripts["dup"] = Script(stack.story_ids(), finish="hold")
    ctx, sock = raw_dealer(stack.endpoint)
    try:
        frame = {"type": "generate", "id": "d", "prompt": "dup", "sampling": {"max_tokens": 5}}
        sock.send(msgspec.msgpack.encode(frame))
        reply = raw_ask(sock, frame)
        assert (reply["type"], reply["id"], reply["code"]) == ("error", "d", "bad_request")
        assert "duplicate" in reply["message"]
        final = raw_ask(sock, {"type": "abort", "id": "d"})
        assert (final["type"], final["finish_reason"]) == ("delta", "abort")
    finally:
        sock.close(linger=0)
        ctx.term()


# ---- stats, health, engine lifecycle ------------------------------------------------------


def test_stats_come_from_the_engine_core(stack):
    stats = stack.client.stats()
    assert isinstance(stats, EngineStats) and stats.kv_blocks_total == 64 and stats.steps == 7
    assert stack.engine.stats_requests >= 1


def test_health_reports_the_frontend(stack):
    health = stack.client.health()
    assert isinstance(health, Health) and health.healthy
    assert health.processes[0].name == "frontend" and health.processes[0].alive


def test_health_source_is_pluggable(stack):
    worker = ProcessHealth(name="worker", pid=1, uptime_s=2.0, restarts=3, alive=False)
    report = Health(id="", healthy=False, processes=[worker], last_fault="worker died")
    stack.server.health_source = lambda: report
    health = stack.client.health()
    assert (health.healthy, health.last_fault, health.processes[0].restarts) == (False, "worker died", 3)


def test_requests_wait_for_the_engine_core_and_survive_its_restart(model_dir):
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")
    server, thread = start_server(model_dir, ipc_dir, ready_probe_s=60.0)
    engines: list[FakeEngine] = []
    try:
        tok = server.tokenizer
        s = Stack(server, None, None, tok, server.client_endpoint, ipc_dir, {})
        story = s.story_ids()
        with Client(address=server.client_endpoint, timeout=WAIT_S) as client:
            with pytest.raises(RequestError) as err:
                client.stats()  # no engine core yet: an answer, not a hang
            assert err.value.code == "busy"
            stream = client.generate("survive", params=SamplingParams(max_tokens=len(story)))
            engines.append(s.new_engine())
            engines[0].tokens_per_tick = 1
            engines[0].start()
            received = list(next(stream).token_ids)
            engines[0].stop()  # the engine core dies mid-stream; what it had not sent yet is lost
            engines.append(s.new_engine().start())
            for delta in stream:
                received += delta.token_ids
            assert received == story  # no token repeated or skipped
            first, second = (e.add_for_prompt(tok.encode("survive")) for e in engines)
            assert first.output_token_ids == [] and 0 < len(second.output_token_ids) < len(story)
            assert second.request_id != first.request_id
    finally:
        for e in engines:
            e.stop()
        stop_server(server, thread)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_silent_server_raises_timeout_error():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)  # listens, never answers
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(port=port, timeout=0.2) as client:
            with pytest.raises(TimeoutError, match="no answer from the metrale server"):
                client.complete("anyone?")
            with pytest.raises(TimeoutError):
                client.stats()
    finally:
        sock.close(linger=0)
        ctx.term()


def test_main_serves_in_a_child_process_until_sigterm(model_dir):
    """The supervisor's entry point: main(FrontendConfig) in its own process, stopped by SIGTERM."""
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")
    client_address = f"ipc://{ipc_dir}/clients"
    code = (
        "import sys; from metrale.frontend.server import FrontendConfig, main; "
        "main(FrontendConfig(model_dir=sys.argv[1], engine_input_address=sys.argv[2], "
        "engine_output_address=sys.argv[3], client_address=sys.argv[4]))"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(model_dir), f"ipc://{ipc_dir}/in",
                              f"ipc://{ipc_dir}/out", client_address])
    s = Stack(None, None, None, Tokenizer.from_dir(model_dir), client_address, ipc_dir, {})
    engine = s.new_engine().start()
    try:
        with Client(address=client_address, timeout=WAIT_S) as client:
            done = client.complete("from a child process", params=SamplingParams(max_tokens=6))
            assert done.token_ids == s.story_ids()[:6]
        child.send_signal(signal.SIGTERM)
        assert child.wait(WAIT_S) == 0
    finally:
        engine.stop()
        if child.poll() is None:
            child.kill()
            child.wait()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_not_ready_until_an_engine_core_is_up_and_rejections_are_logged_once(model_dir, caplog):
    """Before any engine core: health says not ready and what it waits for; a client probing stats 50 times
    gets 50 answers but the log gets one line."""
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")
    server, thread = start_server(model_dir, ipc_dir, ready_probe_s=60.0)
    engine = None
    try:
        with Client(address=server.client_endpoint, timeout=WAIT_S) as client:
            health = client.health()
            assert not health.healthy and not health.ready and "engine core" in health.waiting_for
            with caplog.at_level("INFO", logger="metrale.frontend.server"):
                for _ in range(50):
                    with pytest.raises(RequestError, match="not ready"):
                        client.stats()
            rejections = [r for r in caplog.records if "rejected" in r.getMessage() and r.levelname == "INFO"]
            assert len(rejections) == 1
            s = Stack(server, None, None, server.tokenizer, server.client_endpoint, ipc_dir, {})
            engine = s.new_engine().start()
            assert server.engine_ready.wait(WAIT_S)
            health = client.health()
            assert health.healthy and health.ready and health.waiting_for is None
    finally:
        if engine is not None:
            engine.stop()
        stop_server(server, thread)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_a_request_live_at_two_engine_core_deaths_is_failed_not_resubmitted(model_dir):
    """The first death resubmits it (the stream goes on); at the second it is failed: it may be what kills them."""
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")
    server, thread = start_server(model_dir, ipc_dir, ready_probe_s=60.0)
    engines: list[FakeEngine] = []
    try:
        s = Stack(server, None, None, server.tokenizer, server.client_endpoint, ipc_dir, {})
        s.scripts["deadly"] = Script(finish="hold")  # the engine never answers it
        with Client(address=server.client_endpoint, timeout=WAIT_S) as client:
            deadly = server.tokenizer.encode("deadly")
            engines.append(s.new_engine().start())
            stream = client.generate("deadly", params=SamplingParams(max_tokens=8))
            assert engines[0].wait_for(lambda: engines[0].add_for_prompt(deadly) is not None)
            engines[0].stop()  # the first death: resubmitted to the next engine core
            engines.append(s.new_engine().start())
            assert engines[1].wait_for(lambda: engines[1].add_for_prompt(deadly) is not None)
            engines[1].stop()  # the second: failed
            engines.append(s.new_engine().start())
            with pytest.raises(RequestError) as err:
                next(stream)
            assert err.value.code == "internal" and "died 2 times" in err.value.message
            assert engines[2].add_for_prompt(deadly) is None, "not resubmitted a third time"
            assert client.complete("fine", params=SamplingParams(max_tokens=4)).finish_reason == "length"
    finally:
        for e in engines:
            e.stop()
        stop_server(server, thread)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_a_request_that_streams_between_engine_core_deaths_is_resubmitted_until_the_cap_in_all(model_dir, monkeypatch):
    """Tokens between two deaths clear the suspicion (a request merely running when an engine core is killed is
    not failed at the second death); the cap on deaths in all still fails one that dies with every engine."""
    monkeypatch.setattr(live_requests, "MAX_ENGINE_DEATHS_IN_ALL", 3)
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")
    server, thread = start_server(model_dir, ipc_dir, ready_probe_s=60.0)
    engines: list[FakeEngine] = []
    try:
        s = Stack(server, None, None, server.tokenizer, server.client_endpoint, ipc_dir, {})
        s.scripts["steady"] = Script(tokens=list(range(20, 60)), finish="pause")  # a token, then nothing
        with Client(address=server.client_endpoint, timeout=WAIT_S) as client:
            steady = server.tokenizer.encode("steady")
            stream = client.generate("steady", params=SamplingParams(max_tokens=32))
            streamed = []
            for k in range(3):
                engines.append(s.new_engine().start())
                assert engines[k].wait_for(lambda: engines[k].add_for_prompt(steady) is not None), k
                assert len(engines[k].add_for_prompt(steady).output_token_ids) == len(streamed)
                streamed += next(stream).token_ids  # it ran on this engine core ...
                engines[k].stop()  # ... which dies
            engines.append(s.new_engine().start())
            with pytest.raises(RequestError) as err:
                next(stream)
            assert err.value.code == "internal" and "died 3 times while" in err.value.message
            assert engines[3].add_for_prompt(steady) is None, "not resubmitted a fourth time"
    finally:
        for e in engines:
            e.stop()
        stop_server(server, thread)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_a_replica_whose_worker_is_being_replaced_is_not_ready(stack):
    """WorkerLost takes the replica out of replicas_ready (it holds its requests, runs nothing) until WorkerBack;
    the server stays healthy meanwhile: requests are queued, not refused."""

    def ready_becomes(want: list[bool]) -> bool:
        deadline = time.monotonic() + WAIT_S
        while (health := stack.client.health()).replicas_ready != want:
            if time.monotonic() > deadline:
                return False
        return health.healthy

    assert ready_becomes([True])
    stack.engine.say(WorkerLost(why="a test"))
    assert ready_becomes([False])
    stack.engine.say(WorkerBack())
    assert ready_becomes([True])


def test_a_request_moved_by_two_worker_losses_is_not_failed_as_a_poison(model_dir):
    """Data parallel: a replica that loses its worker has its requests moved to another (move_off); that is no
    engine-core death (with one replica the same loss moves nothing and counts nothing), so a request moved twice
    without a token between, as under faults seconds apart at a thousand streams, streams on instead of failing."""
    ipc_dir = tempfile.mkdtemp(prefix="mfe-")
    server, thread = start_server(model_dir, ipc_dir, ready_probe_s=60.0,
                                  replica_addresses=[[f"ipc://{ipc_dir}/in-1", f"ipc://{ipc_dir}/out-1"]])
    engines: list[FakeEngine] = []
    try:
        s = Stack(server, None, None, server.tokenizer, server.client_endpoint, ipc_dir, {})
        s.scripts["queued"] = Script(finish="hold")  # waits in the engine core's queue: no token
        engines = [s.new_engine(), FakeEngine(f"ipc://{ipc_dir}/in-1", f"ipc://{ipc_dir}/out-1", s._reply,
                                              vocab_size=s.tok.vocab_size, max_model_len=s.max_model_len)]
        for e in engines:
            e.start()
        assert server.engine_ready.wait(WAIT_S)
        queued = server.tokenizer.encode("queued")
        with Client(address=server.client_endpoint, timeout=WAIT_S) as client:

            def replicas_ready(want: list[bool]) -> bool:  # the frontend has taken in a WorkerLost / WorkerBack
                deadline = time.monotonic() + WAIT_S
                while client.health().replicas_ready != want:
                    if time.monotonic() > deadline:
                        return False
                return True

            assert replicas_ready([True, True])
            stream = client.generate("queued", params=SamplingParams(max_tokens=6))
            deadline = time.monotonic() + WAIT_S
            while not any(e.add_for_prompt(queued) for e in engines) and time.monotonic() < deadline:
                engines[0].wait_for(lambda: engines[0].add_for_prompt(queued) is not None or bool(engines[1].adds))
            first = next(e for e in engines if e.add_for_prompt(queued) is not None)
            k = engines.index(first)
            other = engines[1 - k]
            first.say(WorkerLost(why="a test"))  # moved to the other replica
            assert other.wait_for(lambda: other.add_for_prompt(queued) is not None)
            first.say(WorkerBack())
            assert replicas_ready([True, True])
            s.scripts["queued"] = Script(s.story_ids())  # where it goes next, it runs
            before = len([a for a in first.adds.values() if a.prompt_token_ids == queued])
            other.say(WorkerLost(why="a test"))  # moved back: a second move without a token between
            assert first.wait_for(lambda: len([a for a in first.adds.values() if a.prompt_token_ids == queued]) > before)
            tokens = [t for delta in stream for t in delta.token_ids]
            assert tokens == s.story_ids()[:6]
    finally:
        for e in engines:
            e.stop()
        stop_server(server, thread)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_an_engine_message_is_handled_with_the_garbage_collector_off(stack):
    """The collector is off while an engine message's rows are handled (each Delta reaches its sink then), on again
    after: a message's thousands of objects are freed by reference counting, not walked by collections."""
    seen: list[bool] = []
    done = threading.Event()

    def sink(msg) -> None:
        seen.append(gc.isenabled())
        if getattr(msg, "finish_reason", "error") is not None:  # its final Delta, or an Error
            done.set()

    def between_messages() -> bool:
        """gc.isenabled() read on the event loop, between two of its callbacks (so no handler is running)."""
        answer: Future = Future()
        stack.server._loop.call_soon_threadsafe(lambda: answer.set_result(gc.isenabled()))
        return answer.result(WAIT_S)

    assert between_messages()
    key = stack.server.open_local()
    stack.server._loop.call_soon_threadsafe(
        lambda: stack.server.generate_local(key, "gc", sink, SamplingParams(max_tokens=6), prompt="collector"))
    assert done.wait(WAIT_S)
    assert seen and not any(seen)
    assert between_messages()
