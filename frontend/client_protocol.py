"""What the sync and async clients share: the frames they send, how they read answers, their errors and results.

Both speak ZMQ DEALER → the server's ROUTER, one msgpack frame per message (docs/protocol.md), and route the
answers to waiting requests by id; only how they wait differs (a thread and queues vs the caller's event loop).
"""

from __future__ import annotations

import socket

import logging
import uuid
from dataclasses import dataclass, field

import msgspec

from metrale.ipc.messages import Abort, Delta, Error, Generate, Health, Resume, ServerMessage, Stats, TokenLogprob
from metrale.ipc.sampling import SamplingParams

log = logging.getLogger("metrale.frontend.client")

DEFAULT_PORT = 7410
DEFAULT_TIMEOUT_S = 60.0
# A request that has heard nothing this long checks that something listens at all (then fails at once if not).
UNREACHABLE_CHECK_S = 2.0


class RequestError(Exception):
    """The server answered a request with Error{code, message}."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ClientClosed(RuntimeError):
    """The client was closed while a request was waiting for its answer."""


@dataclass(slots=True)
class Completion:
    """A whole request's output, as `complete()` returns it."""

    id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with sampling.prompt_logprobs
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: Delta) -> None:
        """Fold one streamed delta into the completion."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.prompt_tokens = delta.prompt_tokens or 0
            self.completion_tokens = delta.completion_tokens or 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ServerMessage)


def server_address(host: str, port: int, address: str | None) -> str:
    """The endpoint to connect to: address when given, else tcp://host:port."""
    return address or f"tcp://{host}:{port}"


def new_id() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


def encode(msg: msgspec.Struct) -> bytes:
    """One client message as its frame."""
    return _encoder.encode(msg)


def generate_message(
    request_id: str, prompt: str | None, token_ids: list[int] | None, params: SamplingParams | None,
    api_key: str | None = None, lora: str | None = None, session: str | None = None,
) -> Generate:
    """The Generate for one request (lora: a LoRA adapter the server loaded; session: the client's, for a Resume)."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt and token_ids")
    return Generate(id=request_id, prompt=prompt, token_ids=token_ids, sampling=params or SamplingParams(),
                    api_key=api_key, lora=lora, session=session)


def generate_frame(
    request_id: str, prompt: str | None, token_ids: list[int] | None, params: SamplingParams | None,
    api_key: str | None = None, lora: str | None = None,
) -> bytes:
    """The Generate frame for one request (lora: a LoRA adapter the server loaded)."""
    return _encoder.encode(generate_message(request_id, prompt, token_ids, params, api_key, lora))


class ResumeBook:
    """A client's live requests and how many output tokens of each it received, so that after its connection to the
    frontend broke (the frontend died and was restarted) it can re-attach to each one exactly where its stream was
    (a Resume, docs/protocol.md §5.6). Not thread-safe: the sync client calls it under its lock."""

    def __init__(self) -> None:
        self.session = new_id()  # names this client's requests across connections
        self._live: dict[str, tuple[Generate, list[int]]] = {}  # id -> (its Generate, [tokens received])

    def started(self, msg: Generate) -> None:
        self._live[msg.id] = (msg, [0])

    def ended(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def received(self, msg) -> None:
        """Count a routed answer's tokens; forget the request at its final message."""
        entry = self._live.get(msg.id)
        if entry is None:
            return
        if isinstance(msg, Error):
            if msg.code != "unknown_id":  # that one only ever answers an Abort
                del self._live[msg.id]
        elif isinstance(msg, Delta):
            entry[1][0] += len(msg.token_ids)
            if msg.finish_reason is not None:
                del self._live[msg.id]

    def resume_frames(self) -> list[bytes]:
        """One Resume per live request: its Generate, and the tokens the client has of it."""
        return [_encoder.encode(Resume(**msgspec.structs.asdict(msg), offset=count[0]))
                for msg, count in self._live.values()]


def abort_frame(request_id: str, api_key: str | None = None) -> bytes:
    """The Abort frame for one request."""
    return _encoder.encode(Abort(id=request_id, api_key=api_key))


def keyed(msg: msgspec.Struct, api_key: str | None) -> bytes:
    """A query's frame, carrying the client's API key."""
    msg.api_key = api_key
    return _encoder.encode(msg)


def decode_answer(data: bytes) -> ServerMessage | None:
    """One server frame as its message; None (logged) when it does not decode."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        log.warning("metrale client: undecodable frame from the server dropped")
        return None


def check_new_id(closed: bool, waiters: dict, request_id: str) -> None:
    """ClientClosed when the client is closed, ValueError when request_id is already running on it."""
    if closed:
        raise ClientClosed("the client is closed")
    if request_id in waiters:
        raise ValueError(f"request id {request_id!r} is already running on this client")


def is_noise(msg: Delta | Error) -> bool:
    """A frame that says nothing about a running request's output.

    An empty non-final Delta is the server checking that the client is still there; an Error "unknown_id" only
    ever answers an Abort (of a request that had already finished), never a Generate.
    """
    if isinstance(msg, Error):
        return msg.code == "unknown_id"
    return msg.finish_reason is None and not msg.text and not msg.token_ids and not msg.logprobs


def query_answer(reply, request_id: str):
    """A one-answer query's reply; RequestError when the server answered Error."""
    if isinstance(reply, Error):
        raise RequestError(reply.code, reply.message, request_id)
    return reply


class ServerUnreachable(TimeoutError):
    """Nothing listens at the client's address (raised within UNREACHABLE_CHECK_S, not after the timeout)."""


def unreachable(address: str) -> ServerUnreachable | None:
    """ServerUnreachable when nothing accepts TCP connections at address (a tcp:// one); None otherwise."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return None
    except (OSError, ValueError) as e:
        return ServerUnreachable(f"no metrale server at {address}: nothing is listening there ({e}); "
                                 "start one with `metrale serve`, or check --host and --port")


def timeout_error(address: str, request_id: str, timeout: float) -> TimeoutError:
    """The error for a server that went silent."""
    return TimeoutError(
        f"no answer from the metrale server at {address} for request {request_id!r} within {timeout:g} s "
        "(is `metrale serve` running and listening there?)"
    )
