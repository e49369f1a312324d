"""The GPU worker process: serve the engine core's ticket ring with a model runner.

Started as `python -m metrale.gpu_worker.worker --ring NAME [...]` by the supervisor (or by
WorkerDevice.spawn in tests). It connects to the ring's doorbell, attaches the ring, builds its runner,
says WorkerReady(info), and then loops: wait for plan seq k in slot k % N (spin briefly, then block on
the doorbell), run it, write the result (or the error), publish, ring. It exits on Shutdown, when the
engine core's end of the doorbell closes, or when its parent process dies.

A runner is anything with `info: ModelInfo`, `launch(plan)` / `launch_burst(plan, steps)` (queue a step, or a
ticket's several, and return pending results: `ready()`, `result()`, result_copy.py) and `launch_verify(plan)`
for a verify step's drafts (one pending result per pick index). The worker launches ticket t+1 as soon as it is
published — fed on the device from t's tokens — before t's tokens have reached the host, and writes t's result
when its copy has landed, so the device is never left waiting for the host's round trip (on a CPU, or a runner
that runs a step to completion, a step's result is ready when launch returns, and the loop is the synchronous
one). One that counts its steps
(`steps_executed`) and keeps their logits (`resample(step, plan)`) also answers RESAMPLE tickets: a RepickOnly
repair, where the engine sends the settled ticket's rows with their masks as they are now and the runner's sampler
picks again from that step's kept logits, answered as the step's result would be. The plan's arrays are views
into the shared slot: a runner copies what it keeps past execute().
With METRALE_SIMULATE_DEVICE set (SIMULATE_ENV; "A,B,C" ms, or empty for the defaults) the runner is
sim_runner.SimRunner, a simulated device (a calibrated step time, no CPU meanwhile, toy tokens): benchmarks and
tests start `metrale serve` around it with no weights and no GPU.

Tensor parallel (`--group SPEC`, ipc/worker_group.py): each of N ranks is such a process. It joins the group
(gpu_worker/tp_group.py) before building its runner, which then holds this rank's shards. The ranks on the
engine core's host each connect their own doorbell and read every plan from the ring; rank 0 alone writes
results, publishes them and rings the engine. Every rank samples every row itself, from the same gathered logits
with the plan's parameters, noise and grammar bitmasks, so the ranks pick alike and each feeds its own next
step. Ranks on other hosts get each plan from rank 0 over the process group (gpu_worker/plan_broadcast.py). A
RESAMPLE ticket runs no collective: rank 0 answers it alone and the other ranks pass it by. A step that fails its
checks (PlanError) fails alike on every rank and is that step's error; any other failure under tensor
parallelism, or a collective that fails (GroupLost: a peer is gone), ends the rank with EXIT_GROUP_LOST, since
its peers may be waiting in a collective it will never reach: the supervisor then restarts the whole group and
the engine core requeues what it ran.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from metrale.ipc import worker_group
from metrale.ipc.doorbell import Attached, Bell, Shutdown, WorkerFailed, WorkerReady, bell_path
from metrale.ipc.plan import StepKind, StepResult
from metrale.ipc.tickets import SPIN_IS_SAFE, TicketRing
from metrale.ipc.worker_group import KEEPALIVE_S, GroupSpec

from .errors import GroupLost, PlanError
from .result_copy import launch_ticket, run_ticket

log = logging.getLogger("metrale.gpu_worker")

DEFAULT_FACTORY = "metrale.gpu_worker.model_runner:ModelRunner"
SIMULATE_ENV = "METRALE_SIMULATE_DEVICE"  # set ("A,B,C" ms, or empty): serve a simulated device (sim_runner.py)
SIM_FACTORY = "metrale.gpu_worker.sim_runner:SimRunner"
DEFAULT_SPIN_US = 100.0  # then block on the doorbell; the spin yields the core every turn (TicketRing._spin)
TICKETS_REMEMBERED = 8  # tickets whose runner step the worker remembers, for RESAMPLE tickets (the runner keeps fewer)
WAIT_SLICE_S = 0.02  # how often a blocked worker checks that its parent lives
EXIT_GROUP_LOST = 3  # a tensor-parallel rank whose group broke (a peer died, a collective failed)


@dataclass(slots=True)
class WorkerConfig:
    """Everything a worker process needs: which ring to serve and how to build its runner."""

    ring_name: str
    factory: str = DEFAULT_FACTORY  # "module:callable" returning a runner
    runner_kwargs: dict[str, Any] = field(default_factory=dict)
    spin_us: float = DEFAULT_SPIN_US
    connect_timeout_s: float = 60.0
    group: GroupSpec | None = None  # a tensor-parallel rank's place in its group (None: a worker of its own)


@dataclass(slots=True)
class _Started:
    """A ticket the worker has launched: its pending results (None: already written, an error or a LoRA load)."""

    slot: int
    seq: int
    steps: int
    t0: int  # perf_counter_ns at its start (for exec_ns)
    pending: list | None

    def ready(self) -> bool:
        """Whether its results can be written without waiting."""
        return self.pending is None or all(p.ready() for p in self.pending)


@dataclass(slots=True)
class WorkerLoop:
    """The serving loop's state: the ring, the doorbell, the runner and the worker's clock."""

    ring: TicketRing
    bell: Bell
    runner: Any
    spin_ns: int
    parent_pid: int
    rank: int = 0  # only rank 0 writes results, publishes them and rings the engine
    tensor_parallel: bool = False
    sender: Any = None  # rank 0's PlanSender when ranks run on other hosts
    idle_ns: int = 0
    busy_ns: int = 0
    steps: int = 0
    started_ns: int = 0
    runner_steps: dict[int, int] = field(default_factory=dict)  # ticket seq -> the runner's index of its last step
    pid: int = 0
    busy_since: int = 0  # monotonic ns since when the worker has had work (a step running or in flight)

    def serve(self, first_seq: int) -> None:
        """Run tickets first_seq, first_seq + 1, ... in order until told (or left) to stop; GroupLost when
        this rank's group broke.

        With a step in flight (launched, its result not yet on the host) the worker watches both its copy and
        the next ticket: a ticket published first is launched first (the device goes straight on), then the
        step in flight is written; results are always published in ticket order.
        """
        if self.rank > 0:
            self._follow(first_seq)
            return
        ring, n = self.ring, self.ring.num_slots
        self.pid = os.getpid()
        self.started_ns = t0 = time.monotonic_ns()
        # Every store says whether a wait for a plan is in progress (since when), in the same call as the
        # counters: a reader then counts the wait from its first nanosecond, spin included, and never twice.
        ring.store_worker_stats(self.pid, self.started_ns, 0, 0, 0, t0)
        seq = first_seq
        inflight: _Started | None = None
        while True:
            slot = seq % n
            if inflight is None:
                if not self.wait_for_plan(slot, seq, t0):
                    return
                t1 = time.monotonic_ns()
                self.idle_ns += t1 - t0  # published before the step, so a reader never loses this wait
                self.busy_since = t1
                ring.store_worker_stats(self.pid, self.started_ns, self.idle_ns, self.busy_ns, self.steps, 0)
            elif not self.wait_for_plan_or_copy(slot, seq, inflight):
                t0 = self.finish(inflight, waiting=True)  # its copy landed first: publish, then wait as usual
                inflight = None
                continue
            started = self.start_step(slot, seq)
            if inflight is not None:
                self.finish(inflight, waiting=False)
            inflight = started
            seq += 1
            if inflight.ready():
                t0 = self.finish(inflight, waiting=True)
                inflight = None

    def wait_for_plan_or_copy(self, slot: int, seq: int, inflight: _Started) -> bool:
        """Spin until plan seq is published (True) or the step in flight's results are on the host (False)."""
        ring = self.ring
        while True:
            if ring.plan_seq(slot) == seq:
                return True
            if inflight.ready():
                return False
            os.sched_yield()

    def start_step(self, slot: int, seq: int) -> _Started:
        """Launch ticket seq's plan in slot (one step, a decode burst's, a verify step, or a resample), or answer a
        LoRA ticket, or write the step's error; the worker keeps serving (see _failed for tensor parallelism)."""
        ring = self.ring
        t0 = time.perf_counter_ns()
        kind = ring.plan_kind(slot)
        if kind == StepKind.RESAMPLE:
            return _Started(slot, seq, 0, t0, self._resample(slot, t0))
        if kind == StepKind.LORA:
            self._answer_lora(slot, t0)
            return _Started(slot, seq, 0, t0, None)
        steps = ring.plan_steps(slot)
        try:
            plan = ring.read_plan(slot)
            if self.sender is not None:
                self.sender.send(plan, kind, steps)  # the off-host ranks run it too (a failure there ends the group)
            pending = launch_ticket(self.runner, plan, kind, steps)
            self._ran(seq)
            return _Started(slot, seq, steps, t0, pending)
        except Exception as exc:  # noqa: BLE001 - any failure of a step is that step's error
            self._failed(exc, slot, t0)
            return _Started(slot, seq, steps, t0, None)

    def finish(self, started: _Started, *, waiting: bool) -> int:
        """Write a started ticket's results (waiting for their copies), count it and publish it; the time it
        was published (when waiting: the worker's next wait for a plan starts then)."""
        ring = self.ring
        if started.pending is not None:
            try:
                results = [p.result() for p in started.pending]
                ring.write_results(started.slot, results, exec_ns=time.perf_counter_ns() - started.t0)
            except Exception as exc:  # noqa: BLE001 - a step that fails on the device is that step's error
                self._failed(exc, started.slot, started.t0)
        self.steps += started.steps
        now = time.monotonic_ns()
        self.busy_ns += now - self.busy_since
        self.busy_since = now
        # The step is counted before its result is visible: whoever has the result sees the count.
        ring.store_worker_stats(self.pid, self.started_ns, self.idle_ns, self.busy_ns, self.steps, now if waiting else 0)
        ring.publish_result(started.slot, started.seq)
        self.bell.ring()
        return now

    def _failed(self, exc: Exception, slot: int, t0: int) -> None:
        """A step failed: its error in the slot; GroupLost instead under tensor parallelism when it failed past
        the plan's checks, or when a collective did (see the module docstring)."""
        if isinstance(exc, GroupLost):
            raise exc
        traceback.print_exc(file=sys.stderr)
        if self.tensor_parallel and not isinstance(exc, PlanError):
            raise GroupLost(f"rank {self.rank}: a step failed past its checks: {exc!r}") from exc
        self.ring.write_error(slot, f"{type(exc).__name__}: {exc}", exec_ns=time.perf_counter_ns() - t0)

    def _follow(self, first_seq: int) -> None:
        """A rank > 0 beside the engine: run every plan rank 0 runs, write nothing."""
        ring, n = self.ring, self.ring.num_slots
        seq = first_seq
        t0 = time.monotonic_ns()
        while True:
            slot = seq % n
            if not self.wait_for_plan(slot, seq, t0):
                return
            ran = self.run_step(slot, seq)
            # The engine reuses a slot only after rank 0 published its result, which needs this rank's share of
            # the step's collectives, and it keeps fewer tickets in flight than slots: a reused slot means
            # this rank read a plan that changed under it (a RESAMPLE ticket, which rank 0 answers alone, aside).
            if ran and ring.plan_seq(slot) != seq:
                raise GroupLost(f"rank {self.rank}: ticket {seq}'s slot was reused while it ran")
            t0 = time.monotonic_ns()
            seq += 1

    def wait_for_plan(self, slot: int, seq: int, since_ns: int) -> bool:
        """Wait until plan seq is published in slot (True), or until the worker should exit (False)."""
        ring = self.ring
        if ring.plan_seq(slot) == seq:
            return True
        if ring.spin_for_plan(slot, seq, since_ns + self.spin_ns):
            return True
        keepalive_at = time.monotonic() + KEEPALIVE_S
        while ring.plan_seq(slot) != seq:
            if self.should_exit():
                return False
            self.bell.wait(WAIT_SLICE_S)
            if self.sender is not None and time.monotonic() >= keepalive_at:
                self.sender.idle()  # the off-host ranks wait in a broadcast: keep it short of its timeout
                keepalive_at = time.monotonic() + KEEPALIVE_S
        return True

    def run_step(self, slot: int, seq: int) -> int:
        """A rank > 0's run of ticket seq's plan in slot: the steps rank 0 runs, nothing written (a RESAMPLE
        ticket is rank 0's alone); the steps run. GroupLost for a failure past the plan's checks."""
        ring = self.ring
        kind = ring.plan_kind(slot)
        if kind == StepKind.RESAMPLE:
            return 0
        if kind == StepKind.LORA:  # every rank holds its shard of the adapter; rank 0 answers
            try:
                self.runner.load_lora(*ring.lora_request(slot))
            except Exception:  # noqa: BLE001 - rank 0 fails the same load the same way and says so
                traceback.print_exc(file=sys.stderr)
            return 0
        steps = ring.plan_steps(slot)
        try:
            run_ticket(self.runner, ring.read_plan(slot), kind, steps)
            self._ran(seq)
        except GroupLost:
            raise
        except PlanError:
            traceback.print_exc(file=sys.stderr)  # rank 0 refused it too
        except Exception as exc:  # noqa: BLE001 - past the checks: the group cannot follow
            raise GroupLost(f"rank {self.rank}: a step failed past its checks: {exc!r}") from exc
        return steps

    def _resample(self, slot: int, t0: int) -> list | None:
        """Launch a RESAMPLE ticket's picks on the runner (their pending result), or write its error (the step
        failed, its logits are no longer kept, the rows are not its own) and return None."""
        ring = self.ring
        try:
            return [self.runner.resample(self.step_of(ring.resample_of(slot)), ring.read_plan(slot))]
        except Exception as exc:  # noqa: BLE001 - that ticket's error; no collective ran, the group goes on
            traceback.print_exc(file=sys.stderr)
            ring.write_error(slot, f"{type(exc).__name__}: {exc}", exec_ns=time.perf_counter_ns() - t0)
            return None

    def _answer_lora(self, slot: int, t0: int) -> None:
        """Load (or empty) the LoRA slot a LoRA ticket names and answer it, or write its error; not across hosts
        (the off-host ranks follow plans only)."""
        ring = self.ring
        try:
            if self.sender is not None:
                raise ValueError("adapters of a group spread over hosts are fixed at start-up (--lora-modules)")
            self.runner.load_lora(*ring.lora_request(slot))
            ring.write_result(slot, StepResult(tokens=np.zeros(0, dtype=np.int32)), exec_ns=time.perf_counter_ns() - t0)
        except Exception as exc:  # noqa: BLE001 - that ticket's error; no collective ran, the group goes on
            ring.write_error(slot, f"{type(exc).__name__}: {exc}", exec_ns=time.perf_counter_ns() - t0)

    def _ran(self, seq: int) -> None:
        """Remember which runner step ticket seq ended with (its logits are that step's)."""
        executed = getattr(self.runner, "steps_executed", None)
        if executed is not None:
            self.runner_steps[seq] = executed - 1
            self.runner_steps.pop(seq - TICKETS_REMEMBERED, None)

    def step_of(self, seq: int) -> int:
        """The runner's index of ticket seq's (last) step; KeyError if it failed or is too old."""
        step = self.runner_steps.get(seq)
        if step is None:
            raise KeyError(f"step {seq} has no logits here (it failed, was never run, or is too old)")
        return step

    def should_exit(self) -> bool:
        """Whether the engine said Shutdown, its end of the doorbell closed, or our parent died."""
        if self.bell.peer_gone or os.getppid() != self.parent_pid:
            return True
        while self.bell.inbox:
            if isinstance(self.bell.inbox.popleft(), Shutdown):
                return True
        return False


def load_factory(spec: str):
    """The callable named by "module:attribute" (attribute may be dotted)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"runner factory must be 'module:callable', got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def run_worker(config: WorkerConfig) -> int:
    """Serve the ring named in config until shutdown (or, off the engine's host, rank 0's plans); the exit code."""
    spec = config.group
    if spec is not None and not spec.reads_ring:
        return _run_off_host(config)
    parent_pid = os.getppid()
    _import_runner(config)
    bell = Bell.connect(
        bell_path(config.ring_name), config.connect_timeout_s, keep_trying=lambda: os.getppid() == parent_pid
    )
    ring = TicketRing.attach(config.ring_name)
    joined = sender = None
    try:
        t0 = time.monotonic()
        if spec is not None:
            try:
                joined = _join(config)
            except Exception:  # noqa: BLE001 - a peer that never came, a rendezvous that broke: restart the group
                log.exception("rank %d could not join its group", spec.rank)
                return EXIT_GROUP_LOST
        log.info("loading %s", config.runner_kwargs.get("model_dir", "the model"))
        try:
            runner = _build_runner(config, joined)
        except Exception as exc:  # noqa: BLE001 - reported to the engine, then we exit
            traceback.print_exc(file=sys.stderr)
            try:
                bell.send(WorkerFailed(pid=os.getpid(), message=f"{type(exc).__name__}: {exc}"))
            except OSError:
                pass  # the engine core is gone too
            return 1
        info = runner.info
        log.info("ready in %.1f s: %s in %s on %s kernels; KV cache of %d blocks x %d tokens (%d tokens)", time.monotonic() - t0,
                 info.name, info.dtype, info.kernels, info.num_kv_blocks, info.block_size, info.num_kv_blocks * info.block_size)
        rank = spec.rank if spec is not None else 0
        try:
            bell.send(WorkerReady(pid=os.getpid(), info=info, rank=rank))
        except OSError:  # the engine core went away while we loaded (a failed start, a shutdown): nothing to serve
            log.info("the engine core left before the worker was ready; exiting")
            return 0
        first_seq = _await_attached(bell, parent_pid)
        if first_seq is None:
            return 0
        spin_ns = int(config.spin_us * 1000) if SPIN_IS_SAFE else 0
        if joined is not None and joined.plan_pg is not None and rank == 0:
            from .plan_broadcast import PlanSender

            sender = PlanSender(joined.plan_pg)
        loop = WorkerLoop(ring, bell, runner, spin_ns, parent_pid, rank=rank, tensor_parallel=spec is not None,
                          sender=sender)
        try:
            loop.serve(first_seq)
        except GroupLost as exc:
            log.error("rank %d: %s; exiting so that the group restarts", rank, exc)
            return EXIT_GROUP_LOST
        return 0
    finally:
        if sender is not None:
            sender.stop()
        if joined is not None:
            joined.close()
        bell.close()
        ring.close()


def _join(config: WorkerConfig):
    """Join the tensor-parallel group (CUDA ranks first take their own device)."""
    from .tp_group import join_group

    return join_group(config.group, _device(config))


def _device(config: WorkerConfig):
    """The torch device this worker runs on: the runner's, and for a CUDA rank its local device."""
    import torch

    name = config.runner_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if config.group is not None and str(name).startswith("cuda"):
        name = f"cuda:{config.group.local_rank}"
        torch.cuda.set_device(name)
    config.runner_kwargs["device"] = str(name)
    return torch.device(name)


def _import_runner(config: WorkerConfig) -> None:
    """Import the runner's module (torch and the model code, the longest part of a start) while the engine core
    is still making its ring; a failure is left to _build_runner, which reports it to the engine core."""
    try:
        importlib.import_module(config.factory.partition(":")[0])
    except Exception:  # noqa: BLE001 - raised again, and reported, where the runner is built
        pass


def _build_runner(config: WorkerConfig, joined):
    """The runner the factory makes (with this rank's group under tensor parallelism)."""
    kwargs = dict(config.runner_kwargs)
    if joined is not None:
        kwargs["group"] = joined.group
    return load_factory(config.factory)(**kwargs)


def _run_off_host(config: WorkerConfig) -> int:
    """A rank on another host than the engine core: join, build, then run each plan rank 0 broadcasts."""
    from .plan_broadcast import PlanReceiver

    spec = config.group
    try:
        joined = _join(config)
    except Exception:  # noqa: BLE001
        log.exception("rank %d could not join its group", spec.rank)
        return EXIT_GROUP_LOST
    try:
        runner = _build_runner(config, joined)
        receiver = PlanReceiver(joined.plan_pg)
        log.info("rank %d ready (off the engine core's host): plans come from rank 0", spec.rank)
        while True:
            item = receiver.receive()
            if item is None:
                return 0
            plan, kind, steps = item
            try:
                run_ticket(runner, plan, kind, steps)
            except PlanError:
                continue  # rank 0 refused it too
            except GroupLost:
                raise
            except Exception as exc:  # noqa: BLE001 - past the checks: the group cannot follow
                raise GroupLost(f"rank {spec.rank}: a step failed past its checks: {exc!r}") from exc
    except GroupLost as exc:
        log.error("rank %d: %s; exiting so that the group restarts", spec.rank, exc)
        return EXIT_GROUP_LOST
    finally:
        joined.close()


def _await_attached(bell: Bell, parent_pid: int) -> int | None:
    """The first seq the engine assigns us; None if it went away (or said Shutdown) first."""
    while not bell.peer_gone and os.getppid() == parent_pid:
        message = bell.receive(WAIT_SLICE_S)
        if isinstance(message, Attached):
            return message.first_seq
        if isinstance(message, Shutdown):
            return None
    return None


def _number(text: str) -> int | float:
    """An int if the text is one, else a float (kv cache memory may be bytes or a fraction)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """The WorkerConfig of a command line."""
    ap = argparse.ArgumentParser(prog="python -m metrale.gpu_worker.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--ring", default="", help="name of the ticket ring segment to serve")
    ap.add_argument("--group", default=None, help="a tensor-parallel rank's GroupSpec as JSON (ipc/worker_group.py)")
    ap.add_argument("--factory", default=DEFAULT_FACTORY, help="runner factory, 'module:callable'")
    ap.add_argument("--runner-kwargs", default="{}", help="JSON object of keyword arguments for the factory")
    ap.add_argument("--model-dir")
    ap.add_argument("--dtype")
    ap.add_argument("--num-kv-blocks", type=int)
    ap.add_argument("--kv-cache-memory", type=_number)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--spin-us", type=float, default=DEFAULT_SPIN_US)
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    group = worker_group.decode(args.group) if args.group else None
    if not args.ring and (group is None or group.reads_ring):
        ap.error("--ring is required (except for a rank off the engine core's host)")
    kwargs = msgspec.json.decode(args.runner_kwargs, type=dict[str, Any])
    for name in ("model_dir", "dtype", "num_kv_blocks", "kv_cache_memory", "block_size"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    factory = args.factory
    if SIMULATE_ENV in os.environ:  # a hidden switch for benchmarks and tests: no model, a timed toy device
        factory = SIM_FACTORY
        kwargs["step_ms"] = os.environ[SIMULATE_ENV]
    return WorkerConfig(
        ring_name=args.ring,
        factory=factory,
        runner_kwargs=kwargs,
        spin_us=args.spin_us,
        connect_timeout_s=args.connect_timeout,
        group=group,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu-worker %(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        return run_worker(config)
    except KeyboardInterrupt:
        return 0  # the supervisor's Ctrl-C reaches the whole process group; it cleans up


if __name__ == "__main__":
    sys.exit(main())
