"""The KV block pool: fixed-size blocks, reference counts, and automatic prefix caching.

A block is in exactly one of three states: used (refcount > 0), cached (refcount 0 but holding a
full, settled block of tokens that a later request may reuse, evicted LRU) or free. The invariant
every test checks: free + used + cached == total.

A cached block is keyed by a 128-bit BLAKE2b digest of its parent's digest and its tokens, and a hit is
confirmed by comparing the stored parent and tokens: a digest collision (or a forged one) can never hand
one request another's KV. The chain starts from the request's cache salt, so requests with different
salts (tenants) never share a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .sequence import Sequence

BlockHash = bytes


def block_hash(parent: BlockHash, tokens: list[int]) -> BlockHash:
    """The digest of one full block: its parent's digest and its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


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
    _content: dict[int, tuple[BlockHash, tuple[int, ...]]] = field(init=False)  # block -> (parent, tokens)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self.refcount = [0] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        self._cached = OrderedDict()
        self._hash_of = {}
        self._block_of = {}
        self._content = {}

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
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def check_invariant(self) -> None:
        """Raise AssertionError unless free + used + cached == total and refcounts agree."""
        assert self.num_free + self.num_cached + self.num_used == self.num_blocks
        assert sum(1 for r in self.refcount if r > 0) == self.num_used, "refcounts disagree with the free lists"
        assert all(self.refcount[b] == 0 for b in self._free)
        assert all(self.refcount[b] == 0 for b in self._cached)

    # ---- allocation -----------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to cover num_tokens tokens. False (nothing taken) if the pool is dry."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_available:
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks of seq beyond those num_tokens tokens need (an over-run's reservation)."""
        keep = -(-num_tokens // self.block_size)
        assert keep >= seq.hashed_blocks, "trimming a settled block"
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release every block of seq; full settled blocks stay cached for reuse."""
        for block in reversed(seq.block_table):  # tail first, so the shared head is evicted last
            self._release(block)
        seq.block_table.clear()
        seq.hashed_blocks = 0
        seq.prefix_hash = b""

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
        assert not seq.block_table and seq.num_computed == 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        full = (seq.num_tokens - 1) // bs
        self.stats.queried_tokens += seq.num_tokens
        parent = root = chain_root(seq.cache_salt, seq.lora_key)
        for i in range(full):
            chunk = seq.tokens[i * bs : (i + 1) * bs]
            h = block_hash(parent, chunk)
            block = self._block_of.get(h)
            if block is None or self._content[block] != (parent, tuple(chunk)):
                break  # a miss, or a digest collision: never share a block whose tokens differ
            if self.refcount[block] == 0:
                del self._cached[block]
            self.refcount[block] += 1
            seq.block_table.append(block)
            parent = h
        seq.prefix_hash = parent if seq.block_table else root
        seq.hashed_blocks = len(seq.block_table)
        reused = len(seq.block_table) * bs
        self.stats.hit_tokens += reused
        return reused

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key seq's full blocks whose KV is settled (below num_computed) by their prefix hash."""
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed < (seq.hashed_blocks + 1) * bs:
            return  # off, or no block filled since the last call
        upto = min(seq.num_computed // bs, len(seq.block_table))
        if seq.hashed_blocks == 0:
            seq.prefix_hash = chain_root(seq.cache_salt, seq.lora_key)
        for i in range(seq.hashed_blocks, upto):  # incremental: each block is hashed once
            chunk = seq.tokens[i * bs : (i + 1) * bs]
            h = block_hash(seq.prefix_hash, chunk)
            block = seq.block_table[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block  # else another sequence holds the same content already
                self._hash_of[block] = h
                self._content[block] = (seq.prefix_hash, tuple(chunk))
            seq.prefix_hash = h
        seq.hashed_blocks = max(seq.hashed_blocks, upto)

    def reset_cache(self) -> None:
        """Forget every cached block: the device's KV is gone (a worker restart)."""
        for block in list(self._cached):
            self._free.append(block)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._content.clear()
