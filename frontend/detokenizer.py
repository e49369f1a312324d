"""IncrementalDetokenizer: token ids in, text deltas out, one per request, with stop strings.

The "prefix offset / read offset" technique (HF TextStreamer, vLLM): the text of the new tokens is the decode of
a short window `ids[prefix:]` minus the decode of `ids[prefix:read]`, so a token's text is decoded in the context
of the token before it (SentencePiece's leading spaces come out right). The window advances only when its text
grew and does not end in U+FFFD — a UTF-8 character split across tokens waits for its last byte and is never
emitted as replacement characters mid-way.

Stop strings: text that might be the beginning of a stop string is held back; when a stop string completes, the
text before it is emitted, the request is stopped, and no character of the stop string is ever emitted.

The output text is the decode of the output ids in the context of the prompt's last few tokens; for byte-level
BPE tokenizers that equals `tokenizer.decode(output_ids)`. Pure and synchronous: the server and the offline
`metrale.LLM` share it.

Over metrale's Tokenizer the per-token step is `tokenizers`' own DecodeStream (the same window technique in Rust:
one call a token instead of two decodes and two list slices), started from the same prompt context; the window
above then serves only the end of a request (text still held mid-character) and other decoders (a chat's
tag-keeping one). Over a byte-level decoder most ids need no call at all: once every id before it is text, an
id whose own bytes are whole characters adds exactly its own text (`_decodes_bytewise`), which the tokenizer
decodes once per id, when first met (`Tokenizer.token_texts`). The DecodeStream does not see such ids; the next
id it steps comes after whole characters, where no context changes a byte-level text, so its text is what stepping
every id would have given (tests/test_detokenizer.py compares the two on valid and on broken UTF-8).

A caller that does not stream (the offline LLM) hands a request's ids over once, at its end (`finish`). On a
byte-level tokenizer without stop strings that is a single decode of the window: the per-token windows' texts
telescope (see `_decodes_bytewise`), so the text is exactly what pushing the ids one by one would have emitted.
"""

from __future__ import annotations

from typing import Protocol

from tokenizers import decoders
from tokenizers.decoders import DecodeStream

from metrale.frontend.tokenizer import UNDECODED, Tokenizer
from metrale.ipc.sampling import SamplingParams

# Prompt tokens decoded before the first output token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """One request's detokenization state; push new ids, get new text."""

    __slots__ = (
        "_tok", "_skip", "_stops", "_ids", "_prefix", "_read", "_prefix_text", "_pending", "_pieces",
        "_bytewise", "_stream", "_backend", "_covered", "_texts", "output_ids", "stopped", "stop_string",
    )

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._skip = params.skip_special_tokens
        self._stops: tuple[str, ...] = tuple(s for s in params.stop if s)
        self._ids, self._prefix_text = _prompt_context(tokenizer, prompt_ids, self._skip)
        self._prefix = 0
        self._read = len(self._ids)
        self._bytewise = not self._stops and _decodes_bytewise(tokenizer)  # finish() may decode once
        # Over a tokenizers backend, each pushed id is one DecodeStream step; _covered counts the ids its chunks
        # have turned into text, and the window (_prefix, _read, _prefix_text) moves there only when it is needed.
        self._backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else None
        self._stream = DecodeStream(self._ids, skip_special_tokens=self._skip) if self._backend is not None else None
        self._covered = self._read
        # Byte-level: each id's own text (None: not whole characters). An id taken from it is not stepped through
        # the stream, whose window then ends on whole characters, so its next step's text is its id's own all the same.
        self._texts = tokenizer.token_texts(self._skip) if _decodes_bytewise(tokenizer) else None
        self._pending = ""  # decoded text not emitted yet: a possible stop-string start
        self._pieces: list[str] = []  # everything emitted, for `text`
        self.output_ids: list[int] = []  # ids accepted (those after a stop string are not)
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the request

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    @property
    def has_stop_strings(self) -> bool:
        """True when a push may stop the request, so ids must be pushed as they come."""
        return bool(self._stops)

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed new ids; return (text to emit now, whether a stop string ended the request)."""
        if len(token_ids) == 1 and not self._stops and not self.stopped:  # one id a step: most pushes
            token_id = token_ids[0]
            texts, ids = self._texts, self._ids
            if texts is not None and self._covered == len(ids) and 0 <= token_id < len(texts):
                new_text = texts[token_id]
                if new_text is UNDECODED:
                    new_text = self._tok.token_text(token_id, self._skip)
                if new_text is not None:  # _next_text's table path, inline
                    ids.append(token_id)
                    self.output_ids.append(token_id)
                    self._covered += 1
                    if new_text:
                        self._pieces.append(new_text)
                    return new_text, False
            new_text = self._next_text(token_id)
            if new_text:
                self._pieces.append(new_text)
            return new_text, False
        out: list[str] = []
        for token_id in token_ids:
            if self.stopped:
                break
            new_text = self._next_text(token_id)
            if new_text:
                out.append(self._release(new_text, final=False))
        return self._emit("".join(out)), self.stopped

    def _next_text(self, token_id: int) -> str:
        """Take one id; the text it completes ("" while a character is still split across ids)."""
        ids = self._ids
        ids.append(token_id)
        self.output_ids.append(token_id)
        texts = self._texts
        if texts is not None and self._covered == len(ids) - 1 and 0 <= token_id < len(texts):
            text = texts[token_id]
            if text is UNDECODED:
                text = self._tok.token_text(token_id, self._skip)
            if text is not None:  # every id before it is text, and its bytes are whole characters
                self._covered += 1
                return text
        return self._step(token_id)

    def flush(self) -> str:
        """At the end of the request: emit what was held back (incomplete characters, partial stop strings)."""
        if self.stopped:
            return ""
        if self._stream is not None and self._covered == len(self._ids):
            new_text = ""  # the stream has turned every id into text
        else:
            self._window_at_covered()
            new_text = self._advance(final=True)
        return self._emit(self._release(new_text, final=True))

    def finish(self, token_ids: list[int]) -> str:
        """Feed a request's last ids and end it: the text push(token_ids) then flush() would emit together.

        Without stop strings on a byte-level tokenizer, one decode however many the ids; else a push per id.
        """
        if not self._bytewise:
            text, _ = self.push(token_ids)
            return text + self.flush()
        self._ids.extend(token_ids)
        self.output_ids.extend(token_ids)
        return self.flush()

    def _step(self, token_id: int) -> str:
        """The text one pushed id completes ("" while a character is still split across ids)."""
        if self._stream is None:
            return self._advance(final=False)
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - tokenizers refuses a window its invalid UTF-8 made ambiguous
            self._window_at_covered()
            self._stream = None  # this request goes on with the window, which renders such bytes as U+FFFD
            self._texts = None  # ...for every id: the window does not move with ids taken from token_texts
            return self._advance(final=False)
        if chunk is None:
            return ""
        self._covered = len(self._ids)
        return chunk

    def _window_at_covered(self) -> None:
        """Move the window just before the ids the stream has not turned into text yet."""
        if self._stream is None or self._read == self._covered:
            return  # the window is the only path (it moves itself), or it is there already
        self._prefix, self._read = max(0, self._covered - PROMPT_CONTEXT_TOKENS), self._covered
        self._prefix_text = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)

    def _advance(self, final: bool) -> str:
        """Text the window gained since the last advance, or "" while it may still be mid-character."""
        new_text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        grew = len(new_text) > len(self._prefix_text)
        if not grew or (not final and new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        return delta

    def _release(self, new_text: str, final: bool) -> str:
        """Add decoded text to the held-back text; return what may be emitted, stopping at a stop string."""
        pending = self._pending + new_text
        if not self._stops:
            self._pending = ""
            return pending
        hit, which = _earliest_stop(pending, self._stops)
        if hit >= 0:
            self.stopped, self.stop_string, self._pending = True, which, ""
            return pending[:hit]
        keep = 0 if final else _held_suffix(pending, self._stops)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def _emit(self, text: str) -> str:
        """Record emitted text and return it."""
        if text:
            self._pieces.append(text)
        return text


def _prompt_context(tokenizer: Decoder, prompt_ids: list[int], skip: bool) -> tuple[list[int], str]:
    """The prompt's last few ids and their text; none when they end mid-character (not a prefix then)."""
    context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
    if context:
        text = tokenizer.decode(context, skip_special_tokens=skip)
        if not text.endswith(_REPLACEMENT):
            return context, text
    return [], tokenizer.decode([], skip_special_tokens=skip)


def _decodes_bytewise(tokenizer: Decoder) -> bool:
    """Whether decode(ids) is the lossy UTF-8 decoding of the concatenated bytes of the ids' tokens.

    That is metrale's Tokenizer over a byte-level decoder (byte-level BPE: GPT-2, Llama 3, Qwen; special
    and unknown ids skipped simply add no bytes). Then, for a read offset r at which the window's text does not
    end in U+FFFD (the bytes end on a whole character), decode(ids[p:]) == decode(ids[p:r]) + decode(ids[r:]),
    so the per-token deltas telescope and one final advance of the window gives the same text. Other decoders
    (SentencePiece's byte fallback replaces each byte of a broken sequence; Strip) lack the property.
    """
    return isinstance(tokenizer, Tokenizer) and isinstance(tokenizer.backend.decoder, decoders.ByteLevel)


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """Index of the first stop string in text and which one it is, or (-1, None)."""
    best, which = -1, None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, stop
    return best, which


def _held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        start = max(len(text) - len(stop) + 1, 0)
        i = text.find(stop[0], start)
        while i >= 0 and len(text) - i > longest:
            if stop.startswith(text[i:]):
                longest = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return longest
