"""What each node of a `metrale serve` runs, from the tensor-parallel, data-parallel and node counts.

One node: everything. Several (`--nnodes N`), two layouts, both with the frontend on node 0:

- data parallel across the nodes (`--data-parallel-size` a multiple of N): node n runs replicas
  n * dp/N .. (n + 1) * dp/N - 1, each an engine core with its own tensor-parallel group on that node. The frontend
  reaches a replica on another node over TCP: its engine core connects to master_port + 1 + 2k (input) and
  master_port + 2 + 2k (output) on the master address.
- tensor parallel across the nodes (one replica, `--tensor-parallel-size` a multiple of N): node n runs ranks
  n * tp/N .. (n + 1) * tp/N - 1 of the one group; node 0 also runs its engine core. The ranks on node 0 read the
  ring; the others get each plan from rank 0 over the process group.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from metrale.config import ServeConfig
from metrale.ipc import worker_group
from metrale.ipc.worker_group import GroupSpec

WORKER_MODULE = "metrale.gpu_worker.worker"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """This node's share of the server."""

    nnodes: int
    node_rank: int
    replicas: tuple[int, ...]  # the data-parallel replicas whose processes run here
    ranks: tuple[int, ...]  # the tensor-parallel ranks of each of those groups that run here
    tensor_parallel_size: int
    spans_nodes: bool  # one tensor-parallel group over every node

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def ring_ranks(self) -> int:
        """Ranks of a group on its engine core's host (they read its ring)."""
        return len(self.ranks) if self.spans_nodes else self.tensor_parallel_size


def layout(config: ServeConfig) -> NodeLayout:
    """This node's layout; ValueError for counts that do not split over the nodes."""
    n, node = config.nnodes, config.node_rank
    tp, dp = config.engine.tensor_parallel_size, config.engine.data_parallel_size
    if n < 1 or not 0 <= node < n:
        raise ValueError(f"--node-rank {node} is not one of --nnodes {n}")
    if n == 1:
        return NodeLayout(1, 0, tuple(range(dp)), tuple(range(tp)), tp, False)
    if dp % n == 0:
        per = dp // n
        return NodeLayout(n, node, tuple(range(node * per, (node + 1) * per)), tuple(range(tp)), tp, False)
    if dp == 1 and tp % n == 0:
        per = tp // n
        return NodeLayout(n, node, (0,) if node == 0 else (), tuple(range(node * per, (node + 1) * per)), tp, True)
    raise ValueError(f"{n} nodes need --data-parallel-size a multiple of {n}, or one replica whose "
                     f"--tensor-parallel-size is a multiple of {n} (got data parallel {dp}, tensor parallel {tp})")


def replica_addresses(config: ServeConfig, k: int) -> tuple[str, str]:
    """The TCP (input, output) addresses of replica k's engine core, for a replica on another node than the frontend."""
    base = config.master_port + 1 + 2 * k
    return f"tcp://{config.master_addr}:{base}", f"tcp://{config.master_addr}:{base + 1}"


def node_of_replica(config: ServeConfig, k: int) -> int:
    """The node that runs replica k."""
    if config.nnodes == 1 or config.engine.data_parallel_size % config.nnodes:
        return 0
    return k // (config.engine.data_parallel_size // config.nnodes)


def worker_argvs(config: ServeConfig, lay: NodeLayout, model_dir: str, ring: str | None, generation: int) -> list[list[str]]:
    """The command lines of this node's worker ranks of one group, for its generation-th start.

    ring: the engine core's ticket ring they serve (None: ranks off the engine core's host, which get their plans
    from rank 0). One host: rank 0 hosts the rendezvous at a port fresh for this start. A group spanning the nodes
    meets at node 0's store under the generation's key prefix, and sums over gloo (shared memory is one host's)."""
    e = config.engine
    argv = [sys.executable, "-m", WORKER_MODULE, "--runner-kwargs", json.dumps(e.runner_kwargs(model_dir))]
    if ring is not None:
        argv += ["--ring", ring]
    timeout_s = max(600.0, 3 * config.worker_hang_timeout_s)
    if e.tensor_parallel_size == 1:
        return [argv]
    if not lay.spans_nodes:
        specs = worker_group.group_specs(e.tensor_parallel_size, generation=generation, all_reduce=e.all_reduce,
                                         timeout_s=timeout_s)
    else:
        all_reduce = "gloo" if e.all_reduce == "auto" else e.all_reduce
        specs = [GroupSpec(rank=r, size=lay.tensor_parallel_size, ring_ranks=lay.tensor_parallel_size // lay.nnodes,
                           store_host=config.master_addr, store_port=config.master_port, rank0_hosts_store=False,
                           generation=generation, all_reduce=all_reduce, timeout_s=timeout_s, local_rank=r - lay.ranks[0])
                 for r in lay.ranks]
    return [[*argv, "--group", worker_group.encode(spec)] for spec in specs]
