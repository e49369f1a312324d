"""WorkerDevice: the Device whose steps run in a GPU worker process, through the shared-memory ticket ring.

The engine core owns the ring and the doorbell's listening socket; a worker process (started by the
supervisor, or by WorkerDevice.spawn for tests and offline use) attaches to them and says WorkerReady.
launch() writes a plan into slot seq % N, publishes seq, rings; await_result() spins briefly, then
waits on the doorbell in short slices, checking that the worker lives, so a dead worker is a
DeviceError within one slice (10 ms by default) and never a hang. A worker that lives but makes no
progress (stopped, deadlocked, a kernel that never returns) is killed once its step runs past HangWatch's
deadline, and is then lost like a dead one. A restarted worker attaches to the
same ring: wait_ready() accepts it, and every step launched before it is abandoned (DeviceError).

A tensor-parallel group (`num_ranks` > 1) is one device: each of its ranks on this host connects a doorbell of
its own and says WorkerReady with its rank; launch() rings them all (each reads the plan from the ring), rank 0
alone answers. The group lives and dies as one: a death (or closed doorbell) of any rank is a DeviceLost, and a
hung group (rank 0 stops answering when any rank stops, since every step waits on its collectives) is killed
whole. wait_ready() then waits for a whole new group.

No torch here: the engine core runs on numpy and plain Python.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec
import psutil

from metrale.ipc.doorbell import Attached, Bell, BellListener, Shutdown, WorkerFailed, WorkerReady, bell_path
from metrale.ipc.plan import DeviceError, DeviceLost, ModelInfo, StepKind, StepPlan, StepResult, Ticket
from metrale.ipc.tickets import SPIN_IS_SAFE, RingGeometry, TicketRing, WorkerStats
from metrale.settings import DEFAULTS

from .hang_watch import NO_WORK, HangWatch, StepWork

DEFAULT_SPIN_US = 100.0
WAIT_SLICE_S = 0.01
PID_CHECK_NS = 100_000_000  # how often a waiting step reads the process table (the doorbell tells sooner)
WORKER_MODULE = "metrale.gpu_worker.worker"


class WorkerDevice:
    """The Device protocol over a ticket ring served by a separate worker process."""

    def __init__(
        self,
        geometry: RingGeometry = RingGeometry(),
        *,
        token: str | None = None,
        spin_us: float = DEFAULT_SPIN_US,
        wait_slice_s: float = WAIT_SLICE_S,
        hang_watch: HangWatch | None = None,
        num_ranks: int = 1,
    ) -> None:
        """Create the ring ("metrale-<our pid>-<token>") and its doorbell; no worker yet (see wait_ready).
        num_ranks: the worker ranks on this host that serve the ring together (a tensor-parallel group).

        A supervisor that starts the worker itself passes a token it also gives the worker
        (`--ring metrale-<engine pid>-<token>`), then the engine calls wait_ready()."""
        self._ring = TicketRing.create(geometry, token=token)
        try:
            self._listener = BellListener(bell_path(self._ring.name))
        except BaseException:
            self._ring.close()
            raise
        self._spin_ns = int(spin_us * 1000) if SPIN_IS_SAFE else 0
        self._slice_s = wait_slice_s
        self._pid_checked_ns = 0  # when _why_gone last read the process table for the worker
        self.hang = hang_watch or HangWatch()
        self.on_hang: Callable[[str], None] | None = None  # told why, when a hung worker is killed
        self._launched_ns = [0] * self._ring.num_slots
        self._work = [NO_WORK] * self._ring.num_slots  # the work of the ticket in each slot (its hang deadline)
        self._progress_ns = time.monotonic_ns()  # the last result seen (or the worker's start)
        self.num_ranks = num_ranks
        self._bell: Bell | None = None  # rank 0's: it rings back with results
        self._bells: list[Bell] = []  # every rank's, in rank order
        self._info: ModelInfo | None = None
        self._pid: int | None = None  # rank 0's
        self._pids: list[int] = []  # every rank's, in rank order
        self._procs: list[subprocess.Popen] = []  # only when we spawned the worker(s)
        self._spawn_group = None  # callable(generation) -> one argv per rank, for a spawned group
        self._generation = 0  # starts of a spawned group (each meets at a fresh port)
        self._gone: str | None = "no worker has attached to the ring yet"
        # When the current worker's fault began (monotonic ns): its death noticed, or its hung step's start.
        self.fault_began_ns: int | None = None
        self._inflight = [0] * self._ring.num_slots  # seq in flight per slot, 0 when free
        self._next_seq = 1
        self._first_seq = 1  # tickets below this were launched to a previous worker
        self._closed = False
        self._loras: dict[int, str] = {}  # adapters loaded at run time (LoRA slot -> path): a new worker loads them too

    # ---- starting a worker ---------------------------------------------------------------

    @classmethod
    def spawn(
        cls,
        geometry: RingGeometry = RingGeometry(),
        *,
        factory: str | None = None,
        runner_kwargs: dict | None = None,
        env: dict[str, str] | None = None,
        worker_spin_us: float | None = None,
        ready_timeout_s: float = 600.0,
        tensor_parallel_size: int = DEFAULTS.tensor_parallel_size,
        all_reduce: str = DEFAULTS.all_reduce,
        **device_kwargs,
    ) -> WorkerDevice:
        """Create a device and start its worker (or its tensor-parallel group of worker processes, meeting at a
        fresh port) as our children (tests, offline use)."""
        from metrale.ipc import worker_group

        device = cls(geometry, num_ranks=tensor_parallel_size, **device_kwargs)
        try:
            argv = [sys.executable, "-m", WORKER_MODULE, "--ring", device.ring_name]
            if factory is not None:
                argv += ["--factory", factory]
            if runner_kwargs:
                argv += ["--runner-kwargs", msgspec.json.encode(runner_kwargs).decode()]
            if worker_spin_us is not None:
                argv += ["--spin-us", str(worker_spin_us)]
            full_env = None if env is None else {**os.environ, **env}

            def group(generation: int) -> list[tuple[list[str], dict[str, str] | None]]:
                """One command line per rank, meeting at a port fresh for this start."""
                if tensor_parallel_size == 1:
                    return [(argv, full_env)]
                specs = worker_group.group_specs(tensor_parallel_size, generation=generation, all_reduce=all_reduce)
                return [([*argv, "--group", worker_group.encode(spec)], full_env) for spec in specs]

            device._spawn_group = group
            device.respawn(ready_timeout_s)
            return device
        except BaseException:
            device.close()
            raise

    def respawn(self, ready_timeout_s: float = 600.0) -> ModelInfo:
        """Start a fresh worker (group) on the same ring (killing the old one if it lives); spawned devices only."""
        if self._spawn_group is None:
            raise RuntimeError("respawn() is for devices made by WorkerDevice.spawn; the supervisor restarts workers")
        self._stop_children(grace_s=0.0)
        self._generation += 1
        self._procs = [subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
                       for argv, env in self._spawn_group(self._generation)]
        return self.wait_ready(ready_timeout_s, pids=[p.pid for p in self._procs])

    def wait_ready(self, timeout_s: float = 600.0, pid: int | None = None, pids: list[int] | None = None) -> ModelInfo:
        """Wait for a (re)started worker (every rank of a group) to attach and say ready; steps launched before
        are abandoned.

        pid / pids: the worker's (the ranks') pids when the caller knows them, so that a death is an error at
        once (and a stale connection from an earlier worker is skipped). DeviceError on timeout, or when a
        worker reports that its runner failed to build."""
        deadline = time.monotonic() + timeout_s
        expected = pids if pids is not None else ([pid] if pid is not None else None)
        self._detach()
        ready: dict[int, tuple[Bell, WorkerReady]] = {}
        try:
            while len(ready) < self.num_ranks or not self._still_connected(ready):
                self._raise_if_dead_before_ready(expected)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeviceError(f"{self.num_ranks - len(ready)} of {self.num_ranks} worker ranks did not attach "
                                      f"to {self._ring.name} within {timeout_s:.1f} s")
                bell = self._listener.accept(min(left, 0.05))
                if bell is None:
                    continue
                try:
                    message = self._receive_ready(bell, deadline, expected)
                except OSError:
                    message = None  # it went away while attaching: wait for the next one
                except BaseException:
                    bell.close()
                    raise
                if message is None or (expected is not None and message.pid not in expected) \
                        or not 0 <= message.rank < self.num_ranks:
                    bell.close()
                    continue
                old = ready.pop(message.rank, None)
                if old is not None:  # a rank of an earlier group that died while this one formed
                    old[0].close()
                ready[message.rank] = (bell, message)
            for rank in range(self.num_ranks):
                ready[rank][0].send(Attached(first_seq=self._next_seq))
        except BaseException:
            for bell, _ in ready.values():
                bell.close()
            raise
        self._bells = [ready[r][0] for r in range(self.num_ranks)]
        self._pids = [ready[r][1].pid for r in range(self.num_ranks)]
        self._bell, self._pid, self._info, self._gone = self._bells[0], self._pids[0], ready[0][1].info, None
        self.fault_began_ns = None
        self._first_seq = self._next_seq
        self._inflight = [0] * self._ring.num_slots
        self.hang.reset()
        self._progress_ns = time.monotonic_ns()
        for slot, path in list(self._loras.items()):  # what the worker before it loaded at run time
            self.load_lora(slot, path)
        return self._info

    @staticmethod
    def _still_connected(ready: dict) -> bool:
        """Drop ranks whose connection closed while the rest of the group came; True when none did."""
        gone = []
        for rank, (bell, _) in ready.items():
            bell.wait(0)
            if bell.peer_gone:
                gone.append(rank)
        for rank in gone:
            ready.pop(rank)[0].close()
        return not gone

    # ---- the Device protocol -----------------------------------------------------------------

    @property
    def burst_limit(self) -> int:
        """The most decode steps one ticket may ask for (the ring's max_burst)."""
        return self._ring.geometry.max_burst

    def launch(self, plan: StepPlan, kind: StepKind = StepKind.STEP, steps: int = 1) -> Ticket:
        """Write the plan and its kind into the next slot, publish it and ring the worker; ValueError if it does
        not fit.

        A BURST of `steps` and a VERIFY are awaited with await_burst. RuntimeError if the slot is still in flight (await a
        ticket first). With no worker attached the ticket is still made, and awaiting it raises DeviceError."""
        if self._closed:
            raise DeviceError("the device is closed")
        # every rank reads the plan
        return self._publish(lambda slot: self._ring.write_plan(slot, plan, kind, steps),
                             work=StepWork.of_plan(plan, kind, steps), every_rank=True)

    def await_result(self, ticket: Ticket) -> StepResult:
        """Wait for a launched step. The result's arrays are copies (they stay valid for good).

        DeviceError if the step failed (the worker's message); DeviceLost if the worker died, was
        replaced, or hung (it is then killed)."""
        return self._collect(ticket, lambda slot: self._ring.read_result(slot, copy=True))

    def await_burst(self, ticket: Ticket) -> list[StepResult]:
        """Wait for a BURST (ModelRunner.execute_burst in the worker) or a VERIFY ticket: one result per step,
        copies; DeviceError as await_result."""
        return self._collect(ticket, self._ring.read_results)

    def _collect(self, ticket: Ticket, read):
        """Wait for a launched ticket and return read(slot); the slot is free again afterwards."""
        slot, seq = ticket.slot, ticket.seq
        if self._closed:
            raise DeviceError("the device is closed")
        if self._inflight[slot] != seq:
            if seq < self._first_seq:
                raise DeviceLost(f"step {seq} was abandoned: the worker was restarted")
            raise ValueError(f"{ticket} is not in flight")
        try:
            self._wait_result(slot, seq)
            error = self._ring.result_error(slot)
            if error is not None:
                raise DeviceError(f"step {seq} failed in the worker: {error}")
            return read(slot)
        finally:
            self._inflight[slot] = 0

    def resample(self, ticket: Ticket, plan: StepPlan) -> StepResult:
        """A settled ticket's step picked again by the worker's sampler from the logits it kept, under plan's
        sampling arrays (Device.resample): a RESAMPLE ticket, run in order after what is in flight, to rank 0
        alone. DeviceError when the worker no longer keeps them or the plan does not fit."""
        if self._closed:
            raise DeviceError("the device is closed")
        try:
            resample = self._publish(lambda slot: self._ring.write_resample(slot, plan, ticket.seq))
        except ValueError as e:
            raise DeviceError(str(e)) from None
        return self._collect(resample, lambda slot: self._ring.read_result(slot, copy=True))

    def _publish(self, write, *, work: StepWork = NO_WORK, every_rank: bool = False) -> Ticket:
        """Launch the next ticket: write(slot) fills its slot (a plan, or a LoRA ticket's request; its
        ValueError leaves nothing launched), which is then published in order after what is in flight and rung
        to rank 0, or to every rank when each one acts on it."""
        seq = self._next_seq
        slot = seq % self._ring.num_slots
        if self._inflight[slot]:
            raise RuntimeError(f"all {self._ring.num_slots} ticket slots are in flight; await one first")
        write(slot)
        self._ring.publish_plan(slot, seq)
        for bell in self._bells if every_rank else self._bells[:1]:  # rank order: rank 0's first
            bell.ring()
        self._inflight[slot] = seq
        self._launched_ns[slot] = time.monotonic_ns()
        self._work[slot] = work
        self._next_seq = seq + 1
        return Ticket(slot, seq)

    def load_lora(self, slot: int, path: str) -> None:
        """A LoRA ticket, run in order after what is in flight: the worker loads the adapter at path into slot (""
        empties it); DeviceError with the worker's reason when it cannot. Remembered for the workers after it."""
        if self._closed:
            raise DeviceError("the device is closed")
        try:
            ticket = self._publish(lambda ring_slot: self._ring.write_lora_request(ring_slot, slot, path),
                                   every_rank=True)  # every rank loads its shard
        except ValueError as e:
            raise DeviceError(str(e)) from None
        self._collect(ticket, lambda _: None)
        if path:
            self._loras[slot] = path
        else:
            self._loras.pop(slot, None)

    def model(self) -> ModelInfo:
        """The worker's ModelInfo (from its ready message)."""
        if self._info is None:
            raise DeviceError("no worker has attached yet")
        return self._info

    def close(self) -> None:
        """Tell the worker to exit, stop it if we started it, remove the ring and doorbell. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for bell in self._bells:
                if not bell.peer_gone:
                    try:
                        bell.send(Shutdown(), timeout_s=1.0)
                    except OSError:
                        pass  # the worker is gone already
            self._stop_children(grace_s=5.0)
        finally:
            self._detach()
            self._listener.close()
            self._ring.close()

    def __enter__(self) -> WorkerDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- facts --------------------------------------------------------------------------

    @property
    def ring_name(self) -> str:
        """The shared-memory segment a worker attaches to (`--ring`)."""
        return self._ring.name

    @property
    def bell_path(self) -> str:
        """The doorbell socket the worker connects to (derived from the ring name)."""
        return self._listener.path

    def lost_while_idle(self) -> str | None:
        """Why the attached worker is gone (None while it lives), for a caller with nothing in flight: a death
        between steps is then noticed now (and its cost measured from now), not at the next launch."""
        if self._bell is None or self._pid is None:
            return None
        self._bell.wait(0)  # takes in the end-of-file a dead worker's socket left (and any stale dings)
        self._pid_checked_ns = 0  # read the process table now
        return self._why_gone(time.monotonic_ns())

    @property
    def pid(self) -> int | None:
        """The attached worker's pid (rank 0's; None before wait_ready)."""
        return self._pid

    @property
    def pids(self) -> list[int]:
        """Every attached rank's pid, in rank order."""
        return list(self._pids)

    @property
    def process(self) -> subprocess.Popen | None:
        """The worker process (rank 0's) when this device spawned it."""
        return self._procs[0] if self._procs else None

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Every spawned rank's process, in rank order."""
        return list(self._procs)

    def worker_stats(self) -> WorkerStats:
        """The worker's counters: idle (waiting for plans) vs busy time, steps served."""
        return self._ring.worker_stats()

    # ---- internals --------------------------------------------------------------------------

    def _wait_result(self, slot: int, seq: int) -> None:
        """Return once result seq is published in slot; DeviceError if the worker dies or times out."""
        ring = self._ring
        # The worker runs tickets in order: this one started no earlier than its launch and the last result.
        started = max(self._launched_ns[slot], self._progress_ns)
        if ring.result_seq(slot) == seq:
            self._progressed(slot, started)
            return
        start = time.monotonic_ns()
        # Spin only when nothing is queued behind this step: then the wake-up's latency would idle the
        # worker. With a later step launched (the pipelined lane), the worker goes straight on to it,
        # and the spin would only take a core from it.
        if seq + 1 == self._next_seq and ring.spin_for_result(slot, seq, start + self._spin_ns):
            self._progressed(slot, started)
            return
        deadline = self.deadline_ns(slot, started)
        bell = self._bell
        while ring.result_seq(slot) != seq:
            if seq < self._first_seq:
                raise DeviceLost(f"step {seq} was abandoned: the worker was restarted")
            now = time.monotonic_ns()
            gone = self._why_gone(now)
            if gone is not None:
                if ring.result_seq(slot) == seq:
                    return  # published just before the worker went
                raise DeviceLost(f"step {seq} lost: {gone}")
            if now > deadline:
                self.fault_began_ns = started
                raise DeviceLost(f"step {seq} lost: {self._kill_hung(now - started, deadline - started, slot)}")
            bell.wait(self._slice_s)
        self._progressed(slot, started)

    def _progressed(self, slot: int, started: int) -> None:
        """A result came: the worker progresses; its step time feeds the hang deadline."""
        now = time.monotonic_ns()
        self.hang.record(now - started, self._work[slot])
        self._progress_ns = now

    def deadline_ns(self, slot: int, started_ns: int) -> int:
        """When the ticket in slot, which the worker started no earlier than started_ns, counts as hung: the
        hang timeout plus a margin on the time its work (prefill tokens, decode positions) is expected to take."""
        return started_ns + self.hang.limit_ns(self._work[slot])

    def _kill_hung(self, stalled_ns: int, allowed_ns: int, slot: int) -> str:
        """SIGKILL a worker (every rank of its group) that made no progress for stalled_ns; returns why (it is
        then gone, like a dead one)."""
        who = f"pid {self._pid}" if len(self._pids) == 1 else f"pids {', '.join(map(str, self._pids))}"
        work, expected = self._work[slot], self.hang.expected_s(self._work[slot])
        step = (f"a step of {work.prefill_tokens} prefill tokens and {work.decode_positions} decode positions"
                + (f", expected to take {expected:.3f} s" if expected is not None else ", during warm-up"))
        why = (f"the worker process ({who}) made no progress for {stalled_ns / 1e9:.1f} s "
               f"({step}; allowed {allowed_ns / 1e9:.1f} s); it was killed as hung")
        for pid in self._pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._gone = why
        if self.on_hang is not None:
            self.on_hang(why)
        return why

    def _why_gone(self, now_ns: int) -> str | None:
        """Why the worker (some rank of its group) can no longer answer (None while all live); remembered once known.

        The doorbell's end-of-file tells a death at once (the kernel closes a killed process's socket);
        the process table is read as well, at most every PID_CHECK_NS (it costs a /proc read per step
        otherwise), for a worker whose socket outlives it in a child of its own.
        """
        if self._gone is None:
            check_pid = now_ns - self._pid_checked_ns >= PID_CHECK_NS
            for rank, (bell, pid) in enumerate(zip(self._bells, self._pids)):
                if rank > 0:
                    bell.wait(0)  # take in a rank's end-of-file (rank 0's bell is the one being waited on)
                name = "the worker process" if self.num_ranks == 1 else f"worker rank {rank}"
                if bell.peer_gone:
                    self._gone = f"{name} (pid {pid}) closed its doorbell"
                elif check_pid and not self._alive(pid):
                    self._gone = f"{name} (pid {pid}) died"
                if self._gone is not None:
                    break
            if check_pid:
                self._pid_checked_ns = now_ns
            if self._gone is not None and self.fault_began_ns is None:
                self.fault_began_ns = now_ns
            if self._gone is not None and self._procs:
                code = self._reap(timeout_s=0.05)
                if code is not None:
                    self._gone += f" (exit code {code})"
        return self._gone

    def _alive(self, pid: int) -> bool:
        """Whether a worker pid runs (our own child is checked through its Popen, a zombie is dead)."""
        for proc in self._procs:
            if proc.pid == pid:
                return proc.poll() is None
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True

    def _raise_if_dead_before_ready(self, pids: list[int] | None) -> None:
        """DeviceError if a worker we are waiting for already died."""
        for pid in pids or ():
            if not self._alive(pid):
                proc = next((p for p in self._procs if p.pid == pid), None)
                code = proc.poll() if proc is not None else None
                raise DeviceError(f"the worker process (pid {pid}) exited before it was ready (exit code {code})")

    def _receive_ready(self, bell: Bell, deadline: float, pids: list[int] | None) -> WorkerReady | None:
        """The WorkerReady a connected worker sends once its runner is built; None if it left first."""
        while True:
            message = bell.receive(min(max(deadline - time.monotonic(), 0.0), 0.05))
            if isinstance(message, WorkerReady):
                return message
            if isinstance(message, WorkerFailed):
                raise DeviceError(f"the worker (pid {message.pid}) failed to start: {message.message}")
            if bell.peer_gone:
                return None
            self._raise_if_dead_before_ready(pids)
            if time.monotonic() > deadline:
                raise DeviceError(f"a worker connected to {self._ring.name} but was not ready in time")

    def _detach(self) -> None:
        """Forget the current worker (group): its steps in flight are abandoned."""
        for bell in self._bells:
            bell.close()
        self._bells, self._bell = [], None
        self._gone = "the worker was detached"
        self._first_seq = self._next_seq
        self._inflight = [0] * self._ring.num_slots

    def _stop_children(self, grace_s: float) -> None:
        """Wait up to grace_s for our spawned worker(s) to exit, then kill them; reap them."""
        if not self._procs:
            return
        if self._reap(grace_s) is None or any(p.poll() is None for p in self._procs):
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
            self._reap(5.0)

    def _reap(self, timeout_s: float) -> int | None:
        """Once every spawned rank exits within timeout_s: the first non-zero exit code (else 0); else None."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc in self._procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                return None
        return next((c for c in codes if c), 0)
