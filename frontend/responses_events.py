"""The Responses API's output: the items (reasoning, message, function_call) a chat choice's parts make, opened and
closed as the parts arrive, with the SSE events that announce each step — the shapes `openai.types.responses`
parses and its stream accumulator (`client.responses.stream`) follows.

One builder serves both answers: a stream feeds it each Delta's parts and sends the events; a whole answer feeds it
the collected parts once and keeps only the items, so the two cannot disagree about what the output is.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import msgspec
import numpy as np

REASONING, MESSAGE, FUNCTION_CALL = "reasoning", "message", "function_call"


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's spelling: resp_…, msg_…, fc_…, rs_…."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class _Item:
    """The output item being built: its kind, its place in the output, its text (or arguments) so far."""

    kind: str
    index: int
    id: str
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # a message's output_text logprobs
    call_id: str = ""
    name: str = ""

    def whole(self, status: str) -> dict:
        """The item as output_item.done and the response's output carry it."""
        text = "".join(self.text)
        if self.kind == MESSAGE:
            return {"type": MESSAGE, "id": self.id, "role": "assistant", "status": status,
                    "content": [_output_text(text, self.logprobs)]}
        if self.kind == REASONING:
            return {"type": REASONING, "id": self.id, "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": text}]}
        return {"type": FUNCTION_CALL, "id": self.id, "call_id": self.call_id, "name": self.name, "arguments": text,
                "status": status}


def _output_text(text: str, logprobs: list[dict]) -> dict:
    """A message's output_text content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


class OutputItems:
    """A response's output items, built from a chat choice's (reasoning, content, tool-call deltas) as they come.

    One item is open at a time: output of another kind (reasoning, text, a new call) closes it and opens the next,
    in the order the model wrote them. Each step returns its events without sequence numbers (the stream numbers
    them as it sends them). call_limit: calls past it are dropped (parallel_tool_calls false: 1)."""

    def __init__(self, call_limit: int | None = None) -> None:
        self.done: list[dict] = []  # closed items, in output order: the response's `output`
        self._open: _Item | None = None
        self._count = 0  # items opened so far: the next output_index
        self._call_limit = call_limit
        self._pending_logprobs: list[dict] = []  # of tokens before the first text (reasoning, a tag): the text's

    def add(self, reasoning: str, content: str, calls: list[dict], logprobs: list[dict]) -> list[dict]:
        """Take one piece of output (any part may be empty); the events it makes."""
        events: list[dict] = []
        if reasoning:
            events += self._append(REASONING, reasoning, "response.reasoning_text.delta")
        self._pending_logprobs += logprobs
        if content:
            events += self._append(MESSAGE, content, "response.output_text.delta")
        for delta in calls:
            events += self._call(delta)
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open item with the response's status ("completed" / "incomplete"); an answer that wrote
        nothing gets an empty message, so `output_text` is "" rather than missing."""
        events = [] if self.done or self._open else self._open_item(MESSAGE)
        if self._open is not None and self._open.kind == MESSAGE:  # the last tokens' (an end-of-sequence token's)
            self._open.logprobs += self._pending_logprobs
        self._pending_logprobs = []
        return events + self._close(status)

    def _append(self, kind: str, text: str, delta_type: str) -> list[dict]:
        """Text of one kind: into the open item of that kind, or a new one."""
        same = self._open is not None and self._open.kind == kind
        events = [] if same else self._close("completed") + self._open_item(kind)
        item = self._open
        item.text.append(text)
        event = {"type": delta_type, "item_id": item.id, "output_index": item.index, "content_index": 0, "delta": text}
        if kind == MESSAGE:
            event["logprobs"], self._pending_logprobs = self._pending_logprobs, []
            item.logprobs += event["logprobs"]
        return events + [event]

    def _call(self, delta: dict) -> list[dict]:
        """One tool-call delta: a head (it has an id) opens a function_call item; argument pieces extend it."""
        if self._call_limit is not None and delta["index"] >= self._call_limit:
            return []
        events: list[dict] = []
        if "id" in delta:
            events = self._close("completed") + self._open_item(FUNCTION_CALL, call_id=delta["id"],
                                                                 name=delta["function"]["name"])
        piece = delta["function"].get("arguments", "")
        if piece:
            item = self._open
            item.text.append(piece)
            events.append({"type": "response.function_call_arguments.delta", "item_id": item.id,
                           "output_index": item.index, "delta": piece})
        return events

    def _open_item(self, kind: str, call_id: str = "", name: str = "") -> list[dict]:
        prefix = {MESSAGE: "msg", REASONING: "rs", FUNCTION_CALL: "fc"}[kind]
        item = self._open = _Item(kind, self._count, new_id(prefix), call_id=call_id, name=name)
        self._count += 1
        added = {"type": "response.output_item.added", "output_index": item.index, "item": item.whole("in_progress")}
        if kind == FUNCTION_CALL:
            return [added]
        added["item"]["content"] = []  # its part is announced next, and filled by the deltas
        part = _output_text("", []) if kind == MESSAGE else {"type": "reasoning_text", "text": ""}
        return [added, {"type": "response.content_part.added", "item_id": item.id, "output_index": item.index,
                        "content_index": 0, "part": part}]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        if item.kind == FUNCTION_CALL and _is_json("".join(item.text)):  # a call written whole, though the text
            status = "completed"  # after it was cut
        whole = item.whole(status)
        self.done.append(whole)
        at = {"item_id": item.id, "output_index": item.index}
        done = {"type": "response.output_item.done", "output_index": item.index, "item": whole}
        if item.kind == FUNCTION_CALL:
            return [{"type": "response.function_call_arguments.done", **at, "name": item.name,
                     "arguments": whole["arguments"]}, done]
        part = whole["content"][0]
        if item.kind == MESSAGE:
            text_done = {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                         "logprobs": part["logprobs"]}
        else:
            text_done = {"type": "response.reasoning_text.done", **at, "content_index": 0, "text": part["text"]}
        return [text_done, {"type": "response.content_part.done", **at, "content_index": 0, "part": part}, done]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class EventStream:
    """Numbers and encodes a stream's events (sequence_number counts every event sent, from 0), as
    `event: <type>` / `data: <json>` SSE records."""

    def __init__(self) -> None:
        self.sent = 0

    def encode(self, events: list[dict]) -> bytes:
        """The SSE bytes of these events, numbered on from the last ones."""
        out = []
        for event in events:
            event["sequence_number"] = self.sent
            self.sent += 1
            out.append(b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n")
        return b"".join(out)


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    """The Responses API's usage object. cache_write_tokens (which the openai client requires) is 0: the prefix
    cache keeps a prompt's blocks as a side effect, nothing is written to it on request."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


def reasoning_token_count(token_ids: list[int], start_id: int, end_id: int, opened: bool) -> int:
    """How many output tokens are reasoning: the tags and everything between them (as the chat route's splitter
    reads them: a start tag enters reasoning, an end tag leaves it). opened: the prompt left reasoning open."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size == 0:
        return 0
    is_start, is_end = ids == start_id, ids == end_id
    tagged = is_start | is_end
    # The state before each token is that of the last tag before it (or the prompt's, before any tag).
    last = np.maximum.accumulate(np.where(tagged, np.arange(ids.size), -1))
    before = np.concatenate(([-1], last[:-1]))
    inside = np.where(before >= 0, is_start[np.maximum(before, 0)], opened)
    return int(np.count_nonzero(inside | is_start))
