"""`metrale serve --api-server-count 2`: two frontends share the HTTP port (the kernel spreads the connections), each
takes ZMQ clients on a port of its own (--port, --port + 1), and both are linked to the one engine core. Many
concurrent requests are answered as one frontend answers them and reach both; a LoRA adapter loaded through one
serves through the other; a SIGKILLed frontend is restarted alone while the other serves on; SIGTERM drains the live
streams of both; a bad count is one line at start-up."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import time
import urllib.parse
import urllib.request
import uuid
from http.client import HTTPConnection

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale import SamplingParams
from metrale.frontend.client import Client, RequestError

from serve_fixture import free_port, http_server, running_server
from test_faults_e2e import wait_recovered
from test_http_api import http
from test_lora_layers import ADAPTERS, _make_adapter
from test_serve_edges_e2e import one_error_line, serve

pytestmark = pytest.mark.slow

REQUESTS = 48  # concurrent HTTP requests, each on a connection of its own: all on one frontend has odds 2**-47
PROMPTS = [f"story {i}: once upon a time" for i in range(REQUESTS)]


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> str:
    name, (_, cfg) = next(iter(ADAPTERS.items()))
    return str(_make_adapter(base, tmp_path_factory.mktemp("api-servers-lora") / name, 400, **cfg))


def two_free_ports() -> int:
    """A port P with P + 1 free too (frontend 1's ZMQ port)."""
    while True:
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 1))
            return port


SERVE = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--dtype", "float32",
         "--allow-runtime-lora-updating")


@pytest.fixture(scope="module")
def server(base):
    with http_server(base, *SERVE, "--api-server-count", "2", port=two_free_ports()) as s:
        yield s


@pytest.fixture(scope="module")
def one_frontend_texts(base) -> list[str]:
    """What a server of one frontend answers to PROMPTS (greedy)."""
    with http_server(base, *SERVE) as s:
        return completions(s, base.name, PROMPTS)


def completions(server, model: str, prompts: list[str], max_tokens: int = 12) -> list[str]:
    """Each prompt as its own greedy /v1/completions request, all at once, each on a fresh connection."""

    def one(prompt: str) -> str:
        status, body = http("POST", server.http + "/v1/completions",
                            {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                             "ignore_eos": True})
        assert status == 200, body
        return body["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def per_frontend_requests(server) -> dict[str, float]:
    """metrale_api_server_requests_total by frontend index, from a /metrics scrape (whichever frontend answers)."""
    with urllib.request.urlopen(server.http + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {s.labels["api_server"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "metrale_api_server_requests_total"}


def frontends(server) -> dict[str, int]:
    """name -> pid of each frontend, from the supervisor's health."""
    return {name: pid for name, pid in server.children().items() if name.startswith("frontend")}


def zmq_tokens(port: int, prompt: str, max_tokens: int = 16) -> list[int]:
    with Client("127.0.0.1", port, timeout=60) as c:
        out = c.complete(prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "length"
    return out.token_ids


def test_concurrent_requests_are_answered_as_by_one_frontend_and_reach_both(server, base, one_frontend_texts):
    assert set(frontends(server)) == {"frontend", "frontend 1"}
    before = per_frontend_requests(server)
    assert completions(server, base.name, PROMPTS) == one_frontend_texts
    after = per_frontend_requests(server)
    served = {k: after[k] - before.get(k, 0) for k in after}
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    assert sum(served.values()) >= REQUESTS
    # ZMQ clients: frontend i on --port + i, both linked to the same engine core.
    assert zmq_tokens(server.port, PROMPTS[0]) == zmq_tokens(server.port + 1, PROMPTS[0])


def test_an_adapter_loaded_through_one_frontend_serves_through_the_other(server, base, adapter):
    status, text = http("POST", server.http + "/v1/load_lora_adapter", {"lora_name": "shared", "lora_path": adapter})
    assert status == 200, text
    before = per_frontend_requests(server)
    with_adapter = completions(server, "shared", PROMPTS[:1] * REQUESTS)  # every one of them answered, on both
    served = {k: v - before.get(k, 0) for k, v in per_frontend_requests(server).items()}
    assert all(n > 0 for n in served.values()) and len(served) == 2, served
    assert len(set(with_adapter)) == 1 and with_adapter[0] != completions(server, base.name, PROMPTS[:1])[0], \
        "the adapter's output on every request, not the base model's"
    status, text = http("POST", server.http + "/v1/unload_lora_adapter", {"lora_name": "shared"})
    assert status == 200, text

    def one(_) -> int:
        return http("POST", server.http + "/v1/completions", {"model": "shared", "prompt": "x", "max_tokens": 2})[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert set(pool.map(one, range(16))) == {404}, "unloaded on both"


def test_a_sigkilled_frontend_is_restarted_alone_while_the_other_serves(server, base):
    pids = frontends(server)
    reference = zmq_tokens(server.port, PROMPTS[1], max_tokens=120)
    with Client("127.0.0.1", server.port, timeout=60) as c:
        stream = c.generate(PROMPTS[1], params=SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
        got = list(next(stream).token_ids)
        os.kill(pids["frontend 1"], signal.SIGKILL)
        with contextlib.suppress(psutil.NoSuchProcess):  # gone: its listening socket left the shared port
            psutil.Process(pids["frontend 1"]).wait(30)
        texts = completions(server, base.name, PROMPTS[:8])  # the shared HTTP port: all to the live frontend
        for delta in stream:
            got += delta.token_ids
    assert got == reference, "frontend 0's stream went on untouched"
    assert all(texts)
    now = wait_recovered(server, "frontend 1", pids["frontend 1"])
    assert now["frontend"] == pids["frontend"], "the other frontend was left alone"
    restarts = {p.name: p.restarts for p in _health(server).processes}
    assert restarts["frontend 1"] == 1 and restarts["frontend"] == 0 and restarts["engine_core"] == 0
    assert zmq_tokens(server.port + 1, PROMPTS[2]) == zmq_tokens(server.port, PROMPTS[2]), "the new frontend 1 serves"


def test_an_http_request_cut_by_its_frontends_sigkill_is_reattached_through_the_other_frontend(server, base):
    """A stream named by X-Request-Id, cut by a SIGKILL of the frontend serving it: a retry under the id at once goes
    to the other frontend (the dead one's socket left the shared port), which re-attaches it — the engine core saw
    the dead frontend's connection drop — and answers the whole output of the request the engine core ran on; once
    the dead frontend is back, retries through either frontend get the same answer."""
    rid = uuid.uuid4().hex
    body = {"model": base.name, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    url = urllib.parse.urlsplit(server.http)
    conn = HTTPConnection(url.hostname, url.port, timeout=60)
    received = []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                  "X-Request-Id": rid})
        resp = conn.getresponse()
        while len(received) < 5:
            line = resp.readline().decode().strip()
            if line.startswith("data: {"):
                received.append(json.loads(line[len("data: "):])["choices"][0]["text"])
        mine = conn.sock.getsockname()[1]
        serving = next(name for name, pid in frontends(server).items()
                       if any(c.raddr and c.raddr.port == mine for c in psutil.Process(pid).net_connections()))
        pid = frontends(server)[serving]
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(psutil.NoSuchProcess):  # gone: its listening socket left the shared port
            psutil.Process(pid).wait(30)
    finally:
        conn.close()

    def whole(_) -> str:
        status, answer = http("POST", server.http + "/v1/completions", {**body, "stream": False}
                              | {"request_id": rid})
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 200
        return answer["choices"][0]["text"]

    first = whole(0)  # waits for the request's end
    assert first.startswith("".join(received)), "re-attached (an unseeded fresh start samples other tokens)"
    wait_recovered(server, serving, pid)
    wait_back(server.port + (int(serving.split()[1]) if " " in serving else 0))
    assert {whole(k) for k in range(8)} == {first}, "every later retry, through either frontend, gets the same answer"


def wait_back(port: int, timeout: float = 60.0) -> None:
    """Wait until the frontend on this ZMQ port has taken the engine core (its health says ready)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(TimeoutError, RequestError), Client("127.0.0.1", port, timeout=2) as c:
            if c.health().ready:
                return
        assert time.monotonic() < deadline, f"the frontend on port {port} did not take the engine core"
        time.sleep(0.05)  # polling its health: no event crosses the processes


def _health(server):
    with server.client(timeout=10) as c:
        return c.health()


def test_sigterm_drains_the_live_streams_of_every_frontend(base):
    port = two_free_ports()
    with running_server(base, "--api-server-count", "2", "--shutdown-timeout", "60", port=port) as s:
        clients = [Client("127.0.0.1", port + i, timeout=60) for i in range(2)]
        try:
            streams = [c.generate("a", params=SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
                       for c in clients]
            got = [list(next(stream).token_ids) for stream in streams]
            s.proc.send_signal(signal.SIGTERM)
            for c in clients:
                while c.health().ready:  # the supervisor passes the signal on to each frontend
                    time.sleep(0.02)  # polling the server's health: no event crosses the processes
                with pytest.raises(RequestError) as refused:
                    c.complete("b", params=SamplingParams(max_tokens=2))
                assert refused.value.code == "shutdown"
            for k, stream in enumerate(streams):
                for delta in stream:
                    got[k] += delta.token_ids
                    last = delta
                assert last.finish_reason == "length" and len(got[k]) == 150, "the live request finished"
        finally:
            for c in clients:
                c.close()
        assert s.proc.wait(60) == 0


@pytest.mark.parametrize("args,says", [
    (["--api-server-count", "0"], "--api-server-count 0: there must be at least one frontend"),
    (["--api-server-count", "-1"], "--api-server-count -1"),
    (["--api-server-count", "2", "--nnodes", "2"], "--api-server-count 2 with --nnodes 2"),
])
def test_a_bad_api_server_count_is_one_line_exit_2(base, args, says):
    assert says in one_error_line(serve("--model", str(base), "--port", str(free_port()), *args))


def test_a_taken_port_of_frontend_1_is_one_line_exit_2(base):
    port = two_free_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        line = one_error_line(serve("--model", str(base), "--port", str(port), "--api-server-count", "2"))
    assert f"port {port + 1}" in line and "cannot be bound" in line
