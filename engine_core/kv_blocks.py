"""The KV block pool: fixed-size blocks, reference counts, and automatic prefix caching.

A block is in exactly one of three states: used (refcount > 0), cached (refcount 0 but holding a
full, settled block of tokens that a later request may reuse, evicted LRU) or free. The invariant
every test checks: free + used + cached == total.

A cached block is keyed by a 128-bit BLAKE2b digest of its parent's digest and its tokens, and a hit is
confirmed by comparing the stored parent and tokens: a digest collision (or a forged one) can never hand
one request another's KV. The chain starts from the request's cache salt, so requests with different
salts (tenants) never share a block.

Every sequence's block table is one row of `tables` (int32, grown when a row or a table outgrows it): the only
copy. The pool appends and trims it in place, and a plan gathers its rows from it (step_builder.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from .sequence import KvPlacement, Sequence

BlockHash = bytes


def block_hash(parent: BlockHash, tokens: bytes) -> BlockHash:
    """The digest of one full block: its parent's digest and its token ids (their int32 bytes: block_bytes)."""
    return hashlib.blake2b(parent + tokens, digest_size=16).digest()


def block_bytes(tokens: array) -> bytes:
    """A block's token ids as the digest and the collision check read them: a slice of Output.tokens (int32), as is."""
    return tokens.tobytes()


def chain_root(cache_salt: str | None, lora_key: int = -1) -> BlockHash:
    """Where a request's chain of block digests starts: empty, or a digest of its cache salt and its LoRA adapter
    (an adapter's KV is its own: the same tokens give other keys and values)."""
    if not cache_salt and lora_key < 0:
        return b""
    key = b"salt:" + (cache_salt or "").encode("utf-8") + (b"\0lora:%d" % lora_key if lora_key >= 0 else b"")
    return hashlib.blake2b(key, digest_size=16).digest()


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class KvBlockPool:
    """Hands out KV blocks to sequences and takes them back."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    refcount: list[int] = field(init=False)
    _free: deque[int] = field(init=False)
    _cached: OrderedDict[int, None] = field(init=False)  # refcount-0 hashed blocks, LRU first
    _hash_of: dict[int, BlockHash] = field(init=False)  # block -> digest of (parent digest, its tokens)
    _block_of: dict[BlockHash, int] = field(init=False)  # digest -> block
    _content: dict[int, tuple[BlockHash, bytes]] = field(init=False)  # block -> (parent, its tokens: block_bytes)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    tables: np.ndarray = field(init=False)  # [rows, blocks]: row KvPlacement.row is a sequence's block table
    _free_rows: list[int] = field(init=False)
    # Counts rows given to sequences and taken back: while it stands still, every sequence keeps its row (the plan
    # builder reuses a step's row indices then).
    row_moves: int = 0

    def __post_init__(self) -> None:
        self.refcount = [0] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        self._cached = OrderedDict()
        self._hash_of = {}
        self._block_of = {}
        self._content = {}
        self.tables = np.zeros((0, 16), np.int32)
        self._free_rows = []

    # ---- counts ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no content worth keeping."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix reuse (allocatable by eviction)."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take right now."""
        return len(self._free) + len(self._cached)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more blocks seq needs so its table covers num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - seq.kv.num_blocks)

    def blocks(self, seq: Sequence) -> list[int]:
        """seq's blocks, in order (a copy)."""
        kv = seq.kv
        return self.tables[kv.row, : kv.num_blocks].tolist() if kv.num_blocks else []


    # ---- allocation -----------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to cover num_tokens tokens. False (nothing taken) if the pool is dry."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_available:
            return False
        if need:
            self._append(seq.kv, [self._take() for _ in range(need)])
        return True

    def _append(self, kv: KvPlacement, blocks: list[int]) -> None:
        """Append blocks to kv's table, giving it a row first (the table grows when a row or a table outgrows it)."""
        if kv.row < 0:
            if not self._free_rows:
                rows = len(self.tables)
                self.tables = np.pad(self.tables, ((0, max(rows, 64)), (0, 0)))
                self._free_rows = list(range(len(self.tables) - 1, rows - 1, -1))
            kv.row = self._free_rows.pop()
            self.row_moves += 1
        n = kv.num_blocks + len(blocks)
        width = self.tables.shape[1]
        if n > width:
            self.tables = np.pad(self.tables, ((0, 0), (0, max(n, 2 * width) - width)))
        self.tables[kv.row, kv.num_blocks : n] = blocks
        kv.num_blocks = n

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of seq beyond those num_tokens tokens need (an over-run's reservation)."""
        kv = seq.kv
        keep = -(-num_tokens // self.block_size)
        assert keep >= kv.hashed_blocks, "trimming a settled block"
        if kv.num_blocks > keep:
            row = self.tables[kv.row]
            for block in row[keep : kv.num_blocks].tolist()[::-1]:
                self._release(block)
            row[keep : kv.num_blocks] = 0
            kv.num_blocks = keep

    def free(self, seq: Sequence) -> None:
        """Release every block of seq (tail first, so the shared head is evicted last) and its table's row; full
        settled blocks stay cached for reuse."""
        kv = seq.kv
        if kv.row >= 0:
            for block in self.tables[kv.row, : kv.num_blocks].tolist()[::-1]:
                self._release(block)
            self.tables[kv.row, : kv.num_blocks] = 0
            self._free_rows.append(kv.row)
            self.row_moves += 1
        kv.row, kv.num_blocks, kv.hashed_blocks, kv.prefix_hash = -1, 0, 0, b""

    def share(self, seq: Sequence, parent: Sequence, num_blocks: int) -> None:
        """Give seq (holding no blocks) parent's first num_blocks blocks by reference (a beam forked from its
        parent: full, settled blocks that neither writes again), with their prefix hashes."""
        kv, src = seq.kv, parent.kv
        assert not kv.num_blocks and num_blocks <= src.num_blocks
        if not num_blocks:
            return
        blocks = self.tables[src.row, :num_blocks].tolist()
        for block in blocks:
            self.refcount[block] += 1
        self._append(kv, blocks)
        kv.hashed_blocks = min(src.hashed_blocks, num_blocks)
        kv.prefix_hash = src.prefix_hash if kv.hashed_blocks == src.hashed_blocks else b""
        if kv.hashed_blocks < src.hashed_blocks:  # hashed past the shared blocks: hash them again on the way
            kv.hashed_blocks = 0

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            del self._content[block]
        self.refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        assert self.refcount[block] >= 0, f"block {block} released twice"
        if self.refcount[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    # ---- prefix caching -------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Give a fresh seq the cached blocks of its longest cached prefix; returns the tokens reused (its
        computed positions: the scheduler sets them).

        At least one token is always left to compute, so the step that follows can sample.
        """
        kv = seq.kv
        assert not kv.num_blocks and seq.num_computed == 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        full = (seq.num_tokens - 1) // bs
        self.stats.queried_tokens += seq.num_tokens
        parent = root = chain_root(seq.req.cache_salt, seq.req.lora_key)
        hits = []
        for i in range(full):
            chunk = block_bytes(seq.tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            block = self._block_of.get(h)
            if block is None or self._content[block] != (parent, chunk):
                break  # a miss, or a digest collision: never share a block whose tokens differ
            if self.refcount[block] == 0:
                del self._cached[block]
            self.refcount[block] += 1
            hits.append(block)
            parent = h
        if hits:
            self._append(kv, hits)
        kv.prefix_hash = parent if hits else root
        kv.hashed_blocks = len(hits)
        reused = len(hits) * bs
        self.stats.hit_tokens += reused
        return reused

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key seq's full blocks whose KV is settled (below num_computed) by their prefix hash."""
        bs, kv = self.block_size, seq.kv
        if not self.enable_prefix_caching or seq.num_computed < (kv.hashed_blocks + 1) * bs:
            return  # off, or no block filled since the last call
        upto = min(seq.num_computed // bs, kv.num_blocks)
        if kv.hashed_blocks == 0:
            kv.prefix_hash = chain_root(seq.req.cache_salt, seq.req.lora_key)
        table = self.tables[kv.row]
        for i in range(kv.hashed_blocks, upto):  # incremental: each block is hashed once
            chunk = block_bytes(seq.tokens[i * bs : (i + 1) * bs])
            h = block_hash(kv.prefix_hash, chunk)
            block = int(table[i])
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block  # else another sequence holds the same content already
                self._hash_of[block] = h
                self._content[block] = (kv.prefix_hash, chunk)
            kv.prefix_hash = h
        kv.hashed_blocks = max(kv.hashed_blocks, upto)

    def reset_cache(self) -> None:
        """Forget every cached block: the device's KV is gone (a worker restart)."""
        for block in list(self._cached):
            self._free.append(block)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._content.clear()
