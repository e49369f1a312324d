"""ReplicaSet: the engine cores behind one frontend (data-parallel replicas), their state, routing and summed stats.

Each replica is an engine core (with its worker group) reached through its own EngineLink. A replica is up from
its EngineReady until its engine core disconnects; it is routable while up and not waiting for a new worker
(WorkerLost .. WorkerBack). The Router (router.py) picks among the routable ones. Stats are asked of every up
replica and summed (each replica's own counters kept in `EngineStats.replicas`); with one replica they are its
own, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import zmq.asyncio

from metrale.ipc.messages import EngineLoad, EngineStats

from .engine_link import EngineLink
from .router import Router

_SUMMED = [f.name for f in msgspec.structs.fields(EngineStats) if f.type in (int, float)]  # every count and time


class ReplicaSet:
    """One EngineLink per replica, which are up and routable, and the router between them."""

    def __init__(self, count: int, frontend: int = 0) -> None:
        """count replicas, none up yet, reached by frontend `frontend` (of --api-server-count)."""
        self.links = [EngineLink(k, frontend) for k in range(count)]
        self.router = Router(count)
        self.paused = [False] * count  # its worker died: it holds its requests until WorkerBack

    def __len__(self) -> int:
        return len(self.links)

    @property
    def any_up(self) -> bool:
        """Some engine core is up (requests can be submitted)."""
        return any(link.up for link in self.links)

    @property
    def all_up(self) -> bool:
        return all(link.up for link in self.links)

    def open(self, ctx: zmq.asyncio.Context, addresses: list[tuple[str, str]]) -> None:
        """Bind every replica's two sockets (addresses: (input, output) per replica)."""
        for link, (inp, out) in zip(self.links, addresses):
            link.open(ctx, inp, out)

    def close(self) -> None:
        for link in self.links:
            link.close()

    def cancel_retry(self) -> None:
        for link in self.links:
            link.cancel_retry()

    # ---- state -----------------------------------------------------------------------

    def set_up(self, k: int, up: bool) -> None:
        """Replica k's engine core came up (a fresh one: its cache is empty) or went away."""
        link = self.links[k]
        link.up = up
        self.paused[k] = False
        if not up:
            link.drop_outbox()
        self.router.forget_replica(k)
        self._update(k)

    def set_paused(self, k: int, paused: bool) -> None:
        """Replica k lost its worker (paused) or has a new one."""
        self.paused[k] = paused
        if paused:
            self.router.forget_replica(k)  # the new worker's cache starts empty
        self._update(k)

    def _update(self, k: int) -> None:
        self.router.reachable[k] = self.links[k].up
        self.router.routable[k] = self.links[k].up and not self.paused[k]

    def note_load(self, k: int, load: EngineLoad) -> None:
        """Replica k's own account of how busy it is (its KV use steers routing)."""
        self.router.kv_use[k] = load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0

    def has_other(self, k: int) -> bool:
        """Whether a replica other than k can take requests now."""
        return any(self.router.routable[j] for j in range(len(self.links)) if j != k)

    # ---- stats -------------------------------------------------------------------------

    def ask_stats(self, answer: Callable[[EngineStats], None], fail: Callable[[str], None], timeout_s: float) -> list[tuple[EngineLink, str]]:
        """Ask every up replica for its counters; answer(their sum) once all replied, fail(why) if one did not.

        Returns the (link, internal id) of each question (for forget_stats)."""
        links = [link for link in self.links if link.up]
        parts: dict[int, EngineStats] = {}
        done = []

        def one_answered(k: int, stats: EngineStats) -> None:
            parts[k] = stats
            if len(parts) == len(links) and not done:
                done.append(True)
                answer(sum_stats([parts.get(j) for j in range(len(self.links))]))

        def one_failed(why: str) -> None:
            if not done:
                done.append(True)
                fail(why)

        return [(link, link.ask_stats(lambda s, k=link.index: one_answered(k, s), one_failed, timeout_s)) for link in links]

    @staticmethod
    def forget_stats(asked: list[tuple[EngineLink, str]]) -> None:
        for link, internal in asked:
            link.forget_stats(internal)


def sum_stats(parts: list[EngineStats | None]) -> EngineStats:
    """The replicas' counters summed (a replica that is down counts as zeros); one replica's are its own."""
    if len(parts) == 1 and parts[0] is not None:
        return parts[0]
    each = [p if p is not None else EngineStats() for p in parts]
    total = EngineStats(**{name: sum(getattr(p, name) for p in each) for name in _SUMMED})
    total.prefix_cache_hit_rate = (total.prefix_cache_hit_tokens / total.prefix_cache_queried_tokens
                                   if total.prefix_cache_queried_tokens else 0.0)
    total.kernels = next((p.kernels for p in each if p.kernels), "")
    total.replicas = each
    return total
