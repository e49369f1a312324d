"""LiveRequests: every request the frontend is running, filed by client and by engine id, through its life.

A request is registered (checked, filed under its client), tokenized (off the event loop when its prompt is
long), admitted (its prompt length checked, a detokenizer started) and submitted to the engine core under an
engine id (a fresh one each time an engine core comes up). Its outputs are detokenized (stop strings included)
and handed on as Deltas; its final message, whether a Delta with a finish_reason or an Error, also forgets it.
A client that goes away has its requests aborted. Answers go to an in-process sink when the request has one,
else to its ROUTER peer through the server's send.

Under data parallel a request is submitted to the replica the router picks (replicas.py, router.py). When a
replica's engine core dies or loses its worker, its requests move at once to another replica (`move_off`): each is
submitted there with the tokens already streamed and its compiled grammar (that replica is sent the grammar
vocabulary first if it has not had it), exactly as after an engine-core restart, so nothing is lost and nobody
waits for the dead replica to come back.

A request with a resume key (a ZMQ client's session and id, an HTTP request id) is held by the engine core under it
(engine_core/output_ledger.py). After a frontend restart its client re-attaches (a Resume, an HTTP retry): the engine
core sends everything so far at once, and what the client already has (its offset) is detokenized but not sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec

from metrale.ipc.errors import ErrorCode
from metrale.ipc.beam_params import BeamSearchParams
from metrale.ipc.messages import (
    AddRequest, BeamHypothesis, Delta, Error, Generate, GrammarBlob, RequestOutputDelta, Resume, TokenLogprob,
)
from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import SamplingParams
from metrale.pooling_config import PoolingConfig
from metrale.settings import DEFAULTS

from .detokenizer import Decoder, IncrementalDetokenizer
from .engine_link import EngineLink
from .frame_checks import Rejected, check_generate
from .grammar_compiler import DEFAULT_TIMEOUT_S, GrammarCompiler, GrammarRefused, grammar_vocab
from .replicas import ReplicaSet
from .metrics import Metrics
from .tokenizer import Tokenizer

log = logging.getLogger("metrale.frontend.server")

# A request live at this many engine-core deaths in a row, with no token from it in between, is failed instead of
# resubmitted again: it may be what kills them. A token after a resubmission clears it (a request that kills the
# engine does so at the same point each time; one that was merely running when a process was killed moves on).
MAX_ENGINE_DEATHS = 2
# ...and one live at this many deaths in all, tokens or not (a request that kills every engine one token later).
MAX_ENGINE_DEATHS_IN_ALL = 8
_RESUME_LOST = ErrorCode.RESUME_LOST.value
_SYNC_ENCODE_CHARS = 8192  # longer prompts are tokenized off the event loop (~1 ms per 1,500 characters)

LocalSink = Callable[[Delta | Error], None]
RouterSend = Callable[[bytes, tuple[bytes, ...], msgspec.Struct], None]  # a client that cannot take it is dropped


@dataclass(slots=True)
class RequestState:
    """One live request: who asked, under which engine id, and its detokenizer."""

    client: bytes
    client_id: str
    params: SamplingParams
    arrival: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    detok: IncrementalDetokenizer | None = None  # None while the prompt is being tokenized
    engine_id: str = ""  # "" until submitted to an engine core
    replica: int = 0  # the data-parallel replica it was submitted to (while engine_id is set)
    sink: LocalSink | None = None  # an in-process client's callback; None: answers go to the ROUTER
    decoder: Decoder | None = None  # detokenize with this instead of the server's tokenizer
    last_token_at: float | None = None  # when its last tokens came (None before the first)
    # Held back under a stream interval: accepted tokens, their text and logprobs not yet sent.
    held_ids: list[int] = field(default_factory=list)
    held_text: str = ""
    held_logprobs: list | None = None
    sent_tokens: bool = False  # a Delta with tokens went out (the first tokens are never held)
    # params.prompt_logprobs went out (with the first tokens); an engine core that runs the request again after a
    # restart or a move reports them again only if none of its tokens had come, and then they are not sent twice.
    sent_prompt_logprobs: bool = False
    engine_deaths: int = 0  # engine cores that died while running it, since its last token (MAX_ENGINE_DEATHS)
    engine_deaths_in_all: int = 0  # ... in its whole life (MAX_ENGINE_DEATHS_IN_ALL)
    cached_tokens: int | None = None  # prompt tokens the engine core found in its prefix cache (it says so first)
    queued_s: float | None = None  # how long the engine core held it before its first step (it says so first)
    cache_salt: str | None = None
    # max_tokens must fit beside the prompt (the HTTP API, as vLLM and OpenAI: a 400 with the numbers);
    # else the engine core stops the request at max_model_len (finish_reason "length").
    strict_length: bool = False
    grammar: GrammarBlob | None = None  # params.structured_outputs compiled (grammar_compiler.py)
    pooling: PoolingParams | None = None  # an embeddings request (Generate.pooling)
    lora: str | None = None  # its LoRA adapter (Generate.lora)
    beam: BeamSearchParams | None = None  # a beam search (Generate.beam): its one Delta carries the hypotheses
    resume_key: str | None = None  # what the engine core holds it under for a re-attach (None: not resumable)
    reattach: str | None = None  # AddRequest.reattach, until the engine core's first answer
    skip: int = 0  # output tokens its client already has (a Resume's offset): detokenized, not sent
    untried: list[int] | None = None  # data parallel: the replicas not yet asked for the request it re-attaches


def session_key(session: str, request_id: str) -> str:
    """The resume key of a ZMQ client's request (its session and id; never equal to another pair's)."""
    return f"z{len(session)}:{session}:{request_id}"


@dataclass(slots=True)
class ClientState:
    """A connected client with live requests: its reply envelope, connection fd and requests by its own id."""

    envelope: tuple[bytes, ...]
    fd: int | None
    requests: dict[str, RequestState] = field(default_factory=dict)
    local: bool = False  # an in-process client (never probed over the ROUTER)


class LiveRequests:
    """The live requests by client and by engine id; every step of a request's life goes through here."""

    def __init__(self, tokenizer: Tokenizer, replicas: ReplicaSet, metrics: Metrics, clock: Callable[[], float],
                 send: RouterSend, vocab_size: int, max_model_len: int | None, stream_interval: int = 1,
                 grammar_timeout_s: float = DEFAULT_TIMEOUT_S, pooling: PoolingConfig = PoolingConfig(),
                 hidden_size: int = 0, max_logprobs: int = DEFAULTS.max_logprobs) -> None:
        """pooling, hidden_size: the model's (model_facts), which embeddings requests are checked against;
        max_logprobs: --max-logprobs (-1: the vocabulary)."""
        self.tokenizer = tokenizer
        self.replicas = replicas
        self.metrics = metrics
        self.clock = clock
        self._send = send
        self.vocab_size = vocab_size  # what requests are checked against (the engine core's once it says)
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.pooling, self.hidden_size = pooling, hidden_size
        self.stream_interval = max(1, stream_interval)
        self.clients: dict[bytes, ClientState] = {}  # a client is here while it has live requests
        self._by_engine_id: dict[str, RequestState] = {}
        self.background: set[asyncio.Task] = set()  # long prompts being tokenized
        self.refusing: tuple[ErrorCode, str] | None = None  # (code, why) while new requests are refused
        self.idle = asyncio.Event()  # set while no request is live
        self.idle.set()
        self.grammar_timeout_s = grammar_timeout_s
        self._grammars: GrammarCompiler | None = None  # made at the first structured request
        self._vocab_sent: set[int] = set()  # the replicas whose engine core up now has our GrammarVocab
        # While on_outputs handles an engine message: the time it came, and its rows' latency samples.
        self._frame_at: float | None = None
        self._first_samples: list[float] = []
        self._gap_samples: list[float] = []

    @property
    def num_live(self) -> int:
        """Requests registered and not yet ended."""
        return sum(len(state.requests) for state in self.clients.values())

    @property
    def num_submitted(self) -> int:
        """Live requests the engine core is running (submitted under an engine id)."""
        return len(self._by_engine_id)

    # ---- admission -------------------------------------------------------------------

    def register(self, client: bytes, envelope: tuple[bytes, ...], fd: int | None, msg: Generate,
                 local: bool = False) -> RequestState:
        """Check a Generate and file it under its client; Rejected when it cannot run."""
        state = self.clients.get(client)
        if state is not None and msg.id in state.requests:
            raise Rejected("bad_request", f"duplicate id {msg.id!r}: a request with it is running")
        check_generate(msg, self.vocab_size, self.max_logprobs)
        if msg.session is not None and not 0 < len(msg.session) <= 256:
            raise Rejected("bad_request", "session must have 1 to 256 characters")
        if isinstance(msg, Resume) and (msg.session is None or msg.offset < 0):
            raise Rejected("bad_request", "a resume needs the session its request was started under, and an offset >= 0")
        if msg.pooling is not None:
            self._check_pooling(msg)
        if self.refusing is not None:
            raise Rejected(*self.refusing)
        if state is None:
            state = self.clients[client] = ClientState(envelope=envelope, fd=fd, local=local)
        state.fd = fd if fd is not None else state.fd
        req = RequestState(client=client, client_id=msg.id, params=msg.sampling, arrival=self.clock(),
                           cache_salt=msg.cache_salt, pooling=msg.pooling,
                           lora=msg.lora, beam=msg.beam)
        if msg.session is not None:
            req.resume_key = session_key(msg.session, msg.id)
        if isinstance(msg, Resume):
            self.resume_from(req, msg.offset)
        state.requests[msg.id] = req
        self.idle.clear()
        return req

    @staticmethod
    def resume_from(req: RequestState, offset: int) -> None:
        """Make req a re-attach to the request held under its key, whose client has its first offset tokens."""
        req.reattach = "only" if offset > 0 else "or_start"  # a client with nothing lost nothing if it starts anew
        req.skip = offset
        req.sent_prompt_logprobs = offset > 0  # they came with the first tokens

    def _check_pooling(self, msg: Generate) -> None:
        """Rejected unless this model gives the embedding msg asks for (and msg asks nothing else of it)."""
        if self.pooling.unsupported:
            raise Rejected("bad_request", f"this model gives no embeddings: metrale does not run {self.pooling.unsupported}")
        try:
            msg.pooling.validate(self.hidden_size, self.pooling.matryoshka, msg.sampling)
        except ValueError as exc:
            raise Rejected("bad_request", f"pooling.{exc}") from None

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler, made on first use for the vocabulary size the engine core has."""
        if self._grammars is None or self._grammars.vocab.vocab_size != self.vocab_size:
            if self._grammars is not None:
                self._grammars.close()
            vocab = grammar_vocab(self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids)
            self._grammars = GrammarCompiler(vocab, self.grammar_timeout_s)
            self._vocab_sent.clear()
        return self._grammars

    def close(self) -> None:
        """Stop the grammar compiler's helper process, if one runs."""
        if self._grammars is not None:
            self._grammars.close()

    def tokenize_then_admit(self, req: RequestState, msg: Generate, add_special_tokens: bool = True) -> None:
        """Admit a registered request: its grammar compiled (off the loop, unless cached), its token ids, or its
        prompt tokenized (off the loop when long)."""
        so = msg.sampling.structured_outputs
        if so is not None and req.grammar is None:
            try:
                req.grammar = self.grammars.cached(so)
            except GrammarRefused as exc:
                self.send_final(req, Error(id=req.client_id, code=ErrorCode.BAD_REQUEST.value, message=str(exc)))
                return
            if req.grammar is None:
                task = asyncio.create_task(self._compile_then_admit(req, msg, add_special_tokens))
                self.background.add(task)
                task.add_done_callback(self.background.discard)
                return
        if msg.token_ids is not None:
            self._admit(req, msg.token_ids)
        elif len(msg.prompt) <= _SYNC_ENCODE_CHARS:
            self._admit(req, self.tokenizer.encode(msg.prompt, add_special_tokens=add_special_tokens))
        else:  # a long prompt takes long to tokenize: the loop keeps streaming meanwhile
            task = asyncio.create_task(self._encode_then_admit(req, msg.prompt, add_special_tokens))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    async def _compile_then_admit(self, req: RequestState, msg: Generate, add_special_tokens: bool) -> None:
        """Compile a request's grammar in the compiler's helper (within its time limit), then go on admitting."""
        try:
            req.grammar = await self.grammars.compile(msg.sampling.structured_outputs)
        except GrammarRefused as exc:
            if self._is_live(req):
                self.send_final(req, Error(id=req.client_id, code=ErrorCode.BAD_REQUEST.value, message=str(exc)))
            return
        if self._is_live(req):
            self.tokenize_then_admit(req, msg, add_special_tokens)

    async def _encode_then_admit(self, req: RequestState, prompt: str, add_special_tokens: bool = True) -> None:
        """Tokenize a long prompt on the tokenizer's threads, then admit the request."""
        try:
            ids = await self.tokenizer.encode_async(prompt, add_special_tokens=add_special_tokens)
        except Exception as exc:  # the tokenizer failing on one prompt fails that request only
            log.exception("frontend: tokenizing request %r failed", req.client_id)
            if self._is_live(req):
                self.send_final(req, Error(id=req.client_id, code="internal", message=f"tokenizer failed: {exc}"))
            return
        self._admit(req, ids)

    def _admit(self, req: RequestState, prompt_ids: list[int]) -> None:
        """Check the prompt's length; start detokenizing and submit to the engine core when one is up."""
        if not self._is_live(req):  # aborted or disconnected while its prompt was being tokenized
            return
        if not prompt_ids:
            self.send_final(req, Error(id=req.client_id, code="bad_request", message="the prompt is empty"))
            return
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len + (req.pooling is not None):
            message = (f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                       "(the prompt and at least one new token must fit)")
            self.send_final(req, Error(id=req.client_id, code="too_long", message=message))
            return
        if req.strict_length and self.max_model_len is not None and \
                len(prompt_ids) + req.params.max_tokens > self.max_model_len:
            message = (f"this model's maximum context length is {self.max_model_len} tokens, but {len(prompt_ids) + req.params.max_tokens} "
                       f"were requested ({len(prompt_ids)} in the prompt, {req.params.max_tokens} in the completion); "
                       "reduce the prompt or max_tokens")
            self.send_final(req, Error(id=req.client_id, code="too_long", message=message))
            return
        req.prompt_ids = prompt_ids
        req.detok = IncrementalDetokenizer(req.decoder or self.tokenizer, prompt_ids, req.params)
        self.metrics.window.admitted(len(prompt_ids))
        if self.replicas.any_up:
            self._submit(req)

    def _is_live(self, req: RequestState) -> bool:
        """True while req is its client's running request with its id."""
        state = self.clients.get(req.client)
        return state is not None and state.requests.get(req.client_id) is req

    def find(self, client: bytes, client_id: str) -> RequestState | None:
        """A client's live request with this id, if any."""
        state = self.clients.get(client)
        return state.requests.get(client_id) if state is not None else None

    # ---- the engine core -------------------------------------------------------------

    def _submit(self, req: RequestState, exclude: int | None = None) -> None:
        """Send a request to the replica the router picks (not `exclude`), under a fresh engine id; with none up it
        waits, unsubmitted, for the next engine core to come up."""
        router = self.replicas.router
        if req.engine_id:
            self._by_engine_id.pop(req.engine_id, None)
            router.live[req.replica] -= 1
            req.engine_id = ""
        asking = req.reattach is not None and len(self.replicas.links) > 1
        if asking and not self.replicas.all_up and req.untried is None:
            return  # a restarted frontend: it asks once every replica is up (any may hold the request)
        k = self._holder_to_ask(req) if asking else None
        if k is None:
            k = router.choose(req.prompt_ids, req.cache_salt, exclude)
        if k is None:
            return
        link = self.replicas.links[k]
        req.engine_id, req.replica = link.new_request_id(), k
        router.live[k] += 1
        self._by_engine_id[req.engine_id] = req
        if req.grammar is not None and k not in self._vocab_sent:  # the engine core matches against our vocabulary
            link.send(self.grammars.vocab)
            self._vocab_sent.add(k)
        add = AddRequest(
            request_id=req.engine_id,
            prompt_token_ids=req.prompt_ids,
            params=req.params,
            output_token_ids=list(req.detok.output_ids),
            cache_salt=req.cache_salt,
            grammar=req.grammar,
            pooling=req.pooling,
            lora=req.lora,
            beam=req.beam,
            resume_key=req.resume_key,
            reattach="only" if req.untried else req.reattach,  # the last replica asked may start it
        )
        link.send(add)

    def _holder_to_ask(self, req: RequestState) -> int | None:
        """Data parallel: the next replica to ask for the request a Resume re-attaches (which one holds it is not known
        here: each up replica is asked in turn, and only the last may start it anew)."""
        if req.untried is None:
            req.untried = [link.index for link in self.replicas.links]
        return req.untried.pop(0) if req.untried else None

    def resubmit(self, k: int) -> None:
        """A fresh engine core of replica k is up: submit again every live request it had (under a new engine id,
        aborting the id it had) and every request still waiting for an engine core.

        A request that was running at MAX_ENGINE_DEATHS engine-core deaths with no token between them is failed
        instead: it may be the request that kills the engine, and resubmitting it again would kill the next one."""
        lost = [req for req in self._each() if req.engine_id and req.replica == k]
        self.replicas.links[k].abort([req.engine_id for req in lost])
        self._vocab_sent.discard(k)  # a fresh engine core (or one this frontend has not told yet)
        for req in lost:
            self._resubmit(req)
        self.resubmit_waiting()

    def resubmit_waiting(self) -> None:
        """Submit every live request that waits for an engine core (none was up when it was admitted)."""
        for req in list(self._each()):
            if not req.engine_id and req.detok is not None:  # else it is submitted once its prompt is tokenized
                self._submit(req)

    def move_off(self, k: int) -> int:
        """Replica k lost its engine core or its worker: move its requests to other replicas now (their tokens so
        far go with them). Nothing moves when no other replica is up: they wait for k. Returns how many moved."""
        if not self.replicas.has_other(k):
            return 0
        lost = [req for req in self._each() if req.engine_id and req.replica == k]
        engine_lives = self.replicas.links[k].up  # then its worker died: it must not run them later
        if engine_lives:
            self.replicas.links[k].abort([req.engine_id for req in lost])
        for req in lost:  # a worker's death is no engine core's (with one replica it would not even move them)
            self._resubmit(req, exclude=k, engine_died=not engine_lives)
        if lost:
            log.warning("frontend: moved %d requests off replica %d", len(lost), k)
        return len(lost)

    def _resubmit(self, req: RequestState, exclude: int | None = None, engine_died: bool = True) -> None:
        """Submit a request whose engine core died (or, engine_died False, whose replica lost its worker) again, or
        fail it at its MAX_ENGINE_DEATHS-th engine-core death in a row (or its MAX_ENGINE_DEATHS_IN_ALL-th)."""
        if not engine_died:
            self._submit(req, exclude)
            return
        req.engine_deaths += 1
        req.engine_deaths_in_all += 1
        if req.engine_deaths >= MAX_ENGINE_DEATHS or req.engine_deaths_in_all >= MAX_ENGINE_DEATHS_IN_ALL:
            in_a_row = " in a row" if req.engine_deaths >= MAX_ENGINE_DEATHS else ""
            message = (f"the engine core died {req.engine_deaths if in_a_row else req.engine_deaths_in_all} times"
                       f"{in_a_row} while running this request; it is not resubmitted again")
            log.error("frontend: failing request %r: %s", req.client_id, message)
            self.send_final(req, Error(id=req.client_id, code=ErrorCode.INTERNAL.value, message=message))
            return
        self._submit(req, exclude)

    def end_all(self, code: ErrorCode, message: str) -> None:
        """End every live request with Error(code, message) and tell the engine core to drop them."""
        engine_ids = [(req.replica, req.engine_id) for req in self._each() if req.engine_id]
        for req in list(self._each()):
            self.send_final(req, Error(id=req.client_id, code=code.value, message=message))
        self._abort_each(engine_ids)

    def _abort_each(self, engine_ids: list[tuple[int, str]]) -> None:
        """Tell each replica to drop its requests among (replica, engine id) pairs."""
        for link in self.replicas.links:
            link.abort([engine_id for k, engine_id in engine_ids if k == link.index])

    def _each(self) -> Iterator[RequestState]:
        """Every live request."""
        for state in self.clients.values():
            yield from state.requests.values()

    def on_outputs(self, outputs: list[RequestOutputDelta], aborts: list[str], link: EngineLink) -> None:
        """Detokenize and stream the outputs of one engine message (from the replica of link); collect engine ids to
        abort there. Its rows all came at one time, read once: their latency samples go to the metrics together.

        Most rows are a running request's next tokens and nothing else; they take the short way here (the same
        steps as _on_output's, without the checks that cannot apply). Every other row takes _on_output."""
        now = self._frame_at = self.clock()
        by_id, gaps, clients, send = self._by_engine_id, self._gap_samples, self.clients, self._send
        held_back = self.stream_interval > 1
        try:
            for out in outputs:
                req = by_id.get(out.request_id)
                ids = out.new_token_ids
                if req is None or not ids or req.skip or req.last_token_at is None or held_back \
                        or out.finish_reason is not None or out.error_code is not None or out.logprobs is not None \
                        or out.prompt_logprobs is not None or out.num_cached_tokens is not None:
                    self._on_output(out, aborts, link)
                    continue
                req.reattach = None
                req.engine_deaths = 0
                detok = req.detok
                before = len(detok.output_ids)
                text, stopped = detok.push(ids)
                accepted = ids if not stopped else detok.output_ids[before:]
                gaps.append((now - req.last_token_at) / len(accepted))
                req.last_token_at = now
                if stopped:
                    self._finish(req, "stop", text, accepted, None)
                    aborts.append(out.request_id)
                elif req.sink is None:  # _deliver's ROUTER branch, inline
                    send(req.client, clients[req.client].envelope, Delta(id=req.client_id, text=text, token_ids=ids))
                else:
                    self._deliver(req, Delta(id=req.client_id, text=text, token_ids=ids), None)
        finally:
            self._frame_at = None
            if self._first_samples or self._gap_samples:
                self.metrics.tokens_came(self._first_samples, self._gap_samples)
                self._first_samples.clear()
                self._gap_samples.clear()

    def _on_output(self, out: RequestOutputDelta, aborts: list[str], link: EngineLink) -> None:
        """Detokenize one request's new tokens and stream them."""
        req = self._by_engine_id.get(out.request_id)
        if req is None:
            link.on_orphan(out, aborts)
            return
        if out.error_code is not None and out.error_code == _RESUME_LOST and req.untried:
            self._submit(req)  # not held by that replica: ask the next
            return
        req.reattach = None  # the engine core has it: a resubmission carries its tokens
        if req.skip:  # the client has these (a re-attach's catch-up): they only move the detokenizer on
            head = out.new_token_ids[:req.skip]
            req.skip -= len(head)
            req.detok.push(head)
            out.new_token_ids = out.new_token_ids[len(head):]
            if out.logprobs is not None:
                out.logprobs = out.logprobs[len(head):]
        if out.finish_reason == "error":
            code = out.error_code or ErrorCode.INTERNAL.value
            message = out.error or "the engine core failed the request"
            self.send_final(req, Error(id=req.client_id, code=code, message=message))
            return
        if out.new_token_ids:
            req.engine_deaths = 0  # it ran on: whatever killed the engine before did not come with it
        if out.num_cached_tokens is not None and req.cached_tokens is None:
            req.cached_tokens = out.num_cached_tokens
        if out.queued_s is not None and req.queued_s is None:
            req.queued_s = out.queued_s
        new_ids, detok = out.new_token_ids, req.detok
        before = len(detok.output_ids)
        text, stopped = detok.push(new_ids)
        accepted = new_ids if not stopped else detok.output_ids[before:]  # a stop string accepts fewer
        if accepted:
            self._tokens_came(req, len(accepted))
        wants_logprobs = out.logprobs is not None and req.params.num_logprobs is not None
        logprobs = out.logprobs[: len(accepted)] if wants_logprobs else None
        prompt_logprobs = None if out.prompt_logprobs is None else self._prompt_logprobs(req, out)
        if stopped:
            self._finish(req, "stop", text, accepted, logprobs, prompt_logprobs)
            if out.finish_reason is None:
                aborts.append(out.request_id)
        elif out.finish_reason is not None:
            text += req.detok.flush()
            reason = "stop" if req.detok.stopped else out.finish_reason
            self._finish(req, reason, text, accepted, logprobs, prompt_logprobs, out.embedding, out.beams)
        else:
            self._stream(req, text, accepted, logprobs, prompt_logprobs)

    @staticmethod
    def _prompt_logprobs(req: RequestState, out: RequestOutputDelta) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs the engine core sent with out, unless the client has them already (None)."""
        if out.prompt_logprobs is None or req.params.prompt_logprobs is None or req.sent_prompt_logprobs:
            return None
        req.sent_prompt_logprobs = True
        return out.prompt_logprobs

    def _stream(self, req: RequestState, text: str, accepted: list[int], logprobs,
                prompt_logprobs: list[TokenLogprob | None] | None = None, embedding: list[float] | None = None) -> None:
        """Send new tokens as a Delta, or hold them while fewer than stream_interval are waiting (the
        request's first tokens, which carry its prompt logprobs, go at once: time to first token does not wait for an
        interval)."""
        if req.held_ids or req.held_text:
            text, accepted, logprobs = self._with_held(req, text, accepted, logprobs)
        if self.stream_interval > 1 and req.sent_tokens and len(accepted) < self.stream_interval \
                and prompt_logprobs is None:
            req.held_ids, req.held_text, req.held_logprobs = accepted, text, logprobs
            return
        req.sent_tokens = req.sent_tokens or bool(accepted)
        delta = Delta(id=req.client_id, text=text, token_ids=accepted, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs)
        self._deliver(req, delta, self.clients[req.client].envelope)

    @staticmethod
    def _with_held(req: RequestState, text: str, token_ids: list[int], logprobs):
        """What a request holds back, followed by text / token_ids / logprobs; the hold is emptied."""
        text, token_ids = req.held_text + text, req.held_ids + token_ids
        if req.held_logprobs is not None or logprobs is not None:
            logprobs = (req.held_logprobs or []) + (logprobs or [])
        req.held_ids, req.held_text, req.held_logprobs = [], "", None
        return text, token_ids, logprobs

    def _tokens_came(self, req: RequestState, count: int) -> None:
        """Time to first token, or the gap per token since the request's last tokens (to the metrics at the end of
        the engine message)."""
        now = self._frame_at
        if req.last_token_at is None:
            self._first_samples.append(now - req.arrival)
        else:
            self._gap_samples.append((now - req.last_token_at) / count)
        req.last_token_at = now

    # ---- endings ---------------------------------------------------------------------

    def abort(self, req: RequestState) -> None:
        """End a live request with finish_reason "abort" and tell the engine core to drop it."""
        text = req.detok.flush() if req.detok is not None else ""
        replica, engine_id = req.replica, req.engine_id
        self._finish(req, "abort", text, [], None)
        if engine_id:
            self.replicas.links[replica].abort([engine_id])

    def _finish(self, req: RequestState, reason: str, text: str, token_ids: list[int], logprobs,
                prompt_logprobs: list[TokenLogprob | None] | None = None, embedding: list[float] | None = None,
                beams: list[BeamHypothesis] | None = None) -> None:
        """Send a request's final Delta (with whatever it held back, and the prompt's logprobs when they come with
        its only tokens) and forget it."""
        if req.held_ids or req.held_text:
            text, token_ids, logprobs = self._with_held(req, text, token_ids, logprobs)
        final = Delta(
            id=req.client_id,
            text=text,
            token_ids=token_ids,
            finish_reason=reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.detok.output_ids) if req.detok is not None else 0,
            cached_tokens=req.cached_tokens,
            embedding=embedding,
            queued_s=req.queued_s,
            beams=beams,
        )
        self.send_final(req, final)

    def send_final(self, req: RequestState, msg: Delta | Error) -> None:
        """Forget a request, then send its final message (its client may be forgotten with it)."""
        envelope = self.clients[req.client].envelope
        self._forget(req)
        self._count_finished(req, msg.finish_reason if isinstance(msg, Delta) else "error")
        self._deliver(req, msg, envelope)

    def _deliver(self, req: RequestState, msg: Delta | Error, envelope: tuple[bytes, ...]) -> None:
        """Hand a request's message to its in-process sink, or send it to its ROUTER peer."""
        if req.sink is None:
            self._send(req.client, envelope, msg)
            return
        try:
            req.sink(msg)
        except Exception:  # a failing in-process caller must not stop the other requests
            log.exception("frontend: an in-process sink failed for request %r", req.client_id)

    def _count_finished(self, req: RequestState, reason: str) -> None:
        """Metrics of one finished request."""
        completion = len(req.detok.output_ids) if req.detok is not None else 0
        self.metrics.finished(reason, len(req.prompt_ids), completion, self.clock() - req.arrival)

    def _forget(self, req: RequestState) -> None:
        """Remove a request from every index (its client entry too when it was the last one)."""
        if self._by_engine_id.pop(req.engine_id, None) is not None:
            self.replicas.router.live[req.replica] -= 1
        state = self.clients.get(req.client)
        if state is not None:
            state.requests.pop(req.client_id, None)
            if not state.requests:
                del self.clients[req.client]
        if not self.clients:
            self.idle.set()

    def drop_client(self, client: bytes, why: str) -> None:
        """Abort every live request of a client that is gone."""
        state = self.clients.pop(client, None)
        if state is None:
            return
        engine_ids = []
        for req in state.requests.values():
            self._count_finished(req, "abort")
            if self._by_engine_id.pop(req.engine_id, None) is not None:
                self.replicas.router.live[req.replica] -= 1
                engine_ids.append((req.replica, req.engine_id))
        log.info("frontend: client %s %s; aborting %d request(s)", client.hex(), why, len(state.requests))
        self._abort_each(engine_ids)
        if not self.clients:
            self.idle.set()
