"""--api-key: /v1/* over HTTP answers 401 without `Authorization: Bearer KEY`, ZMQ requests without the key get
Error "unauthorized"; health stays open. Run on a real frontend with a fake engine core (test_frontend_server)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from metrale.frontend.api_key import ApiKey
from metrale.frontend.client import AsyncClient, Client, RequestError
from metrale.ipc.sampling import SamplingParams

from test_frontend_server import WAIT_S, raw_ask, raw_dealer, running_stack

KEY = "sk-metrale-test"


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with running_stack(tiny_model_dir("llama"), api_key=KEY, http_port=0) as s:
        yield s


def http(url: str, body: object | None = None, key: str | None = None) -> tuple[int, dict]:
    """One HTTP request (POST with a body, else GET): (status, JSON body)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


COMPLETION = {"prompt": "Once", "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("key", [None, "sk-wrong", KEY[:-1], KEY + "x"])
def test_http_without_the_right_key_is_401_in_openai_shape(stack, key):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/models", None)):
        status, reply = http(stack.server.http_endpoint + path, body, key)
        assert status == 401, path
        assert reply["error"]["code"] == "invalid_api_key" and "API key" in reply["error"]["message"]


def test_every_http_route_but_the_probes_is_401_without_the_key(stack):
    """Each route the app serves (so a route added later is covered too): only the probes answer without the key."""
    from metrale.frontend.http_api import OPEN_PATHS, HttpApi

    base = stack.server.http_endpoint
    app = HttpApi(stack.server).app  # the routes the running server serves (built the same way; never started)
    routes = {(r.method, r.resource.canonical.replace("{id:.+}", "some-model")) for r in app.router.routes()
              if r.method in ("GET", "POST")}
    assert {"/tokenize", "/invocations", "/v1/completions"} <= {path for _, path in routes}
    for method, path in sorted(routes):
        req = urllib.request.Request(base + path, data=b"{}" if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
                status, text = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read()
        if path in OPEN_PATHS:
            assert status != 401, path
        else:
            assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", (method, path)
    assert http(base + "/not-a-route", None)[0] == 401  # an unknown path says nothing without the key


def test_every_zmq_message_but_health_is_refused_without_the_key(stack):
    """Each client message type (admin included) is answered `unauthorized` and does nothing without the key."""
    from metrale.ipc.messages import ClientMessage

    bodies = {"generate": {"prompt": "Once", "sampling": {"max_tokens": 2}}, "admin": {"action": "kill", "signal": "STOP"}}
    tags = {t.__struct_config__.tag for t in ClientMessage.__args__}
    assert "admin" in tags and "generate" in tags
    ctx, sock = raw_dealer(stack.endpoint)
    try:
        for tag in sorted(tags):
            reply = raw_ask(sock, {"type": tag, "id": f"q-{tag}", **bodies.get(tag, {})})
            if tag == "health":
                assert reply["type"] == "health_reply"
            else:
                assert (reply["type"], reply.get("code")) == ("error", "unauthorized"), (tag, reply)
    finally:
        sock.close(0)
        ctx.term()


def test_http_with_the_key_is_served_and_health_stays_open(stack):
    status, reply = http(stack.server.http_endpoint + "/v1/completions", COMPLETION, KEY)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3
    status, _ = http(stack.server.http_endpoint + "/v1/models", None, KEY)
    assert status == 200
    status, reply = http(stack.server.http_endpoint + "/health")
    assert status in (200, 503) and "processes" in reply  # open: answered, not 401


def test_zmq_without_the_key_is_refused_with_unauthorized(stack):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    for key in (None, "sk-wrong"):
        with Client(address=stack.endpoint, timeout=WAIT_S, api_key=key) as c:
            with pytest.raises(RequestError) as err:
                c.complete("Once", params=params)
            assert err.value.code == "unauthorized"
            with pytest.raises(RequestError, match="unauthorized"):
                c.stats()
            assert c.health().processes, "health stays open"
    ctx, sock = raw_dealer(stack.endpoint)
    try:
        reply = raw_ask(sock, {"type": "model_info", "id": "m1"})
        assert reply == {"type": "error", "id": "m1", "code": "unauthorized", "message": reply["message"]}
        assert raw_ask(sock, {"type": "model_info", "id": "m2", "api_key": KEY})["type"] == "model_info_reply"
    finally:
        sock.close(0)
        ctx.term()


def test_zmq_with_the_key_is_served_sync_and_async(stack):
    import asyncio

    params = SamplingParams(max_tokens=3, temperature=0.0)
    with Client(address=stack.endpoint, timeout=WAIT_S, api_key=KEY) as c:
        out = c.complete("Once", params=params)
        assert out.finish_reason == "length" and len(out.token_ids) == 3
        assert c.stats() is not None

    async def run():
        async with AsyncClient(address=stack.endpoint, timeout=WAIT_S, api_key=KEY) as c:
            return await c.complete("Once", params=params)

    assert len(asyncio.run(run()).token_ids) == 3


def test_no_key_configured_lets_everyone_in():
    assert ApiKey(None).allows(None) and ApiKey(None).allows_header(None)
    key = ApiKey("k")
    assert key.allows("k") and not key.allows("") and not key.allows(None) and not key.allows("K")
    assert key.allows_header("Bearer k") and key.allows_header("bearer k") and not key.allows_header("Basic k")
