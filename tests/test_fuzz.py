"""Hostile input: more than 10,000 malformed or adversarial frames to a real `metrale serve`'s client port.

Nothing may crash (every pid and restart count is unchanged afterwards), every frame is answered with exactly
one Error — under the id the frame carried when the server can read one, else under "" — and a normal request
still succeeds at the end. The frames come from a seeded generator (plain `random`), so a failure reproduces:
each is a well-formed request with one thing made wrong (a wrong type, a value out of range, too many or too
long of something), a structural breakage (truncated msgpack, garbage bytes, unknown tags, nesting deeper than
any decoder recurses), or a frame shape (extra envelope parts) the protocol does not expect.
"""

from __future__ import annotations

import math
import random
import time

import msgspec
import pytest
import zmq

from metrale import SamplingParams
from metrale.ipc.messages import Error, ServerMessage
from metrale.ipc.sampling import MAX_LOGPROBS, MAX_STOP_STRINGS

from serve_fixture import running_server

NUM_FRAMES = 10_500
BATCH = 500
VOCAB = 2048  # the tiny test model's (checked against the server's answer below)
MAX_MODEL_LEN = 512

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.Decoder(ServerMessage).decode


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama")) as s:
        yield s


# ---- the frames ---------------------------------------------------------------------------------

# Each sampling field with values it must refuse (wrong types and out-of-range values).
BAD_SAMPLING: dict[str, list] = {
    "max_tokens": [0, -1, -(2**63), 1.5, "8", [8], None, True],
    "temperature": [-0.1, math.nan, math.inf, -math.inf, "hot", [1.0], {"t": 1}],
    "top_k": [-2, -(2**63), 2.5, "k", [1]],
    "top_p": [0.0, -1.0, 1.0001, math.nan, math.inf, "p"],
    "min_p": [-0.5, 1.5, math.nan, [0.1]],
    "repetition_penalty": [0.0, -1.0, math.nan, math.inf, "r"],
    "presence_penalty": [2.5, -3.0, math.nan, -math.inf],
    "frequency_penalty": [2.01, -2.01, math.inf, {"f": 0}],
    "seed": [-1, 2**63, 2**64 - 1, -(2**63), 1.5, "seed", [1]],
    "stop": ["stop", [1, 2], [""], ["x" * 257], ["s"] * (MAX_STOP_STRINGS + 1), ["s"] * 10_000, [None]],
    "stop_token_ids": [[-1], [VOCAB], [2**63 - 1], list(range(33)), "1", [1.5]],
    "ignore_eos": ["yes", 1.5, [True]],
    "min_tokens": [-1, 10**6, "1"],
    "logprobs": [-1, MAX_LOGPROBS + 1, 10**9, 2**63 - 1, "5", 0.5],
    "skip_special_tokens": ["no", [0]],
    "max_thinking_tokens": [-1, -(2**63), "x"],
    "adaptive_sampling": ["on", {}],
    "priority": ["high", 1.5, [0]],
}


def _valid_generate(rid: str, rng: random.Random) -> dict:
    """A request the server would run (the starting point of most mutations)."""
    msg = {"type": "generate", "id": rid, "sampling": {"max_tokens": 4, "temperature": 0.0}}
    if rng.random() < 0.5:
        msg["prompt"] = "".join(rng.choice("abc xyz\n") for _ in range(rng.randint(1, 40)))
    else:
        msg["token_ids"] = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
    return msg


def _deep(depth: int) -> bytes:
    """msgpack of a list nested `depth` deep (deeper than any recursive decoder goes)."""
    return b"\x91" * depth + b"\x90"


def _junk(rng: random.Random, depth: int = 0):
    """A random msgpack-encodable value: scalars, strings, lists and maps of junk."""
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 1:
        return rng.choice([math.nan, math.inf, -math.inf, rng.uniform(-1e300, 1e300)])
    if kind == 2:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randint(0, 20)))
    if kind == 3:
        return rng.randbytes(rng.randint(0, 20))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(["abort", "delta", "error", "stats_reply", ""])  # never a tag that makes a valid query
    if kind == 6:
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    if kind == 7:
        return {rng.choice(["id", "type", "prompt", "x"]): _junk(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return {"type": rng.choice(["generate", "abort"]), "id": _junk(rng, depth + 1)}  # no prompt: never valid


def make_frame(k: int, rng: random.Random) -> tuple[list[bytes], str | None]:
    """Frame k: its parts and the id its Error must carry (None: not known in advance, "" or salvaged)."""
    rid = f"fz{k}"
    kind = k % 16
    if kind == 0:  # one sampling field wrong
        msg = _valid_generate(rid, rng)
        field = rng.choice(list(BAD_SAMPLING))
        msg["sampling"][field] = rng.choice(BAD_SAMPLING[field])
        return [_encode(msg)], rid
    if kind == 1:  # a top-level field of the wrong type
        msg = _valid_generate(rid, rng)
        key, value = rng.choice([
            ("prompt", 123), ("prompt", ["a"]), ("prompt", {"a": 1}), ("token_ids", "1 2 3"),
            ("token_ids", [1.5]), ("token_ids", [[1]]), ("token_ids", {"0": 1}), ("sampling", [1, 2]),
            ("sampling", "greedy"), ("sampling", 7),
        ])
        msg.pop("prompt", None), msg.pop("token_ids", None)
        msg[key] = value
        return [_encode(msg)], rid
    if kind == 2:  # token ids out of the vocabulary, or huge
        msg = _valid_generate(rid, rng)
        msg.pop("prompt", None)
        msg["token_ids"] = [1, rng.choice([-1, VOCAB, 2**31, 2**63 - 1, -(2**63), 2**64 - 1]), 2]
        return [_encode(msg)], rid
    if kind == 3:  # prompt and token_ids both, or neither, or an empty token list
        msg = _valid_generate(rid, rng)
        choice = rng.randrange(3)
        if choice == 0:
            msg["prompt"], msg["token_ids"] = "hello", [1, 2]
        elif choice == 1:
            msg.pop("prompt", None), msg.pop("token_ids", None)
        else:
            msg.pop("prompt", None)
            msg["token_ids"] = []
        return [_encode(msg)], rid
    if kind == 4:  # too long: a prompt of more tokens than the model takes
        msg = _valid_generate(rid, rng)
        msg.pop("prompt", None)
        length = 100_000 if k % 1600 == 4 else rng.choice([MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 5000])
        msg["token_ids"] = [rng.randrange(3, VOCAB) for _ in range(length)]
        return [_encode(msg)], rid
    if kind == 5:  # a missing, empty, oversized or non-string id
        msg = _valid_generate(rid, rng)
        choice = rng.randrange(5)
        if choice == 0:
            del msg["id"]
        elif choice == 1:
            msg["id"] = ""
        elif choice == 2:
            msg["id"] = "i" * rng.choice([257, 10_000])
        else:
            msg["id"] = rng.choice([7, 2**64 - 1, None, ["id"], {"id": "x"}, 1.5])
        return [_encode(msg)], ""
    if kind == 6:  # unknown or missing tags
        msg = _valid_generate(rid, rng)
        msg["type"] = rng.choice(["explode", "Generate", "", "delta", "error", "stats_reply", 5, None])
        if rng.random() < 0.2:
            del msg["type"]
        return [_encode(msg)], rid
    if kind == 7:  # an abort, stats or health query that is wrong
        choice = rng.randrange(4)
        if choice == 0:
            return [_encode({"type": "abort", "id": rid})], rid  # nothing runs under it: unknown_id
        if choice == 1:
            return [_encode({"type": rng.choice(["abort", "stats", "health"]), "id": rng.choice([3, None, ""])})], ""
        if choice == 2:
            return [_encode({"type": rng.choice(["abort", "stats", "health"])})], ""
        return [_encode({"type": "abort", "id": rid, "junk": _junk(rng)})], rid  # unknown fields are ignored
    if kind == 8:  # truncated msgpack
        whole = _encode(_valid_generate(rid, rng))
        return [whole[: rng.randrange(len(whole))]], ""
    if kind == 9:  # random bytes
        return [rng.randbytes(rng.randint(0, 400))], None
    if kind == 10:  # random structures
        return [_encode(_junk(rng))], None
    if kind == 11:  # nesting far deeper than any recursive decoder goes, where the id is and where it is not
        choice = rng.randrange(3)
        if choice == 0:  # {"type": "generate", "id": rid, "junk": [[[...]]]}
            head = _encode({"type": "generate", "id": rid})
            return [b"\x83" + head[1:] + b"\xa4junk" + _deep(100_000 if k % 480 == 11 else 2000)], None
        if choice == 1:
            return [_deep(100_000 if k % 480 == 11 else 2000)], ""
        return [b"\x83\xa4type\xa8generate\xa2id" + _deep(5000) + b"\xa6prompt\xa1a"], None
    if kind == 12:  # extra envelope parts before the payload (a REQ-style or hostile peer)
        msg = _valid_generate(rid, rng)
        msg["sampling"]["top_p"] = 0.0
        junk = [rng.randbytes(rng.randint(0, 30)) for _ in range(rng.randint(1, 4))]
        return [*junk, _encode(msg)], rid
    if kind == 13:  # a frame over max_frame_bytes (1 MiB by default), rarely: they are big
        if k % 1600 == 13:
            msg = _valid_generate(rid, rng)
            msg.pop("token_ids", None)
            msg["prompt"] = "z" * (1 << 20)
            return [_encode(msg)], rid
        msg = _valid_generate(rid, rng)
        msg["sampling"]["stop"] = ["w" * 300] * 20  # long and many stop strings
        return [_encode(msg)], rid
    if kind == 14:  # a huge logprobs count or max_tokens of the wrong kind, with many stop strings
        msg = _valid_generate(rid, rng)
        msg["sampling"].update(logprobs=rng.choice([21, 10**6, 2**63 - 1]), stop=["a", "b"] * rng.randint(9, 50))
        return [_encode(msg)], rid
    # kind 15: msgpack that is valid but not a map: a list, a string, a number, nil, or an ext type
    value = rng.choice([[rid, "generate"], rid, 42, None, msgspec.msgpack.Ext(5, b"boom"), b"\x00" * 10])
    return [_encode(value)], ""


# ---- the test ------------------------------------------------------------------------------------


def _health(server):
    with server.client(timeout=30) as c:
        h = c.health()
    return {p.name: (p.pid, p.restarts, p.alive) for p in h.processes}, h.healthy


def test_ten_thousand_hostile_frames_crash_nothing_and_each_gets_an_error(server):
    before, healthy = _health(server)
    assert healthy
    rng = random.Random(20260611)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    planted: set[str] = set()  # ids the server must answer under
    blank = 0  # frames whose Error must carry id "" (no readable id)
    answered: dict[str, int] = {}  # Error id -> how many
    codes: dict[str, int] = {}
    sent = 0
    try:
        for start in range(0, NUM_FRAMES, BATCH):
            for k in range(start, min(start + BATCH, NUM_FRAMES)):
                parts, want = make_frame(k, rng)
                sock.send_multipart(parts)
                if want:
                    planted.add(want)
                blank += want == ""
                sent += 1
            while sum(answered.values()) < sent:
                if not sock.poll(10_000):
                    missing = sorted(rid for rid in planted if rid not in answered)
                    pytest.fail(f"{sent - sum(answered.values())} of {sent} frames unanswered, e.g. {missing[:5]}")
                reply = _decode(sock.recv_multipart()[-1])
                assert isinstance(reply, Error), f"a hostile frame was not refused: {reply}"
                answered[reply.id] = answered.get(reply.id, 0) + 1
                codes[reply.code] = codes.get(reply.code, 0) + 1
    finally:
        sock.close(0)
        ctx.term()
    assert sent >= 10_000
    assert sum(answered.values()) == sent, "exactly one Error per frame"
    missing = [rid for rid in planted if answered.get(rid) != 1]
    assert not missing, f"{len(missing)} frames were not answered under their id, e.g. {missing[:5]}"
    assert answered.get("", 0) >= blank
    assert set(codes) <= {"bad_request", "too_long", "unknown_id"}, codes
    after, healthy = _health(server)
    assert after == before and healthy, "no process crashed or restarted"
    with server.client() as c:
        out = c.complete("def f(x):", params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert out.finish_reason == "length" and len(out.token_ids) == 8
        deadline = time.monotonic() + 5.0
        while (stats := c.stats()).running or stats.waiting or stats.kv_blocks_used:  # retired on a later tick
            assert time.monotonic() < deadline, f"the engine is not idle: {stats}"
            time.sleep(0.02)  # polling the engine's counters; there is no event to wait on
    print(f"\n{sent} frames: {len(planted)} answered under their id, {answered.get('', 0)} under \"\"; by code: {codes}")
