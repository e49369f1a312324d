"""Joining a tensor-parallel group: the rendezvous, the process groups and the collectives one worker rank runs with.

`join_group(spec, device)` meets the other ranks through a torch.distributed TCP store (ipc/worker_group.py says
who hosts it and under which keys), initialises the default process group (NCCL on CUDA, else gloo) and picks
the collectives: NCCL or gloo as they are, or on the ranks of one CPU host the shared-memory all-reduce
(`all_reduce` auto or shm). When some ranks run on other hosts it also makes the gloo group over which rank 0
sends them each plan (gpu_worker/plan_broadcast.py). A group lives as long as its processes: a restart is a
fresh set of processes meeting at a fresh rendezvous, so no process group is ever reused after a failure.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from metrale.ipc.worker_group import GroupSpec

from .layers.collectives import ShmCollectives, TorchCollectives
from .layers.parallel import ParallelGroup
from .layers.shm_allreduce import ShmAllReduce, offered

log = logging.getLogger("metrale.gpu_worker")


@dataclass(slots=True)
class JoinedGroup:
    """This rank's membership: its ParallelGroup for the layers, and what it must close."""

    spec: GroupSpec
    group: ParallelGroup
    backend: str  # "gloo" or "nccl"
    all_reduce: str  # "shm", "gloo" or "nccl": what sums a decode step's tensors
    plan_pg: dist.ProcessGroup | None  # rank 0 and the ranks off its host (None: every rank reads the ring)
    shm: ShmAllReduce | None = None

    def close(self) -> None:
        """Unmap the shared memory and destroy the process groups (idempotent). The collectives drop their
        process group first, so gloo's threads are joined here and not in the interpreter's teardown, where
        a thread still running aborts the process."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.group.comm is not None:
            self.group.comm.release()
        self.plan_pg = None
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def join_group(spec: GroupSpec, device: torch.device) -> JoinedGroup:
    """Meet the group's other ranks and build this rank's collectives (blocks until every rank has come)."""
    spec.validate()
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    backend = spec.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore(spec.store_host, spec.store_port, world_size=spec.size,
                          is_master=spec.rank0_hosts_store and spec.rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store = dist.PrefixStore(spec.key_prefix, store)
    dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.size, timeout=timeout)
    try:
        world = dist.group.WORLD
        # gloo beside NCCL for what travels on the host: the plan broadcast and the setup below.
        cpu_pg = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        plan_pg = None
        if spec.ring_ranks < spec.size:  # every rank calls new_group, members or not
            plan_pg = dist.new_group([0, *range(spec.ring_ranks, spec.size)], backend="gloo", timeout=timeout)
        one_host = spec.ring_ranks == spec.size
        if spec.all_reduce == "shm" and not (one_host and device.type == "cpu" and offered()):
            raise ValueError("the shared-memory all-reduce needs every rank on one x86-64 CPU host")
        use_shm = spec.all_reduce in ("auto", "shm") and one_host and device.type == "cpu" and offered()
        if use_shm:
            shm = _share_segment(spec, store, cpu_pg)
            comm = ShmCollectives(world, spec.size, shm)
            joined = JoinedGroup(spec, ParallelGroup(spec.rank, spec.size, comm), backend, "shm", plan_pg, shm)
        else:
            comm = TorchCollectives(world, spec.size, device)
            joined = JoinedGroup(spec, ParallelGroup(spec.rank, spec.size, comm), backend, backend, plan_pg)
    except BaseException:
        dist.destroy_process_group()
        raise
    log.info("rank %d of %d joined (generation %d, %s, sums by %s)", spec.rank, spec.size, spec.generation,
             backend, joined.all_reduce)
    return joined


def _share_segment(spec: GroupSpec, store: dist.Store, cpu_pg: dist.ProcessGroup) -> ShmAllReduce:
    """Rank 0 creates the all-reduce segment and names it in the store; the others map it; once all have,
    its name is removed (nothing can be left in /dev/shm). Every rank learns the others' pids (a dead peer
    ends a wait)."""
    store.set(f"pid{spec.rank}", str(os.getpid()))
    if spec.rank == 0:
        shm = ShmAllReduce.create(spec.size, timeout_s=spec.timeout_s)
        store.set("shm_allreduce", shm.name)
    else:
        shm = ShmAllReduce.attach(store.get("shm_allreduce").decode(), spec.rank, spec.size, timeout_s=spec.timeout_s)
    try:
        dist.barrier(group=cpu_pg)
        shm.unlink()
        shm.peer_pids = [int(store.get(f"pid{r}")) for r in range(spec.size) if r != spec.rank]
    except BaseException:
        shm.close()
        raise
    return shm
