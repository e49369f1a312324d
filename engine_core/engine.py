"""EngineCore: requests in, one batch of token deltas out per tick. No sockets here (see core.py).

A tick is schedule → launch → settle, through one launch and one settle for every kind of step (decode_lane.py):
with a STEP in flight the lane may schedule and launch the next one ahead of it, then settle it; after a settled
BURST the next burst goes out at once when the batch goes on as it is; with nothing in flight the scheduler's step
gets its kind (step_kinds.py) and is launched, and a VERIFY or a synchronous STEP is settled in the same tick.
Every tick commits at most one token per request in either loop (a burst: up to its steps).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass

from metrale.beam_search import BeamSearch, BeamSearchParams
from metrale.config import EngineArgs, lora_pairs
from metrale.settings import DEFAULTS
from metrale.ipc.errors import ErrorCode, Refused
from metrale.ipc.messages import EngineStats, GrammarBlob, GrammarVocab, RequestOutputDelta
from metrale.ipc.plan import FEED_HOST, POOL_KINDS, POOL_NONE, Device, DeviceError, StepKind
from metrale.ipc.pooling import PoolingParams, with_model_default
from metrale.ipc.sampling import SamplingParams, logprobs_cap
from metrale.ipc.ticket_layout import prompt_logprob_rows

from .beam_groups import BeamGroup, BeamGroups
from .decode_lane import abandon, discard_row, drain, launch, settle
from .grammar import GrammarBook
from .speculative import NgramProposer, Speculator
from .kv_blocks import KvBlockPool
from .pipeline import Pipeline, Settled, SpecialTokens, can_feed, init_row_state
from .scheduler import ScheduledStep, Scheduler, SchedulerConfig
from .sequence import Sequence, SeqStatus
from .state_slots import StateSlots
from .step_builder import StepBuilder
from .step_kinds import StepShaper
from .step_io import StepIo
from .swap import SwapSpace

log = logging.getLogger(__name__)

MAX_ENGINE_FAILURES = 2  # a request running at this many failed ticks is failed, not retried


@dataclass(slots=True)
class EngineOptions:
    """The engine core's knobs: the settings that reach it (metrale/settings.py), by the same names, with the
    table's defaults."""

    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens
    max_waiting: int = DEFAULTS.max_waiting
    enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching
    pipeline: bool = DEFAULTS.pipeline
    seed: int | None = DEFAULTS.seed  # draws the seeds of requests that bring none
    recover_from_device_loss: bool = False  # requeue (True) or fail (False) the requests of a dead worker
    # or "swap" (needs the device's swap space: ModelInfo.num_swap_blocks)
    preemption_mode: str = DEFAULTS.preemption_mode
    # Most decode steps per tick for final-only plain rows, on a device with await_burst.
    decode_burst: int = DEFAULTS.decode_burst
    # A streamed request's tokens are reported every this many (its first and its last at once): the
    # frontend's --stream-interval, applied where the tokens are made, so the ticks between send nothing.
    stream_interval: int = DEFAULTS.stream_interval
    speculative: str | None = DEFAULTS.speculative  # "ngram": decode steps verify prompt-lookup drafts (speculative.py)
    num_speculative_tokens: int = DEFAULTS.num_speculative_tokens
    # Steps of this many rows or more decode plainly.
    speculative_disable_by_batch_size: int | None = DEFAULTS.speculative_disable_by_batch_size
    # --lora-modules (NAME=PATH): the device holds adapter i in LoRA slot i; a request names one.
    lora_modules: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULTS.lora_modules))
    max_logprobs: int = DEFAULTS.max_logprobs  # the most alternatives a request's logprobs may list (-1: the vocabulary)

    @classmethod
    def from_args(cls, args: EngineArgs, *, recover_from_device_loss: bool = False) -> "EngineOptions":
        """The engine core's share of EngineArgs: each of its fields that EngineArgs has."""
        shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**shared, recover_from_device_loss=recover_from_device_loss)


class EngineCore:
    """The scheduler, the KV block pool and the pipeline state around one Device."""

    def __init__(
        self,
        device: Device,
        options: EngineOptions | None = None,
        *,
        special_tokens: SpecialTokens = SpecialTokens(),
    ):
        options = options or EngineOptions()
        self.device = device
        info = device.model()
        self.info = info
        self.options = options = _for_state_slots(options, info)
        if options.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap (got {options.preemption_mode!r})")
        if options.preemption_mode == "swap" and not info.num_swap_blocks:
            log.warning("preemption_mode swap: the device has no swap space, preempted requests are recomputed")
        pool = KvBlockPool(info.num_kv_blocks, info.block_size, options.enable_prefix_caching)
        swap = SwapSpace(info.num_swap_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=options.max_num_seqs,
                max_num_batched_tokens=options.max_num_batched_tokens,
                max_model_len=info.max_model_len,
                max_waiting=options.max_waiting,
                preemption_mode=options.preemption_mode,
                max_prompt_logprob_rows=prompt_logprob_rows(  # the ring's bound at its width (core.geometry_for)
                    max(options.max_num_batched_tokens, options.max_num_seqs),
                    min(logprobs_cap(options.max_logprobs, info.vocab_size), info.vocab_size)),
            ),
            pool,
            swap,
            StateSlots(info.num_state_slots),
        )
        builder = StepBuilder(
            pool,
            max_tokens=max(options.max_num_batched_tokens, options.max_num_seqs),
            max_rows=options.max_num_seqs,
            max_model_len=info.max_model_len,
            swap=swap,
            vocab_size=info.vocab_size,
            state_slots=info.num_state_slots > 0,
        )
        self.grammars = GrammarBook(info.vocab_size)
        self.speculator = (Speculator(NgramProposer(), options.num_speculative_tokens, info.max_model_len,
                                      options.speculative_disable_by_batch_size)
                           if options.speculative == "ngram" else None)
        self.io = StepIo(device, pool, builder, special_tokens, tuple(info.eos_token_ids), info.max_model_len)
        self.pipeline = Pipeline()
        self.beams = BeamGroups(self.scheduler, self.pipeline)
        self.io.recover = options.recover_from_device_loss
        # Bursts run up to the device's burst_limit steps of one ticket: up to decode_burst steps for rows that
        # report at their finish, stream_interval for streamed ones.
        limit = device.burst_limit
        self.shaper = StepShaper((min(options.decode_burst, limit), min(options.stream_interval, limit)),
                                 self.speculator, info.max_model_len, builder.max_tokens)
        self.requests: dict[str, Sequence] = {}
        # Each adapter's LoRA slot on the device: --lora-modules' in order (the runner loads them so), then load_lora's;
        # and its prefix-cache key, new for every load (a slot refilled with another adapter shares no KV with it).
        self.lora_slots: dict[str, int] = {name: i for i, (name, _) in enumerate(lora_pairs(self.options.lora_modules))}
        self.lora_keys: dict[str, int] = {name: i for i, name in enumerate(self.lora_slots)}
        self._lora_loads = len(self.lora_slots)
        self._outbox: dict[int, Sequence] = {}  # sequences with tokens or a finish to report (Sequence.outbox)
        self._rng = random.Random(options.seed)
        self._arrivals = 0
        self.num_steps = 0
        self.generated_tokens = 0

    @property
    def pool(self) -> KvBlockPool:
        return self.scheduler.pool

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] = (),
        *,
        stream: bool = True,
        cache_salt: str | None = None,
        grammar: GrammarBlob | None = None,
        pooling: PoolingParams | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a request; Refused (a ValueError with its ErrorCode, naming the field) if it cannot be served.

        grammar: the compiled grammar of params.structured_outputs (frontend/grammar_compiler.py), against the
        vocabulary set_grammar_vocab was given.

        pooling: an embeddings request: its prompt is run and pooled as the model pools (ModelInfo.pooling), nothing is
        sampled, and its one delta carries the embedding.

        lora: the name of a LoRA adapter (EngineOptions.lora_modules', or one load_lora loaded) its rows run with.

        stream=False: its tokens are reported once, in the delta that finishes it (vLLM's FINAL_ONLY; the
        offline LLM's requests without stop strings), which spares a delta per request per tick.
        """
        self._check_new_id(request_id)
        try:
            params.validate(self.info.vocab_size, logprobs_cap(self.options.max_logprobs, self.info.vocab_size))
            if pooling is not None:
                pooling.validate(self.info.hidden_size, self.info.matryoshka, params)
                if output_token_ids:
                    raise ValueError("an embeddings request has no output: no output tokens")
        except ValueError as e:
            raise Refused(ErrorCode.BAD_REQUEST, str(e)) from None
        if not prompt_token_ids:
            raise Refused(ErrorCode.BAD_REQUEST, "prompt must have at least one token")
        vocab = self.info.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise Refused(ErrorCode.BAD_REQUEST, f"token_ids must be in [0, {vocab}) (got {bad[:5]})")
        lora_slot = -1
        if lora is not None:
            lora_slot = self.lora_slots.get(lora, -1)
            if lora_slot < 0:
                served = ", ".join(sorted(self.lora_slots)) or "none"
                raise Refused(ErrorCode.BAD_REQUEST, f"the LoRA adapter {lora!r} is not loaded (loaded: {served})")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        row_grammar = None
        if params.structured_outputs is not None:
            if grammar is None:
                raise Refused(ErrorCode.BAD_REQUEST, "structured_outputs comes with its compiled grammar (AddRequest.grammar)")
            row_grammar = self.grammars.row_grammar(grammar, list(output_token_ids))
        seq = Sequence.of(
            request_id, params, seed, [*prompt_token_ids, *output_token_ids], len(prompt_token_ids), self._arrivals,
            grammar=row_grammar,
            outbox=self._outbox,
            stream=stream,
            cache_salt=cache_salt,
            pooling=None if pooling is None else with_model_default(pooling, self.info.pooling_normalize),
            pool_kind=POOL_KINDS[self.info.pooling] if pooling is not None else POOL_NONE,
            lora_slot=lora_slot,
            lora_key=self.lora_keys[lora] if lora is not None else -1,
            stop_at=min(len(prompt_token_ids) + params.max_tokens, self.info.max_model_len),
            stop_ids=frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.info.eos_token_ids),
        )
        self.scheduler.check_admissible(seq)
        self._arrivals += 1
        init_row_state(seq, self.io.toks)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests and not self.requests[request_id].finished or request_id in self.beams.groups:
            raise Refused(ErrorCode.BAD_REQUEST, f"request id {request_id!r} is already live")

    def add_beam_request(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams, *,
                         num_logprobs: int = 0, priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a beam search of the prompt (beam_groups.py): its one delta carries params.beam_width hypotheses
        (`RequestOutputDelta.beams`), best first, equal to transformers' generate(num_beams=W)'s. num_logprobs:
        alternatives per token beyond what the search needs (a client's top-N). Refused as add_request refuses."""
        self._check_new_id(request_id)
        try:
            search = BeamSearch(prompt_token_ids, params, self.info.eos_token_ids, num_logprobs)
            step = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True,
                                  logprobs=search.num_logprobs, priority=priority)
            step.validate(self.info.vocab_size, logprobs_cap(self.options.max_logprobs, self.info.vocab_size))
        except ValueError as e:
            raise Refused(ErrorCode.BAD_REQUEST, str(e)) from None
        if not prompt_token_ids:
            raise Refused(ErrorCode.BAD_REQUEST, "prompt must have at least one token")
        vocab = self.info.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise Refused(ErrorCode.BAD_REQUEST, f"token_ids must be in [0, {vocab}) (got {bad[:5]})")
        limit = min(self.info.max_model_len, self.pool.num_blocks * self.pool.block_size)
        if len(prompt_token_ids) + params.max_tokens > limit:
            raise Refused(ErrorCode.TOO_LONG, f"max_tokens {params.max_tokens} after a prompt of "
                          f"{len(prompt_token_ids)} tokens passes the engine's {limit} (max_model_len, KV capacity)")
        group = BeamGroup(request_id, search)
        for j in range(params.beam_width):
            group.rows.append(Sequence.of(f"{request_id}#beam{j}", step, 0, prompt_token_ids, len(prompt_token_ids),
                                          self._arrivals + j, cache_salt=cache_salt, stream=False, beam=group))
        self.scheduler.check_admissible(group.rows[0])
        self._arrivals += params.beam_width
        for seq in group.rows[1:]:
            self.scheduler.hold(seq)
        self.beams.add(group)

    def load_lora(self, name: str, path: str) -> int:
        """Load the PEFT adapter at path under `name` into a free LoRA slot of the device (after every step in
        flight) and return the slot; Refused naming why not (no LoRA, the name taken, every slot taken, the
        device's reason). Requests may name it once this returns."""
        if not self.info.max_loras:
            raise Refused(ErrorCode.BAD_REQUEST, "this server serves no LoRA adapters (--enable-lora)")
        if name in self.lora_slots:
            raise Refused(ErrorCode.BAD_REQUEST, f"the LoRA adapter {name!r} is already loaded")
        free = sorted(set(range(self.info.max_loras)) - set(self.lora_slots.values()))
        if not free:
            raise Refused(ErrorCode.BAD_REQUEST, f"every LoRA slot is taken (max_loras {self.info.max_loras}): "
                                                 f"{', '.join(sorted(self.lora_slots))}")
        try:
            self.device.load_lora(free[0], path)
        except DeviceError as e:
            raise Refused(ErrorCode.BAD_REQUEST, f"the LoRA adapter {name!r} cannot be loaded: {e}") from None
        self.lora_slots[name] = free[0]
        self._lora_loads += 1
        self.lora_keys[name] = self._lora_loads
        return free[0]

    def unload_lora(self, name: str) -> None:
        """Empty the slot of adapter `name`; Refused when it is not loaded or a live request runs with it."""
        slot = self.lora_slots.get(name)
        if slot is None:
            raise Refused(ErrorCode.BAD_REQUEST, f"the LoRA adapter {name!r} is not loaded")
        users = sum(1 for s in self.requests.values() if s.req.lora_slot == slot and not s.finished)
        if users:
            raise Refused(ErrorCode.BAD_REQUEST, f"the LoRA adapter {name!r} runs {users} requests; unload it after")
        del self.lora_slots[name], self.lora_keys[name]
        try:
            self.device.load_lora(slot, "")
        except DeviceError as e:  # the slot is no request's any more either way
            log.warning("emptying LoRA slot %d failed: %s", slot, e)

    def set_grammar_vocab(self, vocab: GrammarVocab) -> None:
        """The vocabulary structured outputs' grammars are compiled against (sent by the frontend)."""
        self.grammars.set_vocab(vocab)

    def abort(self, request_id: str) -> None:
        """Stop a request now: nothing more of it is committed, even what is in flight."""
        if self.beams.abort(request_id):
            return
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return
        if seq.status == SeqStatus.WAITING:
            self.scheduler.remove_waiting(seq)
        elif seq.status == SeqStatus.SWAPPED:
            self.scheduler.remove_swapped(seq)
        else:
            discard_row(self.pipeline, seq)
        seq.finish("abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.beams.groups) or self.pipeline.has_inflight()

    # ---- the tick -------------------------------------------------------------------

    def step(self) -> list[RequestOutputDelta]:
        """Run one tick and return what it produced."""
        out = self._tick()
        if self.beams.groups:  # after the settle: beam searches whose rows all committed move on
            out += self.beams.tick()
        return out

    def _tick(self) -> list[RequestOutputDelta]:
        self.num_steps += 1
        pipeline, io = self.pipeline, self.io
        inf = pipeline.inflight
        if inf is not None:
            if inf.kind == StepKind.STEP and self._may_run_ahead(inf):
                self.scheduler.retire_finished(keep=inf.seqs)
                ahead = self.scheduler.schedule_ahead(inf.seqs, inf.samples, inf.discard, can_feed, inf.written,
                                                      inf.num_new)
                if ahead is not None:
                    pipeline.next = launch(ahead, pipeline, io, ahead=True)
            # What this commits is delivered (and aborts that it prompts are seen) before the next launch:
            # no tick commits two tokens of one request.
            settle(pipeline, io)
            if inf.kind == StepKind.BURST and not io.device_lost and self._quiet_decode():
                # The batch goes on as it is: the next burst is launched before the outputs go out.
                running = self.scheduler.running
                nxt = self.shaper.burst(ScheduledStep(list(running), [1] * len(running), [FEED_HOST] * len(running)), io)
                if nxt.kind == StepKind.BURST:
                    pipeline.inflight = launch(nxt, pipeline, io)
            return self._take_outputs()
        self.scheduler.retire_finished()
        step = self.scheduler.schedule()
        if not step.seqs:
            self._fail_unschedulable()
            return self._take_outputs()
        if step.decode_only and len(step) == len(self.scheduler.running):
            step = self.shaper.shape(step, io)
        pipeline.inflight = inf = launch(step, pipeline, io)
        if inf is not None and (step.kind == StepKind.VERIFY or step.kind == StepKind.STEP and not self.options.pipeline):
            # Depth 0: the synchronous loop, and a verify step (its picks are the next inputs).
            if settle(pipeline, io) == Settled.DONE and step.kind == StepKind.VERIFY:
                self.speculator.record(inf)
        return self._take_outputs()

    @property
    def device_lost(self) -> str | None:
        """Why the device was lost (under recovery), until recover() is called."""
        return self.io.device_lost

    def recover(self) -> None:
        """The device came back empty: requeue every running request with its committed tokens.

        Their KV is recomputed from prompt + output; with greedy or seeded sampling the streams then
        continue exactly as if nothing happened.
        """
        abandon(self.pipeline, None)
        self.scheduler.retire_finished()
        self.scheduler.requeue_all()
        self.io.device_lost = None

    def fail_running(self, message: str, code: ErrorCode) -> None:
        """Fail every running request with this error (a lost worker under --on-worker-fault fail)."""
        for seq in self.scheduler.running:
            seq.finish("error", message, code)

    def contain_failure(self, exc: BaseException) -> list[RequestOutputDelta]:
        """A tick raised: fail the request that caused it, not the process.

        Every request it was running is suspect: what is in flight is abandoned, each is requeued with its
        committed tokens (their streams go on unchanged) and runs alone until it is past the failing point
        (Scheduler._may_start), so the next failure names one request. A request that was running at
        MAX_ENGINE_FAILURES failures is failed with an internal error instead.
        """
        abandon(self.pipeline, self.io)
        for seq in self.scheduler.suspect_running(MAX_ENGINE_FAILURES):
            log.error("request %s failed the engine %d times; failing it", seq.request_id, seq.failures)
            seq.finish("error", f"the engine failed {seq.failures} times while running this request "
                                f"({type(exc).__name__}: {exc})", ErrorCode.INTERNAL)
        self.scheduler.retire_finished()
        self.scheduler.requeue_all()  # KV written by the failed tick is not trusted: recompute, forget the cache
        self.io.device_lost = None
        return self._take_outputs() + self.beams.tick()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's LLM.reset_prefix_cache); False, doing nothing, while
        requests are in flight (their blocks are registered in the cache)."""
        if self.has_unfinished():
            return False
        self.scheduler.pool.reset_cache()
        return True

    def drain(self) -> list[RequestOutputDelta]:
        """Settle everything in flight (before shutdown or a worker swap)."""
        drain(self.pipeline, self.io)
        return self._take_outputs() + self.beams.tick()

    def _may_run_ahead(self, inf) -> bool:
        """True when the next step may be launched before the one in flight is committed: its tokens are the
        device's (no repick pending), the device is there, and no burst could run instead (then the lane
        settles, and the next tick bursts)."""
        shaper = self.shaper
        if inf.repick or self.io.device_lost or shaper.drafts_ready(self.scheduler.running):
            return False
        if max(shaper.burst_limits) <= 1:
            return True
        if self.scheduler.has_admissible():
            return True
        live = [s for s in self.scheduler.running if s.out.finish_reason is None]
        # burst_length first: it stops at the first row that rules a burst out (a streamed one, usually).
        return not (shaper.burst_length(live) > 1 and all(
            len(s.out.tokens) - s.num_computed - s.num_inflight <= 1 for s in live))

    def _quiet_decode(self) -> bool:
        """True when the running rows may go on decoding as they are: no arrival to admit, nothing to
        retire, no prefill (an embeddings request's last token is a prefill's)."""
        return not self.scheduler.has_admissible() and all(
            s.out.finish_reason is None and len(s.out.tokens) - s.num_computed <= 1 and not s.req.pool_kind
            for s in self.scheduler.running
        )

    def _fail_unschedulable(self) -> None:
        """With nothing running, a waiting head that still does not fit never will: fail it."""
        if self.scheduler.running or not self.scheduler.num_waiting:
            return
        head = self.scheduler.waiting()[0]
        self.scheduler.remove_waiting(head)
        head.finish("error", f"the KV cache ({self.pool.num_blocks} blocks) cannot hold this request")

    def _take_outputs(self) -> list[RequestOutputDelta]:
        """The deltas of every request that committed tokens or finished since the last call (the outbox:
        the tick's cost follows what happened, not how many requests there are).

        A finished request stays listed (and in the outbox) until its blocks are freed, so anything committed
        to it after its finish (which validation exists to prevent) would show, not vanish. Nothing made here
        outlives the tick but the deltas: a token list per delta, sliced from the sequence's tokens.
        """
        out = []
        interval = self.options.stream_interval
        outbox = self._outbox
        kept = []
        generated = 0
        for seq in outbox.values():
            o, req = seq.out, seq.req
            tokens, reported = o.tokens, o.reported
            n = len(tokens)
            pending = n - reported
            first = pending and reported == req.num_prompt  # nothing of its output reported yet
            finished = o.finish_reason is not None
            finishing = finished and not o.reported_finish
            # Streamed tokens are due every `interval`; the first ones at once.
            if finishing or pending and req.stream and (pending >= interval or first):
                lps = o.pending_logprobs
                if lps:
                    o.pending_logprobs = []
                toks = [tokens[reported]] if pending == 1 else tokens[reported:].tolist()
                out.append(RequestOutputDelta(req.request_id, toks, None, lps or None) if not (finishing or first)
                           else RequestOutputDelta(  # the usual row takes the short form above
                               req.request_id, toks, o.finish_reason if finishing else None, lps or None,
                               o.error if finishing else None,
                               o.error_code.value if finishing and o.error_code is not None else None,
                               seq.num_cached_tokens, o.prompt_entries if first else None,
                               o.embedding if finishing else None, seq.queued_s))
                generated += pending
                o.reported = n
                o.reported_finish = finished
                pending = 0
            if finished:
                if not seq.kv.num_blocks:  # its blocks are freed: nothing more can come of it
                    if self.requests.get(req.request_id) is seq:
                        del self.requests[req.request_id]
                    continue
                kept.append(seq)
            elif pending:
                kept.append(seq)
        self.generated_tokens += generated
        outbox.clear()  # the sequences hold this dict (Output.outbox): emptied and refilled, never replaced
        for seq in kept:
            outbox[id(seq)] = seq
        return out

    # ---- facts ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.pool
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.scheduler.num_waiting,
            swapped=len(self.scheduler.swapped),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_cached=pool.num_cached,
            kv_blocks_free=pool.num_free,
            prefix_cache_hit_rate=pool.stats.hit_rate,
            preemptions=self.scheduler.num_preemptions,
            swapped_out_blocks=self.scheduler.swap.blocks_out,
            swapped_in_blocks=self.scheduler.swap.blocks_in,
            steps=self.num_steps,
            generated_tokens=self.generated_tokens,
            spec_draft_tokens=self.speculator.stats.drafted if self.speculator else 0,
            spec_accepted_tokens=self.speculator.stats.accepted if self.speculator else 0,
            repicks=self.io.repicks,
            kernels=self.info.kernels,
        )


def _for_state_slots(options: EngineOptions, info) -> EngineOptions:
    """The options a model with recurrent state slots can serve under: no more sequences than slots, no prefix
    caching (a cached KV prefix does not restore the recurrent state after it), preemption by recompute
    (swap copies KV, not the state) and no speculative decoding (a verify step runs the drafts through the
    state, which cannot drop the rejected ones again); unchanged for a model without them."""
    slots = info.num_state_slots
    if not slots:
        return options
    changes = {}
    if options.max_num_seqs > slots:
        changes["max_num_seqs"] = slots
    if options.enable_prefix_caching:
        changes["enable_prefix_caching"] = False
    if options.preemption_mode != "recompute":
        changes["preemption_mode"] = "recompute"
    if options.speculative is not None:
        changes["speculative"] = None
    if changes:
        log.info("%s keeps recurrent state in %d slots: serving with %s", info.name, slots,
                 ", ".join(f"{k}={v}" for k, v in changes.items()))
    return dataclasses.replace(options, **changes)
