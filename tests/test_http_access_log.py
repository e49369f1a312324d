"""The HTTP access log (one line per request: method, path, status, latency, tokens; off with
--disable-log-requests) and the frontend's line at shutdown, on a real frontend with a fake engine core."""

from __future__ import annotations

import json
import logging
import re
import urllib.request

import pytest

from metrale.frontend.client import RequestError
from metrale.ipc.sampling import SamplingParams

from test_api_key import http
from test_frontend_server import WAIT_S, running_stack

LINE = re.compile(r"^HTTP 127\.0\.0\.1 (GET|POST) (\S+) (\d{3}) \d+\.\d ms(?: prompt_tokens=(\d+) completion_tokens=(\d+))?$")


def access_lines(caplog) -> list[tuple]:
    """(method, path, status, prompt tokens, completion tokens) of each access-log line."""
    out = []
    for record in caplog.records:
        if record.name == "metrale.frontend.access":
            m = LINE.match(record.getMessage())
            assert m, record.getMessage()
            out.append(m.groups())
    return out


def test_one_line_per_http_request_with_status_and_tokens(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="metrale.frontend.access")
    with running_stack(tiny_model_dir("llama"), http_port=0) as s:
        base = s.server.http_endpoint
        prompt_tokens = len(s.tok.encode("Once"))
        assert http(base + "/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0, "n": 2})[0] == 200
        assert http(base + "/v1/completions", {"prompt": "Once", "max_tokens": 3, "model": "nope"})[0] == 404
        status, _ = http(base + "/health")
        stream = {"prompt": "Once", "max_tokens": 2, "temperature": 0, "stream": True}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(stream).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
            assert resp.status == 200 and b"[DONE]" in resp.read()
    lines = access_lines(caplog)
    assert lines == [
        ("POST", "/v1/completions", "200", str(prompt_tokens), "6"),
        ("POST", "/v1/completions", "404", None, None),
        ("GET", "/health", str(status), None, None),
        ("POST", "/v1/completions", "200", str(prompt_tokens), "2"),
    ]


def test_disable_log_requests_logs_none(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="metrale.frontend.access")
    with running_stack(tiny_model_dir("llama"), http_port=0, log_requests=False) as s:
        assert http(s.server.http_endpoint + "/v1/completions", {"prompt": "Once", "max_tokens": 2})[0] == 200
    assert access_lines(caplog) == []


def test_shutdown_says_what_was_drained_and_what_was_ended(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="metrale.frontend.server")
    with running_stack(tiny_model_dir("llama")) as s:
        stream = s.client.generate("Once", params=SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
        next(stream)  # live
        s.server._loop.call_soon_threadsafe(s.server.begin_shutdown)
        with pytest.raises(RequestError, match="shutdown"):
            for _ in stream:
                pass
    said = [r.getMessage() for r in caplog.records if "shut down:" in r.getMessage()]
    assert said == ["frontend: shut down: of 1 requests live at the signal, 0 finished within the 0.0 s drain, "
                    "1 were ended with Error shutdown"]
