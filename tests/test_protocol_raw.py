"""A client written from docs/protocol.md alone (raw pyzmq + MessagePack maps) gets what metrale's Client gets."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import msgspec
import pytest
import zmq
from test_frontend_server import WAIT_S, Script, model_dir, stack  # noqa: F401  (fixtures)

from metrale.frontend.client import RequestError
from metrale.ipc.sampling import SamplingParams

PROTOCOL_MD = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


class RawClient:
    """DEALER → ROUTER, one MessagePack map per frame, replies routed by "id" (docs/protocol.md §1–§5)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, message: dict) -> None:
        self.sock.send(msgspec.msgpack.encode(message))

    def recv(self) -> dict:
        assert self.sock.poll(int(WAIT_S * 1000)), "the server did not answer"
        return msgspec.msgpack.decode(self.sock.recv())

    def run(self, *requests: dict) -> dict[str, dict]:
        """Send requests and collect each one's result (final delta folded, or its error) by id."""
        results = {r["id"]: {"text": "", "token_ids": [], "logprobs": [], "frames": 0} for r in requests}
        for r in requests:
            self.send(r)
        open_ids = set(results)
        while open_ids:
            reply = self.recv()
            result = results[reply["id"]]
            result["frames"] += 1
            if reply["type"] == "error":
                result["error"] = (reply["code"], reply["message"])
                open_ids.discard(reply["id"])
                continue
            assert reply["type"] == "delta"
            result["text"] += reply.get("text", "")
            result["token_ids"] += reply.get("token_ids", [])
            result["logprobs"] += reply.get("logprobs") or []
            if reply.get("finish_reason") is not None:
                for key in ("finish_reason", "prompt_tokens", "completion_tokens"):
                    result[key] = reply[key]
                open_ids.discard(reply["id"])
        return results


@pytest.fixture
def raw(stack):  # noqa: F811
    client = RawClient(stack.endpoint)
    try:
        yield client
    finally:
        client.close()


def generate(rid: str, prompt: str, **sampling) -> dict:
    return {"type": "generate", "id": rid, "prompt": prompt, "sampling": sampling}


def same_as_client(stack, result: dict, prompt: str, **sampling) -> None:  # noqa: F811
    done = stack.client.complete(prompt, params=SamplingParams(**sampling))
    assert result["text"] == done.text
    assert result["token_ids"] == done.token_ids
    assert result["finish_reason"] == done.finish_reason
    assert (result["prompt_tokens"], result["completion_tokens"]) == (done.prompt_tokens, done.completion_tokens)


def test_generate_matches_the_client(stack, raw):  # noqa: F811
    result = raw.run(generate("r1", "Once upon a time", max_tokens=9, temperature=0.0))["r1"]
    assert result["frames"] > 1 and result["finish_reason"] == "length"
    same_as_client(stack, result, "Once upon a time", max_tokens=9, temperature=0.0)


def test_stop_string_matches_the_client(stack, raw):  # noqa: F811
    stack.scripts["stop here"] = Script(stack.story_ids(), finish="endless")
    result = raw.run(generate("s1", "stop here", max_tokens=500, stop=[" over"]))["s1"]
    assert result["text"] == "The quick brown fox jumps" and result["finish_reason"] == "stop"
    same_as_client(stack, result, "stop here", max_tokens=500, stop=[" over"])


def test_interleaved_requests_are_routed_by_id(stack, raw):  # noqa: F811
    results = raw.run(*(generate(f"i{n}", f"interleave {n}", max_tokens=3 + n) for n in range(6)))
    for n in range(6):
        same_as_client(stack, results[f"i{n}"], f"interleave {n}", max_tokens=3 + n)


def test_token_ids_prompt_and_logprob_arrays(stack, raw):  # noqa: F811
    prompt = stack.tok.encode("ids please")
    request = {"type": "generate", "id": "t1", "token_ids": prompt, "sampling": {"max_tokens": 4, "logprobs": 0}}
    result = raw.run(request)["t1"]
    done = stack.client.complete(token_ids=prompt, params=SamplingParams(max_tokens=4, logprobs=0))
    assert result["token_ids"] == done.token_ids
    # TokenLogprob is a 4-element array: [token_id, logprob, top_ids, top_logprobs]
    assert [lp[0] for lp in result["logprobs"]] == result["token_ids"]
    assert [lp[:2] for lp in result["logprobs"]] == [[lp.token_id, lp.logprob] for lp in done.logprobs]


def test_errors_match_the_client(stack, raw):  # noqa: F811
    result = raw.run(generate("e1", "hi", top_p=0))["e1"]
    with pytest.raises(RequestError) as err:
        stack.client.complete("hi", params=SamplingParams(top_p=0.0))
    assert result["error"] == (err.value.code, err.value.message) == (
        "bad_request", "sampling.top_p must be in (0, 1] (got 0.0)")
    assert raw.run({"type": "generate", "id": "e2", "token_ids": [1] * 600})["e2"]["error"][0] == "too_long"


def test_abort_ends_with_an_abort_delta(stack, raw):  # noqa: F811
    stack.scripts["forever"] = Script(stack.story_ids(), finish="endless")
    raw.send(generate("a1", "forever", max_tokens=100_000))
    first = raw.recv()
    assert first["id"] == "a1" and "finish_reason" not in first
    raw.send({"type": "abort", "id": "a1"})
    while (reply := raw.recv()).get("finish_reason") is None:
        assert reply["type"] == "delta"
    assert reply["finish_reason"] == "abort" and reply["completion_tokens"] >= len(first["token_ids"])
    raw.send({"type": "abort", "id": "a1"})
    unknown = {"type": "error", "id": "a1", "code": "unknown_id", "message": "no running request with id 'a1'"}
    assert raw.recv() == unknown


def test_stats_and_health_match_the_client(stack, raw):  # noqa: F811
    raw.send({"type": "stats", "id": "q1"})
    stats = raw.recv()
    assert stats["type"] == "stats_reply" and stats["id"] == "q1"
    assert stats["stats"] == msgspec.to_builtins(stack.client.stats())
    raw.send({"type": "health", "id": "h1"})
    health = raw.recv()
    assert health["type"] == "health_reply" and health["healthy"] is True
    assert [p["name"] for p in health["processes"]] == [p.name for p in stack.client.health().processes]
    assert set(health["processes"][0]) == {"name", "pid", "uptime_s", "restarts", "alive"}


def test_the_documented_example_client_runs(stack):  # noqa: F811
    """§7's code, verbatim but for the address, prints the same text the Client gets."""
    section = PROTOCOL_MD.read_text(encoding="utf-8").split("## 7.", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("tcp://127.0.0.1:7410", stack.endpoint)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(PROTOCOL_MD), "exec"), {})
    done = stack.client.complete("Once upon a time", params=SamplingParams(max_tokens=32, temperature=0.0))
    assert out.getvalue() == f"{done.text} | {done.finish_reason} {done.completion_tokens} tokens\n"
