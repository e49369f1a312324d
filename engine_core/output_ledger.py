"""OutputLedger: what the engine core has streamed of each resumable request, so that a client whose frontend died
can re-attach to it (docs/protocol.md §5.6).

A frontend files a request under a resume key (AddRequest.resume_key: its client's session and id, or an HTTP
request id). The ledger keeps every output token of such a request (and its logprobs, when asked) for as long as it
runs, and its final output for RESUME_WINDOW_S after it ends: the frontend cannot know what its client received, so
nothing is dropped on its word. A frontend that comes back after a restart (FrontendUp: its engine ids' prefix) re-
attaches a request by key (AddRequest.reattach): the ledger answers one catch-up output with everything so far, under
the new frontend's id, and rewrites the request's later outputs to that id. The engine core itself never learns of
it: it runs the request under the id it was first given.

Requests of a frontend that is gone: plain ones (no key) are aborted as soon as the next frontend comes up in its place
(nobody can ask for them again); resumable ones run on and are aborted when nobody re-attaches within RESUME_WINDOW_S.
With several frontends (--api-server-count) "in its place" is at the same index (ipc/frontend_ids.py): the requests of
the frontends beside it are theirs and stay as they are, and a frontend known to be dead (its connection dropped,
engine_core/frontend_links.py) is as good as gone for a re-attach through another frontend, before its successor
comes up.
Bounded: a request's tokens are bounded by max_model_len, and at most MAX_HELD_FINISHED finished requests are kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from metrale.ipc.frontend_ids import frontend_of_prefix, prefix_of
from metrale.ipc.messages import AddRequest, RequestOutputDelta, TokenLogprob

RESUME_WINDOW_S = 30.0  # a request nobody re-attaches within this (its frontend gone, or finished) is forgotten
MAX_HELD_FINISHED = 4096


@dataclass(slots=True)
class Held:
    """One resumable request: its outputs so far, and the id they go out under now."""

    key: str
    engine_id: str  # the id the engine core runs it under (its AddRequest's)
    sent_as: str  # the id of its outputs to the frontend (a re-attach changes it)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int | None = None
    final: RequestOutputDelta | None = None  # its last output (finish_reason set) once it ended
    ended_at: float | None = None  # when it ended, or when its frontend was found gone (monotonic)


class OutputLedger:
    """Resumable requests by key and by engine id; the live plain ones by engine id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = RESUME_WINDOW_S,
                 max_finished: int = MAX_HELD_FINISHED) -> None:
        self.clock = clock
        self.window_s = window_s
        self.max_finished = max_finished
        self._by_key: dict[str, Held] = {}
        self._by_engine: dict[str, Held] = {}  # the engine core's id -> its request
        self._by_sent: dict[str, Held] = {}  # the frontend's id now -> its request
        self._plain: set[str] = set()  # live requests without a key
        self._ended: OrderedDict[str, None] = OrderedDict()  # keys whose ended_at is set, oldest first

    def __len__(self) -> int:
        return len(self._by_key) + len(self._plain)

    def added(self, msg: AddRequest) -> str | None:
        """A request the engine core admitted. Returns the engine id of an older request held under the same key,
        which the caller aborts (the client started its id afresh instead of resuming it)."""
        if msg.resume_key is None:
            self._plain.add(msg.request_id)
            return None
        old = self._forget(msg.resume_key)
        held = Held(msg.resume_key, msg.request_id, msg.request_id)
        self._by_key[held.key] = self._by_engine[held.engine_id] = self._by_sent[held.sent_as] = held
        return old.engine_id if old is not None and old.final is None else None

    def attach(self, msg: AddRequest, gone: Callable[[str], bool] = lambda sent_as: False
               ) -> RequestOutputDelta | None:
        """Re-attach the request held under msg.resume_key to msg.request_id: its catch-up output (every token so
        far, and its end if it ended), or None when nothing is held under that key, or the request still runs for a
        frontend that lives. gone(id): whether the frontend an id belongs to is known to be dead (its connection
        dropped) before a successor said FrontendUp: another frontend may then take its request (--api-server-count)."""
        held = self._by_key.get(msg.resume_key)
        if held is None or (held.ended_at is None and not gone(held.sent_as)):  # a live frontend streams it
            return None
        self._by_sent.pop(held.sent_as, None)
        held.sent_as = msg.request_id
        self._by_sent[held.sent_as] = held
        if held.final is None:  # live again: no longer counted down
            held.ended_at = None
            self._ended.pop(held.key, None)
        final = held.final or RequestOutputDelta(msg.request_id, [])
        return RequestOutputDelta(
            msg.request_id, list(held.token_ids), final.finish_reason,
            list(held.logprobs) if held.logprobs is not None else None, final.error, final.error_code,
            held.num_cached_tokens, held.prompt_logprobs, final.embedding)

    def engine_id(self, sent_id: str) -> str:
        """The engine core's id of the request the frontend calls sent_id (an AbortRequest's)."""
        held = self._by_sent.get(sent_id)
        return held.engine_id if held is not None else sent_id

    def record(self, outputs: list[RequestOutputDelta]) -> None:
        """Note outputs on their way to the frontend, and give each resumable one the id the frontend knows."""
        for out in outputs:
            held = self._by_engine.get(out.request_id)
            if held is None:
                if out.finish_reason is not None:
                    self._plain.discard(out.request_id)
                continue
            out.request_id = held.sent_as
            held.token_ids += out.new_token_ids
            if out.logprobs is not None:
                held.logprobs = (held.logprobs or []) + out.logprobs
            if out.prompt_logprobs is not None and held.prompt_logprobs is None:
                held.prompt_logprobs = out.prompt_logprobs
            if out.num_cached_tokens is not None and held.num_cached_tokens is None:
                held.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason is not None:
                self._end(held, RequestOutputDelta(held.sent_as, [], out.finish_reason, None, out.error,
                                                   out.error_code, embedding=out.embedding))

    def aborted(self, engine_id: str) -> None:
        """The frontend aborted a request (its client asked, or went away): nobody re-attaches to it, and a retry
        under its key starts afresh."""
        held = self._by_engine.get(engine_id)
        if held is not None:
            self._forget(held.key)
        self._plain.discard(engine_id)

    def frontend_up(self, prefix: str) -> list[str]:
        """A frontend came up whose engine ids start with prefix + "-": the engine ids of the plain requests of the
        frontends before it at its index, to abort now. Their resumable ones are counted down from now."""
        mine, index = prefix + "-", frontend_of_prefix(prefix)

        def before_it(rid: str) -> bool:
            return not rid.startswith(mine) and frontend_of_prefix(prefix_of(rid)) == index

        stale = [rid for rid in self._plain if before_it(rid)]
        self._plain.difference_update(stale)
        now = self.clock()
        for held in self._by_key.values():
            if held.final is None and held.ended_at is None and before_it(held.sent_as):
                held.ended_at = now
                self._ended[held.key] = None
        return stale

    def expire(self) -> list[str]:
        """Forget what waited past the window; returns the engine ids of live requests nobody re-attached, which
        the caller aborts."""
        if not self._ended:
            return []
        deadline = self.clock() - self.window_s
        gone: list[str] = []
        while self._ended:
            key = next(iter(self._ended))
            held = self._by_key[key]
            if held.ended_at > deadline and len(self._ended) <= self.max_finished:
                break
            self._forget(key)
            if held.final is None:
                gone.append(held.engine_id)
        return gone

    def _end(self, held: Held, final: RequestOutputDelta) -> None:
        held.final, held.ended_at = final, self.clock()
        self._ended.pop(held.key, None)
        self._ended[held.key] = None

    def _forget(self, key: str) -> Held | None:
        held = self._by_key.pop(key, None)
        if held is not None:
            self._by_engine.pop(held.engine_id, None)
            self._by_sent.pop(held.sent_as, None)
            self._ended.pop(key, None)
        return held
