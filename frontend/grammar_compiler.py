"""Structured outputs' grammars, compiled by the frontend: once per distinct constraint, within a time limit.

The frontend owns the tokenizer, so it describes the vocabulary as xgrammar sees it (`GrammarVocab`, sent to the
engine core before the first request that needs it) and compiles each request's `structured_outputs` against it.
A compile runs in a helper process that is killed when it takes longer than the limit (xgrammar has no way to stop
a compile: a regex like `[a-z]{1,30000}` keeps a core busy for many seconds), so a schema that does not compile or
times out fails that request only (bad_request, an HTTP 400) and nothing else waits for it. Results are cached by
the constraint's digest, failures too (a repeat is answered at once); what the engine core gets is xgrammar's
serialized CompiledGrammar (`GrammarBlob`), which it turns back into a matcher.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from metrale import xgrammar_core as xg
from metrale.ipc.messages import GrammarBlob, GrammarVocab
from metrale.ipc.sampling import StructuredOutputs
from metrale.settings import DEFAULTS

from .tokenizer import Tokenizer

log = logging.getLogger("metrale.frontend.grammars")

DEFAULT_TIMEOUT_S = DEFAULTS.grammar_timeout_s  # --grammar-timeout
START_TIMEOUT_S = 60.0  # a fresh helper loads xgrammar and the vocabulary before the limit starts counting
CACHE_ENTRIES = 128  # compiled grammars (and refusals) kept, least recently used first out


class GrammarRefused(ValueError):
    """A constraint that does not compile, or not within the time limit (the message says which)."""


def grammar_vocab(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarVocab:
    """The tokenizer's vocabulary as xgrammar sees it, for a model whose logits are vocab_size wide."""
    backend = tokenizer.backend
    by_id = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(by_id.values(), default=-1) + 1)
    for token, i in by_id.items():
        encoded[i] = token
    vocab_type, add_prefix_space = xg.detect_vocab_type(backend.to_str())
    h = hashlib.blake2b(digest_size=16)
    h.update("\x00".join(encoded).encode("utf-8", "surrogatepass"))
    h.update(repr((vocab_type, add_prefix_space, vocab_size, list(stop_token_ids))).encode())
    return GrammarVocab(digest=h.hexdigest(), encoded_vocab=encoded[:vocab_size], vocab_type=vocab_type,
                        add_prefix_space=add_prefix_space, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


_INT_BOUNDS = (-(10**18 - 1), 10**18 - 1)  # 18 digits: within int64, and a range xgrammar compiles fast (all nines)


def bounded_integers(schema: str) -> str:
    """A JSON schema whose integers without a bound get one of 18 digits (within int64): an unbounded integer lets a
    small model write digits until max_tokens (seen: SmolLM2 writing `{"n": 2087128130003213...` to the end), while
    a bounded one must close within 19 characters. A schema that is not JSON comes back as it is (the compile says what is wrong)."""
    try:
        tree = json.loads(schema)
    except ValueError:
        return schema
    _bound(tree)
    return json.dumps(tree, separators=(",", ":"), ensure_ascii=False)


def _bound(node: object) -> None:
    """Give each integer schema under node the _INT_BOUNDS bound it lacks (a side already bounded is kept)."""
    if isinstance(node, list):
        for item in node:
            _bound(item)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        low, high = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum", node.get("exclusiveMaximum"))
        if low is None and (not isinstance(high, (int, float)) or high >= _INT_BOUNDS[0]):
            node["minimum"] = _INT_BOUNDS[0]
        if high is None and (not isinstance(low, (int, float)) or low <= _INT_BOUNDS[1]):
            node["maximum"] = _INT_BOUNDS[1]
    for value in node.values():
        _bound(value)


def grammar_key(kind: str, spec: str) -> str:
    """The cache key of one constraint."""
    return hashlib.blake2b(f"{kind}\x00{spec}".encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


_LEN = struct.Struct("<I")  # the helper's frames: a length, then msgpack


@dataclass(slots=True)
class _Helper:
    """The compile process (`python -m metrale.frontend.grammar_compiler`) and its pipes."""

    process: subprocess.Popen
    ready: bool = False  # it said it has the vocabulary loaded

    def send(self, obj: object) -> None:
        _write_frame(self.process.stdin, obj)

    def send_in_background(self, obj: object) -> None:
        """Send a frame larger than a pipe holds (the vocabulary) from a thread: the write blocks until the
        helper, still starting, reads it, and the event loop must not block with it. The helper's ready frame
        comes only after it has read the whole frame; a helper killed first ends the write (ignored)."""
        def write() -> None:
            try:
                self.send(obj)
            except (OSError, ValueError):
                pass

        threading.Thread(target=write, name="grammar-vocab", daemon=True).start()

    def recv(self) -> object:
        """The next answer; EOFError when the helper is gone. (An event loop's reader may have made the pipe
        non-blocking; the rest of an answer that has started to arrive is read blocking.)"""
        os.set_blocking(self.fileno(), True)
        return msgspec.msgpack.decode(_read_frame(self.process.stdout))

    def poll(self, timeout_s: float) -> bool:
        """True when an answer has started to arrive within timeout_s."""
        return bool(select.select([self.process.stdout], [], [], timeout_s)[0])

    def fileno(self) -> int:
        return self.process.stdout.fileno()


class GrammarCompiler:
    """Compiles structured_outputs constraints into GrammarBlobs: cached, in a helper process, time-limited."""

    def __init__(self, vocab: GrammarVocab, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.vocab = vocab
        self.timeout_s = timeout_s
        self._cache: OrderedDict[str, GrammarBlob | str] = OrderedDict()  # a str is why it was refused
        self._helper: _Helper | None = None
        self._lock: asyncio.Lock | None = None
        self.compiles = 0  # constraints compiled (not found in the cache), for tests and stats

    def cached(self, so: StructuredOutputs) -> GrammarBlob | None:
        """The compiled grammar when this constraint was compiled before; GrammarRefused when it was refused."""
        key = grammar_key(*so.kind_and_spec())
        hit = self._cache.get(key)
        if hit is None:
            return None
        self._cache.move_to_end(key)
        if isinstance(hit, str):
            raise GrammarRefused(hit)
        return hit

    async def compile(self, so: StructuredOutputs) -> GrammarBlob:
        """The constraint's compiled grammar (from the cache, else compiled without blocking the event loop);
        GrammarRefused when it does not compile in time."""
        hit = self.cached(so)
        if hit is not None:
            return hit
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one helper, one compile at a time; the limit counts from its start
            hit = self.cached(so)
            if hit is not None:
                return hit
            kind, spec = so.kind_and_spec()
            helper = self._ensure_helper()
            if not helper.ready:
                self._started(helper, await _readable(helper, START_TIMEOUT_S))
            helper.send((kind, bounded_integers(spec) if kind == "json" else spec))
            return self._answer(kind, spec, helper, await _readable(helper, self.timeout_s))

    def compile_blocking(self, so: StructuredOutputs) -> GrammarBlob:
        """compile() for a caller without an event loop (the offline LLM)."""
        hit = self.cached(so)
        if hit is not None:
            return hit
        kind, spec = so.kind_and_spec()
        helper = self._ensure_helper()
        if not helper.ready:
            self._started(helper, helper.poll(START_TIMEOUT_S))
        helper.send((kind, bounded_integers(spec) if kind == "json" else spec))
        return self._answer(kind, spec, helper, helper.poll(self.timeout_s))

    def close(self) -> None:
        """Stop the helper process (it also stops by itself when this process goes away)."""
        if self._helper is not None:
            helper, self._helper = self._helper, None
            helper.process.kill()
            helper.process.wait()
            helper.process.stdin.close()
            helper.process.stdout.close()

    def _started(self, helper: _Helper, answered: bool) -> None:
        """Take a fresh helper's ready frame; GrammarRefused (and no helper) when it did not start."""
        try:
            if not answered:
                raise EOFError("no ready frame in time")
            helper.recv()
            helper.ready = True
        except (EOFError, OSError, msgspec.DecodeError) as exc:
            self.close()
            log.error("frontend: the grammar compiler did not start: %s", exc)
            raise GrammarRefused("the grammar compiler did not start") from None

    def _answer(self, kind: str, spec: str, helper: _Helper, answered: bool) -> GrammarBlob:
        """The helper's answer, cached; a helper that did not answer in time is killed (a fresh one serves the
        next compile)."""
        key = grammar_key(kind, spec)
        self.compiles += 1
        if not answered:
            self.close()
            outcome: GrammarBlob | str = f"the {kind} grammar did not compile within {self.timeout_s:g} s"
        else:
            try:
                status, payload = helper.recv()
            except (EOFError, OSError, msgspec.DecodeError):  # the helper died (out of memory, a crash in xgrammar)
                self.close()
                status, payload = "error", "the grammar compiler failed"
            outcome = GrammarBlob(key=key, data=payload) if status == "ok" else f"invalid {kind} grammar: {payload}"
        self._cache[key] = outcome
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        if isinstance(outcome, str):
            log.info("frontend: structured outputs refused: %s", outcome)
            raise GrammarRefused(outcome)
        return outcome

    def _ensure_helper(self) -> _Helper:
        """The running helper, started when there is none."""
        if self._helper is None or self._helper.process.poll() is not None:
            # A plain subprocess (not multiprocessing's spawn, which would re-run an offline user's script).
            # It takes a session of its own (_lowest_priority) but stays our child: whoever stops us stops it
            # (the supervisor stops a child with its descendants), and it ends itself when we are gone.
            process = subprocess.Popen([sys.executable, "-m", "metrale.frontend.grammar_compiler"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._helper = _Helper(process)
            self._helper.send_in_background(msgspec.structs.asdict(self.vocab))
        return self._helper


async def _readable(helper: _Helper, timeout_s: float) -> bool:
    """True when the helper's answer starts to arrive within timeout_s (the event loop runs meanwhile)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = helper.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        done, _ = await asyncio.wait({ready}, timeout=timeout_s)  # (wait_for would cancel it: "done" too)
    finally:
        loop.remove_reader(fd)
    return bool(done)


def _read_frame(stream) -> bytes:
    """One length-prefixed frame from a binary stream; EOFError at its end."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the stream ended")
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the stream ended inside a frame")
    return data


def _exit_with_parent(parent: int) -> None:
    """End this process once its parent is gone, even in the middle of a compile (which never reads stdin)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _serve() -> None:
    """The helper process: take the vocabulary, then compile (kind, spec) requests until stdin closes (our
    parent went away), answering ("ok", serialized) or ("error", why)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answers' stream
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # our parent decides when we stop
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    vocab = msgspec.convert(msgspec.msgpack.decode(_read_frame(stdin)), GrammarVocab)
    comp = xg.compiler(xg.tokenizer_info(vocab.encoded_vocab, vocab.vocab_type, vocab.vocab_size, vocab.stop_token_ids,
                                         vocab.add_prefix_space))
    _write_frame(stdout, ("ready", ""))
    while True:
        try:
            kind, spec = msgspec.msgpack.decode(_read_frame(stdin))
        except EOFError:
            return
        try:
            answer = ("ok", xg.serialize(xg.compile_spec(comp, kind, spec)))
        except xg.GrammarError as exc:
            answer = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - anything else xgrammar raises refuses this grammar only
            answer = ("error", f"{type(exc).__name__}: {exc}")
        _write_frame(stdout, answer)


def _lowest_priority() -> None:
    """Yield the CPU to everything else: a grammar built to compile for the whole time limit must not take a core
    from the worker, whose threads wait on each other. Nice alone reaches only the processes of one scheduler
    autogroup (one session: `metrale serve` starts each child in its own), so the helper takes a session of its
    own and sets that autogroup's nice too. It stays its parent's child: the supervisor still stops it with the
    frontend, and it ends itself when its parent goes."""
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:
        pass  # no autogroups here (or not Linux): the process's nice is what counts
    os.nice(19)


def _write_frame(stream, obj: object) -> None:
    """One length-prefixed msgpack frame."""
    data = msgspec.msgpack.encode(obj)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _lowest_priority()
    _serve()
