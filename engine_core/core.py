"""The engine-core process: requests from the frontend in, one EngineOutputs per tick out.

The loop, top to bottom: take what the frontend sent (without waiting while there is work), run one
tick, send its outputs; when the worker died, wait for the supervisor's new one. Idle, it blocks on the
input socket (never spins an idle core). Socket contract: frontend/engine_link.py's docstring; with several
frontends (--api-server-count) each answer goes to the frontend its id names (frontend_links.py).

A dead worker (`DeviceLost`) is always noticed the same way; `--on-worker-fault` decides what happens to the
requests it was running: `recover` requeues them with their committed tokens (the new worker recomputes their
KV and their streams go on unchanged), `fail` ends each with one `worker_fault` error. Either way the engine
core then waits for the supervisor's replacement and serves on; requests still waiting are kept.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time

import msgspec
import psutil
import zmq

from metrale.config import EngineArgs, ServeConfig
from metrale.ipc.messages import (
    AbortRequest,
    AddRequest,
    EngineInput,
    EngineLoad,
    EngineReady,
    FrontendUp,
    GrammarVocab,
    RequestOutputDelta,
    LoraUpdate,
    LoraUpdated,
    StatsRequest,
    StatsResponse,
    WorkerBack,
    WorkerLost,
    WorkerRecovery,
)
from metrale.ipc.errors import ErrorCode, Refused
from metrale.ipc.plan import DeviceError
from metrale.ipc.sampling import MAX_LOGPROBS, logprobs_cap
from metrale.ipc.status_channel import EXIT_CONFIG, FAILED, WORKER_HUNG, StatusSender
from metrale.ipc.tickets import RingGeometry

from .engine import EngineCore, EngineOptions
from .frontend_links import FrontendLinks
from .hang_watch import HangWatch
from .output_ledger import OutputLedger
from .pipeline import SpecialTokens
from .step_builder import MAX_BAN_IDS
from .worker_device import WorkerDevice

log = logging.getLogger("metrale.engine_core")

IDLE_POLL_MS = 200  # how often an idle engine core checks that its parent lives
HEARTBEAT_S = 0.5  # while it works, the engine core tells the frontend at least this often that it progresses
MAX_STREAM_BURST = 32  # decode steps per ticket at most, whatever --stream-interval says


class EngineCoreArgs(msgspec.Struct, kw_only=True):
    """What the supervisor tells an engine-core process (as JSON on its command line)."""

    serve: ServeConfig
    input_address: str  # frontend 0's PUSH, which this engine core's PULL connects to
    output_address: str  # frontend 0's PULL, which this engine core's PUSH connects to
    # --api-server-count: [input, output] of frontends 1 .. N-1 (the same roles as the two above).
    more_frontends: list[list[str]] = []
    ring_token: str
    max_model_len: int
    vocab_size: int = 0  # the model's (sizes the ring's grammar bitmasks)
    special_tokens: dict[str, int | None] = {}
    ready_timeout_s: float = 600.0
    served_path: str = ""  # where to write the pid of each worker once it has served a step (for the supervisor)
    pool_dim: int = 0  # the model's hidden size: the width of the embeddings the ring carries back
    status_address: str = ""  # the supervisor's status inbox (ipc/status_channel.py)
    replica: int = 0  # this engine core's data-parallel replica (for its logs)
    ring_ranks: int = 1  # the worker ranks that serve its ring together (a tensor-parallel group on this host)


def ring_geometry(args: EngineCoreArgs) -> RingGeometry:
    """Ticket slots sized for the largest step this engine can build."""
    # Streamed rows burst up to their interval; longer bursts save little and size every slot's results.
    return geometry_for(args.serve.engine, args.max_model_len, max(1, min(args.serve.stream_interval, MAX_STREAM_BURST)),
                        args.vocab_size, args.pool_dim)


def geometry_for(e: EngineArgs, max_model_len: int, max_burst: int, vocab_size: int, pool_dim: int = 0) -> RingGeometry:
    """Ticket slots for an engine's largest step and bursts of up to max_burst steps (serve, and LLM's worker group):
    grammar rows' bitmasks for vocab_size, a verify step's picks, and every row's embedding of pool_dim (0: none)."""
    return RingGeometry(
        num_slots=4,
        max_tokens=max(e.max_num_batched_tokens, e.max_num_seqs),
        max_rows=e.max_num_seqs,
        max_blocks_per_row=-(-max_model_len // e.block_size) + 1,
        max_ban_ids=MAX_BAN_IDS,
        # Alternatives per token, sampled or prompt: --max-logprobs (never more than the vocabulary, at least MAX_LOGPROBS).
        max_logprobs=max(MAX_LOGPROBS, min(logprobs_cap(e.max_logprobs, vocab_size), vocab_size)),
        max_hist_tokens=max(65536, e.max_num_seqs * max_model_len),
        # A verify step's picks come back as the steps of a burst.
        max_burst=max(max_burst, 1 + e.num_speculative_tokens if e.speculative else 1),
        max_bitmask_words=max(1, -(-vocab_size // 32)),
        max_pool_dim=pool_dim,
    )


class EngineCoreProcess:
    """Sockets around one EngineCore."""

    def __init__(self, args: EngineCoreArgs, device: WorkerDevice):
        self.args = args
        self.ctx = zmq.Context()
        self.frontends = FrontendLinks(self.ctx, [(args.input_address, args.output_address),
                                                  *((a, b) for a, b in args.more_frontends)], HEARTBEAT_S)
        self.inbox = self.frontends.inbox
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.device = device
        self.parent = os.getppid()
        self.stopping = False
        self.waiting_for_worker = False  # SIGTERM then exits at once (nothing is running)
        self._recovered_at: float | None = None  # when the last replacement worker was ready (for its log line)
        self.recoveries = 0
        self.recovery: WorkerRecovery | None = None  # the last lost worker's replacement and its cost
        self._fault_began: float | None = None  # monotonic; set until a resumed request's first token
        self._idle_loss: str | None = None  # the worker died while nothing ran (found by the idle poll)
        self._idle_checked_at = time.monotonic()
        self._unproven = True  # the current worker has not served a step yet
        self.status = StatusSender(args.status_address, "engine_core") if args.status_address else None
        self.ledger = OutputLedger()  # resumable requests' outputs, for a frontend that re-attaches after a restart
        device.on_hang = self._report_hang
        try:
            info = self.device.wait_ready(args.ready_timeout_s)
        except DeviceError as e:
            if self.status is not None:  # the worker could not start: a start-up failure, not a crash to retry
                self.status.send(FAILED, str(e))
            raise
        # A lost device is always left to this process, which applies --on-worker-fault (_replace_worker).
        options = EngineOptions.from_args(args.serve.engine, recover_from_device_loss=True)
        options.stream_interval = args.serve.stream_interval
        self.engine = EngineCore(self.device, options, special_tokens=SpecialTokens(**args.special_tokens))
        self._replicated = args.serve.engine.data_parallel_size > 1
        self.frontends.broadcast(EngineReady(vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                               num_kv_blocks=info.num_kv_blocks, block_size=info.block_size))
        log.info("engine core ready: %s, %d KV blocks of %d", info.name, info.num_kv_blocks, info.block_size)

    def run(self) -> None:
        """The busy loop: inputs, one tick, outputs; block when idle."""
        while not self.stopping:
            for rid in self.ledger.expire():  # a dead frontend's request nobody re-attached in time
                self.engine.abort(rid)
            busy = self.engine.has_unfinished()
            self._take_inputs(block=not busy)
            if self._idle_loss is not None:  # the worker died between requests: replace it now
                lost, self._idle_loss = self._idle_loss, None
                self._replace_worker(lost)
                continue
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a request's failure must not take the process down
                log.exception("engine core: a tick failed; its requests are retried alone, then failed")
                outputs = self.engine.contain_failure(exc)
            # An empty one is the heartbeat: work goes on. Replicas also say how busy they are (routing).
            self._send_outputs(outputs, self._load() if self._replicated else None)
            if outputs and (self._unproven or self._recovered_at is not None):
                self._note_worker_progress()
            if self._fault_began is not None and any(o.new_token_ids for o in outputs):
                self._note_resumed()
            if self.engine.device_lost:
                self._replace_worker(self.engine.device_lost)

    def _take_inputs(self, block: bool) -> None:
        """Handle every message waiting; when idle, wait (in slices) for the first."""
        while True:
            if block:
                ready = self.inbox.poll(IDLE_POLL_MS)
                now = time.monotonic()
                if now - self._idle_checked_at >= IDLE_POLL_MS / 1000:  # by the clock: queries may keep it busy
                    self._idle_checked_at = now
                    self._idle_loss = self.device.lost_while_idle()
                    if self._idle_loss is not None:
                        return
                if not ready:
                    if not psutil.pid_exists(self.parent) or os.getppid() != self.parent:
                        self.stopping = True
                    return
                block = False
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frame)

    def _handle(self, frame: bytes) -> None:
        """One message from the frontend; a request the engine refuses is answered with an error."""
        try:
            msg = self.decoder.decode(frame)
        except msgspec.DecodeError as e:
            log.error("dropping an undecodable frame from the frontend: %s", e)
            return
        if isinstance(msg, AddRequest):
            if msg.reattach is not None and self._reattach(msg):
                return
            try:
                if msg.beam is not None:
                    self.engine.add_beam_request(msg.request_id, msg.prompt_token_ids, msg.beam,
                                                 num_logprobs=msg.params.logprobs or 0, priority=msg.params.priority,
                                                 cache_salt=msg.cache_salt)
                else:
                    self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.output_token_ids,
                                            cache_salt=msg.cache_salt, grammar=msg.grammar, pooling=msg.pooling,
                                            lora=msg.lora)
                replaced = self.ledger.added(msg)
                if replaced is not None:  # the client started the id afresh: the old run is nobody's
                    self.engine.abort(replaced)
            except Refused as e:
                self._refuse(msg.request_id, e.code, e.message)
            except Exception as e:  # noqa: BLE001 - a bug admitting one request fails that request only
                log.exception("engine core: admitting request %s failed", msg.request_id)
                self._refuse(msg.request_id, ErrorCode.INTERNAL, f"the engine core could not admit it: {e}")
        elif isinstance(msg, GrammarVocab):
            self.engine.set_grammar_vocab(msg)
        elif isinstance(msg, AbortRequest):
            for rid in msg.request_ids:
                rid = self.ledger.engine_id(rid)  # a re-attached request runs under its first id
                self.ledger.aborted(rid)
                self.engine.abort(rid)
        elif isinstance(msg, FrontendUp):
            for rid in self.ledger.frontend_up(msg.prefix):  # nobody can ask for these again
                self.engine.abort(rid)
        elif isinstance(msg, LoraUpdate):
            self._update_lora(msg)
        elif isinstance(msg, StatsRequest):
            stats = self.engine.stats()
            worker = self.device.worker_stats()
            stats.worker_busy_s, stats.worker_idle_s = worker.busy_ns / 1e9, worker.idle_ns / 1e9
            cache = self.engine.pool.stats  # the hit rate's two counts, so that replicas' rates can be summed
            stats.prefix_cache_hit_tokens, stats.prefix_cache_queried_tokens = cache.hit_tokens, cache.queried_tokens
            stats.worker_recoveries, stats.last_worker_recovery = self.recoveries, self.recovery
            self.frontends.answer(msg.id, StatsResponse(id=msg.id, stats=stats))

    def _reattach(self, msg: AddRequest) -> bool:
        """A restarted frontend re-attaches a request its predecessor submitted: its outputs so far go out at once
        (engine_core/output_ledger.py). False when none is held under its key and it is to run as a new one."""
        catch_up = self.ledger.attach(msg, self.frontends.is_down)
        if catch_up is not None:
            self._send_outputs([catch_up])
            return True
        if msg.reattach == "only":
            self._refuse(msg.request_id, ErrorCode.RESUME_LOST, "the server no longer holds this request (it ended "
                         f"more than {self.ledger.window_s:.0f} s ago, or its engine core restarted); start it again")
            return True
        return False

    def _update_lora(self, msg: LoraUpdate) -> None:
        """Load or unload an adapter (in order after the steps in flight) and say how it went."""
        try:
            if msg.path:
                self.engine.load_lora(msg.name, msg.path)
            else:
                self.engine.unload_lora(msg.name)
            self.frontends.answer(msg.id, LoraUpdated(id=msg.id))
        except Refused as e:
            self.frontends.answer(msg.id, LoraUpdated(id=msg.id, error=e.message))
        except Exception as e:  # noqa: BLE001 - a bug in one update fails that update only
            log.exception("LoRA update %r failed", msg.name)
            self.frontends.answer(msg.id, LoraUpdated(id=msg.id, error=f"internal error: {e}"))

    def _load(self) -> EngineLoad:
        """How busy this engine core is now (for the frontend's routing between replicas)."""
        sched, pool = self.engine.scheduler, self.engine.pool
        return EngineLoad(len(sched.running), sched.num_waiting, pool.num_used, pool.num_blocks)

    def _refuse(self, request_id: str, code: ErrorCode, message: str) -> None:
        self._send_outputs([RequestOutputDelta(request_id, [], "error", None, message, code.value)])

    def _replace_worker(self, lost: str) -> None:
        """The worker died: settle its requests by the policy, wait for the supervisor's new one, serve on."""
        t_lost = (self.device.fault_began_ns or time.monotonic_ns()) / 1e9  # a hang began with its stuck step
        sched = self.engine.scheduler
        live = len(sched.running) + len(sched.swapped)
        self.recoveries += 1
        self.recovery = WorkerRecovery(cause=lost, lost_at=time.time() - (time.monotonic() - t_lost), requests=live)
        if self.args.serve.on_worker_fault == "fail":
            self.engine.fail_running(f"the GPU worker died ({lost}); the request was stopped", ErrorCode.WORKER_FAULT)
        self.engine.recover()  # nothing runs on the dead worker: requeue (or, failed, free) what it held
        failed = self.engine.drain()  # nothing is in flight any more: this only collects the errors
        if failed:
            self._send_outputs(failed)
        log.warning("worker lost (%s); %d requests wait for a new one", lost, self.engine.scheduler.num_waiting)
        self.frontends.broadcast(WorkerLost(why=lost))  # a frontend with other replicas moves them there meanwhile
        self.waiting_for_worker = True
        try:
            while not self.stopping:
                try:
                    self.device.wait_ready(self.args.ready_timeout_s)
                    break
                except DeviceError as e:  # the supervisor decides on restarts; we wait for the next one
                    log.error("no new worker yet: %s", e)
                    self.stopping = os.getppid() != self.parent
        finally:
            self.waiting_for_worker = False
        if self.stopping:
            return
        self._unproven = True
        self._recovered_at = time.monotonic()
        self.recovery.ready_s = self._recovered_at - t_lost
        # Requeued requests resume on the new worker: the cost of the restart is the wait for their first token.
        self._fault_began = t_lost if live and self.args.serve.on_worker_fault == "recover" else None
        self.frontends.broadcast(WorkerBack())
        log.info("new worker ready %.3f s after the loss (ready at monotonic %.6f)", self._recovered_at - t_lost,
                 self._recovered_at)

    def _note_worker_progress(self) -> None:
        """After a worker's first outputs: log the recompute's cost, tell the supervisor the worker serves."""
        now = time.monotonic()
        if self._recovered_at is not None:
            log.info("first tokens %.3f s after the new worker was ready (at monotonic %.6f)", now - self._recovered_at, now)
            self._recovered_at = None
        stats = self.device.worker_stats()
        if self._unproven and stats.steps > 0 and stats.worker_pid == self.device.pid:
            self._unproven = False
            if self.args.served_path:
                tmp = f"{self.args.served_path}.tmp"
                with open(tmp, "w") as f:
                    f.write(str(stats.worker_pid))
                os.replace(tmp, self.args.served_path)

    def _note_resumed(self) -> None:
        """The first token after a worker's replacement: the restart's cost, from the fault to this token."""
        self.recovery.resumed_s = time.monotonic() - self._fault_began
        self._fault_began = None
        log.info("worker restart: the first resumed token came %.3f s after the fault (%s)", self.recovery.resumed_s,
                 self.recovery.cause)

    def _report_hang(self, why: str) -> None:
        """The device killed a hung worker: the supervisor names it as the fault (then restarts it)."""
        if self.status is not None:
            self.status.send(WORKER_HUNG, why)

    def _send_outputs(self, outputs: list[RequestOutputDelta], load: EngineLoad | None = None) -> None:
        """Outputs to the frontends that submitted them (the ledger first gives a re-attached request the id its
        frontend knows it by); none: a heartbeat to each frontend that is due one."""
        self.ledger.record(outputs)
        self.frontends.send_outputs(outputs, load)

    def close(self) -> None:
        if self.status is not None:
            self.status.close()
        self.frontends.close()
        self.ctx.term()


# A tick makes a few containers per running request (its delta, its token list) that die within the tick. At the
# default young threshold (700) a collection runs mid-tick several times per tick and promotes the deltas alive at
# that moment, so full collections, whose pause grows with every live request and cached block, came every few dozen
# ticks at 1,024 rows. Collected every this many allocations, a tick's temporaries are mostly gone before one runs.
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """The engine core's collector: what exists once it is built (modules, the model's facts, the pool's arrays) is
    frozen out of every collection, and the young generation is collected every GC_YOUNG_THRESHOLD allocations."""
    gc.collect()
    gc.freeze()
    _, mid, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, mid, old)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m metrale.engine_core.core --args JSON`."""
    ap = argparse.ArgumentParser(prog="python -m metrale.engine_core.core")
    ap.add_argument("--args", required=True, help="EngineCoreArgs as JSON")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    args = msgspec.json.decode(ns.args, type=EngineCoreArgs)
    proc = None

    def stop(*_):
        if proc is None or proc.waiting_for_worker:
            raise SystemExit(0)  # starting, or waiting for a worker: unwind, the finally below removes the ring
        proc.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides the shutdown order
    # A SIGTERM while the ring and its doorbell are being made would leave half of them behind: it waits.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        device = WorkerDevice(ring_geometry(args), token=args.ring_token, num_ranks=args.ring_ranks,
                              hang_watch=HangWatch(floor_s=args.serve.worker_hang_timeout_s))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        raise
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one that came meanwhile lands here
        try:
            proc = EngineCoreProcess(args, device)
        except DeviceError as e:  # the worker could not start (reported to the supervisor): not a crash
            log.error("engine core: %s", e)
            return EXIT_CONFIG
        tune_gc()
        proc.run()
    finally:
        if proc is not None:
            proc.close()
        device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
