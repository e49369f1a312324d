"""The engine-core process: requests from the frontend in, one EngineOutputs per tick out.

The loop, top to bottom: take what the frontend sent (without waiting while there is work), run one
tick, send its outputs; when the worker died, wait for the supervisor's new one and requeue. Idle, it
blocks on the input socket (never spins an idle core). Socket contract: frontend/server.py's docstring.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import msgspec
import psutil
import zmq

from metrale.config import ServeConfig
from metrale.ipc.messages import (
    AbortRequest,
    AddRequest,
    EngineInput,
    EngineOutput,
    EngineOutputs,
    EngineReady,
    RequestOutputDelta,
    StatsRequest,
    StatsResponse,
)
from metrale.ipc.plan import DeviceError
from metrale.ipc.tickets import RingGeometry

from .engine import EngineCore, EngineOptions
from .pipeline import SpecialTokens
from .scheduler import SchedulerBusy
from .step_builder import MAX_BAN_IDS
from .worker_device import WorkerDevice

log = logging.getLogger("metrale.engine_core")

IDLE_POLL_MS = 200  # how often an idle engine core checks that its parent lives


class EngineCoreArgs(msgspec.Struct, kw_only=True):
    """What the supervisor tells an engine-core process (as JSON on its command line)."""

    serve: ServeConfig
    input_address: str
    output_address: str
    ring_token: str
    max_model_len: int
    special_tokens: dict[str, int | None] = {}
    ready_timeout_s: float = 600.0


def ring_geometry(args: EngineCoreArgs) -> RingGeometry:
    """Ticket slots sized for the largest step this engine can build."""
    e = args.serve.engine
    return RingGeometry(
        num_slots=4,
        max_tokens=max(e.max_num_batched_tokens, e.max_num_seqs),
        max_rows=e.max_num_seqs,
        max_blocks_per_row=-(-args.max_model_len // e.block_size) + 1,
        max_ban_ids=MAX_BAN_IDS,
        max_hist_tokens=max(65536, e.max_num_seqs * args.max_model_len),
    )


def engine_options(args: EngineCoreArgs) -> EngineOptions:
    e = args.serve.engine
    return EngineOptions(
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_waiting=e.max_waiting,
        enable_prefix_caching=e.enable_prefix_caching,
        pipeline=e.pipeline,
        seed=e.seed,
        recover_from_device_loss=args.serve.on_worker_fault == "recover",
    )


class EngineCoreProcess:
    """Sockets around one EngineCore."""

    def __init__(self, args: EngineCoreArgs, device: WorkerDevice):
        self.args = args
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(args.input_address)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(args.output_address)
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.device = device
        self.parent = os.getppid()
        self.stopping = False
        info = self.device.wait_ready(args.ready_timeout_s)
        self.engine = EngineCore(self.device, engine_options(args), special_tokens=SpecialTokens(**args.special_tokens))
        self._send(EngineReady(vocab_size=info.vocab_size, max_model_len=info.max_model_len,
                               num_kv_blocks=info.num_kv_blocks, block_size=info.block_size))
        log.info("engine core ready: %s, %d KV blocks of %d", info.name, info.num_kv_blocks, info.block_size)

    def run(self) -> None:
        """The busy loop: inputs, one tick, outputs; block when idle."""
        while not self.stopping:
            busy = self.engine.has_unfinished()
            self._take_inputs(block=not busy)
            if not self.engine.has_unfinished():
                continue
            outputs = self.engine.step()
            if outputs:
                self._send(EngineOutputs(outputs=outputs))
            if self.engine.device_lost:
                self._await_new_worker()

    def _take_inputs(self, block: bool) -> None:
        """Handle every message waiting; when idle, wait (in slices) for the first."""
        while True:
            if block:
                if not self.inbox.poll(IDLE_POLL_MS):
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
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.output_token_ids)
            except SchedulerBusy as e:
                self._refuse(msg.request_id, f"busy: {e}")
            except ValueError as e:
                code = "too_long" if "prompt has" in str(e) else "bad_request"
                self._refuse(msg.request_id, f"{code}: {e}")
        elif isinstance(msg, AbortRequest):
            for rid in msg.request_ids:
                self.engine.abort(rid)
        elif isinstance(msg, StatsRequest):
            self._send(StatsResponse(id=msg.id, stats=self.engine.stats()))

    def _refuse(self, request_id: str, error: str) -> None:
        self._send(EngineOutputs(outputs=[RequestOutputDelta(request_id, [], "error", None, error)]))

    def _await_new_worker(self) -> None:
        """The worker died: wait for the supervisor's replacement, then recompute what was running."""
        log.warning("worker lost (%s); waiting for a new one", self.engine.device_lost)
        try:
            self.device.wait_ready(self.args.ready_timeout_s)
        except DeviceError as e:
            log.error("no new worker: %s", e)
            self.stopping = True
            return
        self.engine.recover()
        log.info("new worker ready; %d requests requeued", self.engine.scheduler.num_waiting)

    def _send(self, msg: EngineOutput) -> None:
        self.outbox.send(self.encoder.encode(msg))

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close()
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m metrale.engine_core.core --args JSON`."""
    ap = argparse.ArgumentParser(prog="python -m metrale.engine_core.core")
    ap.add_argument("--args", required=True, help="EngineCoreArgs as JSON")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    args = msgspec.json.decode(ns.args, type=EngineCoreArgs)
    proc = None

    def stop(*_):
        if proc is None:
            raise SystemExit(0)  # still starting: unwind, the finally below removes the ring
        proc.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides the shutdown order
    device = WorkerDevice(ring_geometry(args), token=args.ring_token)
    try:
        proc = EngineCoreProcess(args, device)
        proc.run()
    finally:
        if proc is not None:
            proc.close()
        device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
