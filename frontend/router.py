"""Router: which data-parallel replica a request goes to, by load and by prefix affinity.

Load is what the frontend knows exactly, at once: the requests it has submitted to each replica and not yet
seen end (the replica's running + waiting, plus what is on its way to it); the KV use each replica last reported
(EngineOutputs.load) keeps requests off a replica whose cache is nearly full. Affinity: a request whose prompt shares its first blocks with an earlier one goes
where that one went, since its prefix is cached there. The first AFFINITY_BLOCKS full blocks of a prompt are
hashed in a chain (BLAKE2b of the salt, then of each block on top of the last digest, as the engine core keys its
prefix cache), each digest remembered with the replica it went to (an LRU of TABLE_SIZE), and the longest known
one decides. Affinity yields to balance as SGLang's cache-aware router does: when the affine replica holds more
than IMBALANCE_ABS requests over the least loaded one and more than IMBALANCE_REL times its load, or its KV
cache is nearly full, the least loaded one takes the request (and the prefix then lives there too). Ties
between equally loaded replicas rotate, so that distinct prefixes spread.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

AFFINITY_BLOCKS = 4
TABLE_SIZE = 1 << 16
IMBALANCE_ABS = 8
IMBALANCE_REL = 1.5
KV_NEARLY_FULL = 0.9


class Router:
    """Per-replica load and routability, and the prefix table."""

    def __init__(self, num_replicas: int, block_size: int = 16) -> None:
        """All replicas start unroutable (none has said it is ready)."""
        self.n = num_replicas
        self.block_size = block_size
        self.live = [0] * num_replicas  # requests submitted there and not ended
        self.kv_use = [0.0] * num_replicas  # KV blocks used / total, as last reported
        self.routable = [False] * num_replicas  # up, with a worker
        self.reachable = [False] * num_replicas  # up (a replica waiting for its new worker queues what it gets)
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0  # where a tie goes first (rotates)
        self.affinity_hits = 0  # requests sent where their prefix went before (a metric)

    def choose(self, prompt_ids: list[int], salt: str | None = None, exclude: int | None = None) -> int | None:
        """The replica for a prompt (None when none is up); remembered as where its prefix now lives. With every
        replica waiting for a new worker, one of them queues it."""
        candidates = [k for k in range(self.n) if self.routable[k] and k != exclude]
        if not candidates:
            candidates = [k for k in range(self.n) if self.reachable[k] and k != exclude]
        if not candidates:
            return None
        # KV use only sets nearly full replicas apart: a replica's last report may predate the blocks it freed
        # since (an idle engine core reports nothing), while the frontend's own counts are always current.
        least = min(candidates, key=lambda k: (self.kv_use[k] >= KV_NEARLY_FULL, self.live[k], (k - self._next) % self.n))
        keys = self.prefix_keys(prompt_ids, salt)
        chosen = least
        for key in reversed(keys):  # the longest prefix seen before decides
            k = self._prefixes.get(key)
            if k is None:
                continue
            if k in candidates and not self._imbalanced(k, least):
                chosen = k
                self.affinity_hits += 1
            break
        if chosen == least:
            self._next = (chosen + 1) % self.n
        for key in keys:
            self._prefixes[key] = chosen
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > TABLE_SIZE:
            self._prefixes.popitem(last=False)
        return chosen

    def _imbalanced(self, k: int, least: int) -> bool:
        """Whether replica k is too busy next to the least loaded one to take a request for its cache."""
        if self.kv_use[k] >= KV_NEARLY_FULL:
            return True
        over = self.live[k] - self.live[least]
        return over > IMBALANCE_ABS and self.live[k] > IMBALANCE_REL * self.live[least]

    def prefix_keys(self, prompt_ids: list[int], salt: str | None) -> list[bytes]:
        """The chained digests of the prompt's first full blocks (none for a prompt shorter than one block)."""
        full = min(len(prompt_ids) // self.block_size, AFFINITY_BLOCKS)
        if full == 0:
            return []
        tokens = np.asarray(prompt_ids[: full * self.block_size], dtype=np.int32).tobytes()
        step = self.block_size * 4
        h = hashlib.blake2b((salt or "").encode(), digest_size=16)
        keys = []
        for b in range(full):
            h.update(tokens[b * step : (b + 1) * step])
            keys.append(h.copy().digest())
        return keys

    def forget_replica(self, k: int) -> None:
        """A replica lost its cache (its engine core or worker restarted): its prefixes are cached nowhere now."""
        for key in [key for key, where in self._prefixes.items() if where == k]:
            del self._prefixes[key]
