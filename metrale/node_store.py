"""How the supervisors of a multi-node `metrale serve` agree: a torch.distributed TCP store on node 0.

Node 0's supervisor hosts it at --master-addr:--master-port for the server's whole life (the other nodes'
supervisors and every worker rank connect to it as clients), so it outlives any worker group:

- `metrale/generation`: node 0 writes the generation of each start of a group spanning the nodes; every rank of
  that start meets under the generation's own key prefix (ipc/worker_group.py), and the other nodes start their
  ranks of it when it appears (and stop the ranks of an earlier one).
- `metrale/lost/<g>`: a node whose rank of generation g died says so; node 0 then restarts the whole group at
  once, even when no step is in flight to notice.
- `metrale/shutdown`: node 0 is stopping; the other nodes stop too.

Only TCP is needed between the hosts: the store, gloo's own connections for the collectives and rank 0's plan
broadcast (gpu_worker/plan_broadcast.py), and the frontend's ZMQ sockets for replicas on other nodes.
"""

from __future__ import annotations

import datetime

_GENERATION = "metrale/generation"
_SHUTDOWN = "metrale/shutdown"


class NodeStoreLost(RuntimeError):
    """Node 0's store cannot be reached: node 0 is gone, and the server with it."""


class NodeStore:
    """A supervisor's end of the store (node 0 hosts it)."""

    def __init__(self, host: str, port: int, *, hosting: bool, timeout_s: float = 600.0):
        """Host the store (node 0) or connect to it, waiting up to timeout_s for node 0."""
        import torch.distributed as dist  # only a multi-node supervisor needs torch

        self._store = dist.TCPStore(host, port, is_master=hosting, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))

    def _do(self, op, *args):
        """One store operation; NodeStoreLost when node 0's store is gone."""
        try:
            return op(*args)
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds for a closed connection
            raise NodeStoreLost(f"node 0's store is gone: {exc}") from exc

    def publish_generation(self, generation: int) -> None:
        """Node 0: a group of this generation is starting."""
        self._do(self._store.set, _GENERATION, str(generation))

    def generation(self) -> int:
        """The generation node 0 last started (0: none yet)."""
        if not self._do(self._store.check, [_GENERATION]):
            return 0
        return int(self._do(self._store.get, _GENERATION))

    def report_lost(self, generation: int) -> None:
        """A rank of this generation died on this node."""
        self._do(self._store.set, f"metrale/lost/{generation}", "1")

    def lost(self, generation: int) -> bool:
        """Whether some node reported a rank of this generation dead."""
        return self._do(self._store.check, [f"metrale/lost/{generation}"])

    def announce_shutdown(self) -> None:
        """Node 0 is stopping: the other nodes stop too."""
        self._do(self._store.set, _SHUTDOWN, "1")

    def shutting_down(self) -> bool:
        return self._do(self._store.check, [_SHUTDOWN])
