"""What the server checks of a client's frame before it acts on it, and the error a failed check becomes.

A frame must fit max_frame_bytes, decode as a ClientMessage and carry an id of 1..max_id_chars characters; a
Generate must give exactly one of prompt and token_ids, token ids in the vocabulary, and valid sampling
parameters. Each failure is Rejected(code, message), answered with Error{id, code, message} under the id the
frame carried when one can be read, else "".
"""

from __future__ import annotations

import msgspec
import zmq

from metrale.ipc.errors import ErrorCode, Refused
from metrale.ipc.messages import ClientMessage, Generate
from metrale.ipc.sampling import logprobs_cap
from metrale.settings import DEFAULTS

MAX_CACHE_SALT_CHARS = 256


class Rejected(Refused):
    """A request the server will not run; becomes Error{code, message} (under request_id for a bad frame)."""

    def __init__(self, code: ErrorCode | str, message: str, request_id: str = "") -> None:
        super().__init__(ErrorCode(code), message)
        self.request_id = request_id


class _IdOnly(msgspec.Struct):
    """Just the id of a frame that failed to decode as a ClientMessage."""

    id: object = None


def read_client_frame(decoder: msgspec.msgpack.Decoder, data: memoryview | bytes, max_frame_bytes: int,
                      max_id_chars: int) -> ClientMessage:
    """The message a client frame holds; Rejected when it is too long, malformed or has no usable id."""
    if len(data) > max_frame_bytes:
        message = f"frame of {len(data)} bytes exceeds max_frame_bytes {max_frame_bytes}"
        raise Rejected("too_long", message, salvage_id(data))
    try:
        msg = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # deep nesting: RecursionError
        raise Rejected("bad_request", f"malformed message: {exc}", salvage_id(data)) from None
    if not msg.id or len(msg.id) > max_id_chars:
        raise Rejected("bad_request", f"id must have 1..{max_id_chars} characters")
    return msg


def check_generate(msg: Generate, vocab_size: int, max_logprobs: int = DEFAULTS.max_logprobs) -> None:
    """Exactly one of prompt and token_ids, token ids in the vocabulary, valid sampling (logprobs up to the server's
    --max-logprobs, -1 the vocabulary); else Rejected."""
    if (msg.prompt is None) == (msg.token_ids is None):
        raise Rejected("bad_request", "exactly one of prompt and token_ids must be given")
    if msg.prompt is not None and not msg.prompt or msg.token_ids is not None and not msg.token_ids:
        raise Rejected("bad_request", "the prompt is empty")
    if msg.cache_salt is not None and not 0 < len(msg.cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise Rejected("bad_request", f"cache_salt must have 1..{MAX_CACHE_SALT_CHARS} characters")
    if msg.token_ids is not None:
        bad = [t for t in msg.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise Rejected("bad_request", f"token id {bad[0]} is out of vocabulary: token_ids must be in "
                           f"[0, {vocab_size}) (got {bad[:5]})")
    try:
        msg.sampling.validate(vocab_size, logprobs_cap(max_logprobs, vocab_size))
    except ValueError as exc:
        raise Rejected("bad_request", f"sampling.{exc}") from None
    if msg.sampling.n != 1:
        raise Rejected("bad_request", f"sampling.n must be 1 over ZMQ (got {msg.sampling.n}): send n requests, "
                                      "seed + j for the j-th when seeded")


def salvage_id(data: memoryview | bytes) -> str:
    """The string id of a frame that failed validation, or "" when there is none to read."""
    try:
        found = msgspec.msgpack.decode(data, type=_IdOnly).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return ""
    return found if isinstance(found, str) else ""


def source_fd(frame: zmq.Frame) -> int | None:
    """The file descriptor of the connection a frame came in on, when libzmq tells."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None
