"""What a public HTTP endpoint gets from clients that misbehave, each contained while another client is served:
a body trickled byte by byte (408), headers never finished (closed), a stream nobody reads (the request runs on
without holding anyone up, and is aborted when its client goes), and ten thousand idle connections on a server
started under a soft limit of 1024 open files (the frontend lifts it; they all close without a descriptor left),
and a tenant probing another's prefix cache (two cache_salts never share a block). The first three run on a real
frontend with a fake engine core (test_frontend_server); the last two on `metrale serve`.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import time
import urllib.request

import psutil
import pytest

from test_frontend_server import WAIT_S, Script, running_stack

from serve_fixture import free_port, running_server

COMPLETION = {"prompt": "Once", "max_tokens": 3, "temperature": 0}
# Idle connections, three times the common soft limit of 1024 open files the server starts under: enough to show the
# frontend lifts it (it would hold ~1,000 and refuse the rest); scripts/bench_attacks.py holds 10,000.
IDLE = 3_000


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with running_stack(tiny_model_dir("llama"), http_port=0, http_body_timeout_s=1.0, http_idle_timeout_s=1.0) as s:
        yield s


def post(base: str, body: dict, path: str = "/v1/completions") -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
        return json.loads(resp.read())


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (WAIT_S bounds each read)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_trickled_body_is_a_408_and_others_are_served_meanwhile(stack):
    base = stack.server.http_endpoint
    with connect(base) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"prompt\": ")
        assert post(base, COMPLETION)["usage"]["completion_tokens"] == 3  # served while the slow one waits
        head, _, body = read_all(slow).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_headers_never_finished_are_closed_and_others_are_served_meanwhile(stack):
    base = stack.server.http_endpoint
    with connect(base) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert post(base, COMPLETION)["usage"]["completion_tokens"] == 3
        assert read_all(slow) == b""  # closed without an answer once the idle timeout passed


def test_a_stream_nobody_reads_holds_nobody_up_and_is_aborted_when_its_client_goes(stack):
    base = stack.server.http_endpoint
    stack.scripts["Endless story"] = Script(tokens=stack.story_ids(), finish="pause")  # live until aborted
    body = json.dumps({"prompt": "Endless story", "max_tokens": 400, "stream": True}).encode()
    engine = stack.engine
    with connect(base) as deaf:
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its window fills at once
        deaf.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        def endless() -> str | None:
            return next((rid for rid, a in engine.adds.items()
                         if stack.tok.decode(a.prompt_token_ids, skip_special_tokens=True) == "Endless story"), None)

        assert engine.wait_for(lambda: endless() is not None)
        for _ in range(3):
            assert post(base, COMPLETION)["usage"]["completion_tokens"] == 3
        rid = endless()
        assert rid not in engine.aborted, "still running while its client is connected"
    assert engine.wait_for(lambda: rid in engine.aborted), "its client went: the engine core is told to drop it"


@pytest.fixture(scope="module")
def server_at_1024_files(tiny_model_dir):
    """`metrale serve` (HTTP on its own port) started under a soft limit of 1024 open files, a common default;
    this process takes the hard limit back for its own sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < IDLE + 2_000:
        pytest.skip(f"the hard limit on open files ({hard}) is below what {IDLE:,} connections need")
    port = free_port()
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    cm = running_server(tiny_model_dir("llama"), "--http-port", str(port))
    try:
        server = cm.__enter__()  # the server's processes inherit 1024
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, IDLE + 2_000) if hard == resource.RLIM_INFINITY else hard, hard))
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        cm.__exit__(None, None, None)


def test_thousands_of_idle_connections_leave_others_served_and_no_descriptor_behind(server_at_1024_files):
    server, base = server_at_1024_files
    frontend = psutil.Process(server.children()["frontend"])
    post(base, COMPLETION)
    fds_before = frontend.num_fds()
    idle = []
    try:
        for _ in range(IDLE):
            idle.append(connect(base))
        assert post(base, COMPLETION)["usage"]["completion_tokens"] == 3  # the one after them is served
        # Every idle connection accepted (under 1024 files the frontend would hold ~1,000 and refuse the rest);
        # fds_before may still count the first request's connection, hence one fewer.
        assert wait_until(lambda: frontend.num_fds() >= fds_before + IDLE - 1), frontend.num_fds()
    finally:
        for s in idle:  # reset, not closed: thousands of closes would leave as many ports in TIME_WAIT for later tests
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
    assert post(base, COMPLETION)["usage"]["completion_tokens"] == 3
    with server.client() as c:
        assert c.health().healthy
    assert wait_until(lambda: frontend.num_fds() <= fds_before + 2), frontend.num_fds()  # closed as each ends


def wait_until(condition) -> bool:
    """Poll a condition on another process (no event reaches this one) until it holds, for at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_tenant_never_hits_another_tenants_prefix_cache(server_at_1024_files):
    """Two cache_salts with one prompt share no KV block: the second tenant's prompt is computed in full (its
    time to first token cannot tell it the first tenant sent that prompt); the same salt again does hit."""
    server, base = server_at_1024_files
    prompt = " ".join(f"secret{i}" for i in range(40))

    def hit_tokens(**salt) -> int:
        """The prefix-cache hits of one request, as the engine counts them and as its usage says."""
        with server.client() as c:
            before = c.stats().prefix_cache_hit_tokens
            usage = post(base, {**COMPLETION, "prompt": prompt, **salt})["usage"]
            hits = c.stats().prefix_cache_hit_tokens - before
        assert usage["prompt_tokens_details"]["cached_tokens"] == hits
        return hits

    assert hit_tokens(cache_salt="tenant-a") == 0
    assert hit_tokens(cache_salt="tenant-b") == 0
    assert hit_tokens() == 0
    assert hit_tokens(cache_salt="tenant-a") > 0  # the cache is on: the owner's repeat hits
