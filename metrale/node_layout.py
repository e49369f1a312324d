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

from dataclasses import dataclass

from metrale.config import ServeConfig


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
