"""A frontend SIGKILLed under HTTP clients: their streams are cut (the connection dies with the process), and a retry
with the same request id (X-Request-Id, or vLLM's request_id body field) re-attaches to the request the engine core
ran on instead of starting it again; a LoRA adapter loaded at run time still serves after the restart.

Re-attachment is told from a fresh start by unseeded sampling: a fresh run of it gives other tokens, so a retry whose
output begins with what the cut stream had received is the same request. (ZMQ clients' streams across a frontend
SIGKILL are tests/test_faults_e2e.py's.)"""

from __future__ import annotations

import http.client
import json
import os
import signal
import urllib.request
import uuid

import pytest

from serve_fixture import http_server, openai_client
from test_faults_e2e import wait_idle, wait_recovered
from test_http_api import http as http_call
from test_lora_layers import ADAPTERS, _make_adapter

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> str:
    name, (_, cfg) = next(iter(ADAPTERS.items()))
    return str(_make_adapter(base, tmp_path_factory.mktemp("restart-lora") / name, 300, **cfg))


@pytest.fixture(scope="module")
def server(base):
    with http_server(base, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--dtype", "float32",
                     "--allow-runtime-lora-updating") as s:
        yield s


def _kill_frontend(server) -> int:
    pid = server.children()["frontend"]
    os.kill(pid, signal.SIGKILL)
    return pid


def _sse(server, body: dict, headers: dict | None = None):
    """A streamed completion's chunks, as they come (the response object closes when the generator does)."""
    req = urllib.request.Request(server.http + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                yield None
                return
            if line.startswith("data: "):
                yield json.loads(line[len("data: "):])


def _stream_until_cut(server, body: dict, headers: dict, chunks_before_kill: int) -> tuple[str, bool]:
    """Stream a completion, SIGKILL the frontend after some chunks, read on until the stream ends: (the text received,
    whether [DONE] came)."""
    text, done, chunks, killed = [], False, 0, None
    try:
        for chunk in _sse(server, body, headers):
            if chunk is None:
                done = True
                break
            text.append(chunk["choices"][0]["text"])
            chunks += 1
            if chunks == chunks_before_kill:
                killed = _kill_frontend(server)
    except (http.client.HTTPException, OSError) as e:
        assert killed is not None, f"the stream broke before the kill: {e}"
    assert killed is not None, "the stream ended before the kill"
    wait_recovered(server, "frontend", killed)
    return "".join(text), done


def test_an_http_stream_cut_by_a_frontend_sigkill_is_reattached_by_its_request_id(server, base):
    """The stream ends without [DONE] when the frontend dies; the retry under the same X-Request-Id, not streamed,
    answers the whole output of the request that ran on, and a streamed retry naming it by vLLM's request_id field
    replays the same output from its first token."""
    rid = uuid.uuid4().hex
    body = {"model": base.name, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    received, done = _stream_until_cut(server, body, {"X-Request-Id": rid}, chunks_before_kill=8)
    assert not done and received, "the stream was cut, after some text"

    status, whole = http_call("POST", server.http + "/v1/completions", {**body, "stream": False, "request_id": rid})
    assert status == 200, whole
    text = whole["choices"][0]["text"]
    assert text.startswith(received), "re-attached to the request that ran on (a fresh start samples other tokens)"
    assert whole["usage"]["completion_tokens"] == MAX_TOKENS and whole["choices"][0]["finish_reason"] == "length"

    replay = [c["text"] for chunk in _sse(server, {**body, "request_id": rid}) if chunk for c in chunk["choices"]]
    assert "".join(replay) == text
    wait_idle(server)


def test_a_request_without_an_id_is_not_held_and_a_retry_runs_afresh(server, base):
    """Without a request id nothing is held: the same unseeded request twice samples two outputs."""
    body = {"model": base.name, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    texts = {http_call("POST", server.http + "/v1/completions", body)[1]["choices"][0]["text"] for _ in range(2)}
    assert len(texts) == 2


def test_a_runtime_adapter_serves_its_next_request_after_a_frontend_restart(server, base, adapter):
    """POST /v1/load_lora_adapter, then SIGKILL the frontend: the restarted one serves the adapter by its name (its
    output as before the restart, not the base model's) and can unload it."""
    status, text = http_call("POST", server.http + "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapter})
    assert status == 200, text
    prompt = [5, 17, 99, 3, 42, 8, 11]

    def greedy(model: str) -> str:
        with openai_client(server) as client:
            return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    before, base_text = greedy("late"), greedy(base.name)
    assert before != base_text
    wait_recovered(server, "frontend", _kill_frontend(server))
    assert greedy("late") == before
    status, text = http_call("POST", server.http + "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200, text
