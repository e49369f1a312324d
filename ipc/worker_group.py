"""A tensor-parallel worker group as its launchers describe it: which rank a worker is, and where its group meets.

N worker ranks form one device for the engine core. The ranks on the engine core's host ("ring ranks",
0 .. ring_ranks - 1) read the ticket ring themselves; ranks on other hosts get each plan from rank 0 over
the process group (gpu_worker/plan_broadcast.py). Rank 0 alone writes results. Every start of a group (a
"generation") meets afresh: on one host, rank 0 hosts a torch.distributed TCP store on a port chosen for
that start; across hosts, node 0's supervisor hosts a long-lived store at --master-addr:--master-port and
each generation meets under its own key prefix, so a restarted group never sees a dead one's keys.

The supervisor, WorkerDevice.spawn and the worker share this struct (JSON on the worker's command line);
nothing here imports torch.
"""

from __future__ import annotations

import socket

import msgspec

from metrale.settings import ALL_REDUCE_CHOICES, DEFAULTS

MAX_RING_RANKS = 32  # per-rank worker counters in the ring header (tickets.py)
KEEPALIVE_S = 10.0  # an idle rank 0 tells off-host ranks it lives this often (plan_broadcast.py)


class GroupSpec(msgspec.Struct, kw_only=True):
    """One worker's place in its tensor-parallel group and how the group meets."""

    rank: int
    size: int
    ring_ranks: int  # ranks 0 .. ring_ranks - 1 run on the engine core's host and read its ring
    store_host: str = "127.0.0.1"
    store_port: int = 0
    rank0_hosts_store: bool = True  # False: a supervisor hosts it (multi-node), and keys carry the generation
    generation: int = 0
    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | gloo | nccl
    all_reduce: str = DEFAULTS.all_reduce  # on a CPU: auto | shm (one host only) | gloo
    timeout_s: float = 600.0  # torch.distributed's own timeout: a backstop, the supervisor acts first
    local_rank: int = 0  # the rank's index among its host's ranks (its CUDA device)

    def validate(self) -> None:
        """ValueError for a spec no group can form."""
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if not 1 <= self.ring_ranks <= min(self.size, MAX_RING_RANKS):
            raise ValueError(f"ring_ranks {self.ring_ranks} must be 1 .. {min(self.size, MAX_RING_RANKS)}")
        if self.all_reduce not in ALL_REDUCE_CHOICES:
            raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCE_CHOICES)} (got {self.all_reduce!r})")

    @property
    def reads_ring(self) -> bool:
        """Whether this rank runs beside the engine core and reads plans from its ring."""
        return self.rank < self.ring_ranks

    @property
    def key_prefix(self) -> str:
        """The store keys of this generation."""
        return f"metrale/g{self.generation}/"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now (a fresh rendezvous port for each group start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_specs(size: int, *, generation: int = 0, host: str = "127.0.0.1", port: int | None = None,
                backend: str = "auto", all_reduce: str = DEFAULTS.all_reduce, timeout_s: float = 600.0) -> list[GroupSpec]:
    """The specs of a group whose ranks all run on this host, meeting at a fresh port (rank 0 hosts the store)."""
    port = free_port(host) if port is None else port
    return [
        GroupSpec(rank=r, size=size, ring_ranks=size, store_host=host, store_port=port, generation=generation,
                  backend=backend, all_reduce=all_reduce, timeout_s=timeout_s, local_rank=r)
        for r in range(size)
    ]


def encode(spec: GroupSpec) -> str:
    """The spec as the worker's --group argument."""
    return msgspec.json.encode(spec).decode()


def decode(text: str) -> GroupSpec:
    """A --group argument back as a spec (checked)."""
    spec = msgspec.json.decode(text, type=GroupSpec)
    spec.validate()
    return spec
