"""Decode graphs: a decode step's forward over persistent buffers, one per batch-size bucket, replayed.

A decode step (one token per row, R rows) runs in the smallest bucket B >= R (`batch_buckets`). Its inputs
are copied into buffers allocated once for the largest bucket — input ids, positions, slots, block tables
and sequence lengths; each window's first visible key and the torch path's masks are computed from the
lengths on the device — and rows R..B are padding: position 0, length 1, their slot and every block-table
entry the KV cache's scratch block, so they never touch a sequence's block; their outputs are dropped.

On CUDA the forward over bucket B's buffers is captured once in a torch.cuda.CUDAGraph (warmed up on a side
stream; every bucket shares one memory pool, the largest captured first, as vLLM and gpt-fast do) and a
step replays it: a few copies and one launch instead of hundreds. Elsewhere the same function runs over the
same buffers, so the bucketing, the padding and the buffers are what CI tests. Prefill and mixed steps, a
step whose rotary needs each row's length (past `rope_seq_len_threshold`), and models whose forward depends
on host-side data (experts, recurrent state) run eager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from metrale.gpu_worker.layers.attention_metadata import AttentionMetadata, DecodeRows
from metrale.gpu_worker.layers.kv_cache import PagedKVCache
from metrale.gpu_worker.step_staging import StepStaging
from metrale.ipc.plan import StepPlan

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP = 16  # past the small buckets
WARMUP_RUNS = 2  # forwards before a capture (lazy allocations, library handles, autotuning)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are made for: 1, 2, 4, 8, 16, 24, 32, then every 16, and max_num_seqs last."""
    buckets = [b for b in SMALL_BUCKETS if b < max_num_seqs]
    b = SMALL_BUCKETS[-1] + BUCKET_STEP
    while b < max_num_seqs:
        buckets.append(b)
        b += BUCKET_STEP
    buckets.append(max_num_seqs)
    return buckets


@dataclass(slots=True)
class _Captured:
    """One bucket's graph and the hidden states its replay writes."""

    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [B, hidden]


class DecodeGraphs:
    """The persistent decode buffers, the forward over them per bucket, and (on CUDA) its captured graphs."""

    def __init__(self, model, cache: PagedKVCache, staging: StepStaging, *, max_num_seqs: int, max_model_len: int, capture: bool):
        """Allocate the buffers for the largest bucket (padding throughout); capture every bucket when asked."""
        if cache.scratch_block is None:
            raise ValueError("decode graphs need a KV cache with a scratch block for their padding rows")
        self.model = model
        self.cache = cache
        self.staging = staging
        self.buckets = batch_buckets(max(1, max_num_seqs))
        self.max_rows = self.buckets[-1]
        self.width = math.ceil(max_model_len / cache.block_size)  # block-table columns: any row's whole context
        self.num_keys = self.width * cache.block_size
        self.scratch_slot = cache.scratch_block * cache.block_size
        device = cache.v[0].device if cache.v else staging.device
        b, w = self.max_rows, self.width
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slots = torch.full((b,), self.scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full((b, w), cache.scratch_block, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int64, device=device)
        self.first_keys = {win: torch.zeros(b, dtype=torch.int64, device=device) for win in model.windows}
        self.masks = {}
        if model.uses_masked_decode:
            self.masks = {win: torch.zeros(b, 1, 1, self.num_keys, dtype=model.dtype, device=device) for win in model.windows}
        self._keys = torch.arange(self.num_keys, device=device)
        self._graphs: dict[int, _Captured] = {}
        self.pool = None
        if capture:
            self._capture_all()

    @property
    def captured(self) -> bool:
        """Whether steps replay CUDA graphs (else they call the forward over the buffers)."""
        return bool(self._graphs)

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket holding rows."""
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest decode graph ({self.max_rows})")

    def serves(self, plan: StepPlan) -> bool:
        """True for a decode step (one token per row) that fits a bucket and needs no per-row rotary lengths."""
        if plan.num_tokens != plan.num_rows or plan.num_rows > self.max_rows:
            return False
        threshold = self.model.rope_seq_len_threshold
        return threshold is None or int(plan.seq_lens.max()) <= threshold

    def run(self, plan: StepPlan, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, hidden] of a served decode step whose input ids (on the device) are given."""
        r = plan.num_rows
        n = self.bucket_for(r)
        self._load(plan, input_ids, n)
        captured = self._graphs.get(n)
        if captured is None:
            return self._forward(n)[:r]
        captured.graph.replay()
        return captured.hidden[:r]

    def _load(self, plan: StepPlan, input_ids: torch.Tensor, n: int) -> None:
        """Copy the plan's rows into the buffers' first rows and make rows r..n padding."""
        r, stage = plan.num_rows, self.staging
        self.input_ids[:r].copy_(input_ids)  # padding rows keep whatever ids they had: any id is a valid one
        host = stage.host("graph_rows", (3, n))
        rows = host.numpy()
        rows[0, :r], rows[0, r:] = plan.positions, 0
        rows[1, :r], rows[1, r:] = plan.slot_mapping, self.scratch_slot
        rows[2, :r], rows[2, r:] = plan.seq_lens, 1
        stage.upload(self.positions[:n], host[0])
        stage.upload(self.slots[:n], host[1])
        stage.upload(self.seq_lens[:n], host[2])
        tables = stage.host("graph_blocks", (n, self.width))
        cols = min(plan.block_tables.shape[1], self.width)
        t = tables.numpy()
        t[:r, :cols] = plan.block_tables[:, :cols]
        t[:r, cols:] = self.cache.scratch_block
        t[r:] = self.cache.scratch_block
        stage.upload(self.block_tables[:n], tables)

    def _forward(self, n: int) -> torch.Tensor:
        """The model over the first n rows of the buffers: what a graph captures, and what runs uncaptured."""
        seq_lens = self.seq_lens[:n]
        first_keys = {}
        for win, first in self.first_keys.items():
            first_keys[win] = first[:n]
            if win is not None:
                torch.sub(seq_lens, win, out=first[:n]).clamp_(min=0)
        masks = {}
        for win, mask in self.masks.items():
            m = mask[:n]
            unseen = (self._keys[None, :] >= seq_lens[:, None]) | (self._keys[None, :] < first_keys[win][:, None])
            masks[win] = m.zero_().masked_fill_(unseen[:, None, None, :], float("-inf"))
        decode = DecodeRows(
            token_idx=None, block_ids=self.block_tables[:n], num_keys=self.num_keys, seq_lens=seq_lens,
            first_keys=first_keys, masks=masks,
        )
        meta = AttentionMetadata(slot_mapping=self.cache.slot_index(self.slots[:n]), num_tokens=n, decode=decode)
        return self.model(self.input_ids[:n], self.positions[:n], self.cache, meta)

    def _capture_all(self) -> None:
        """Capture every bucket, the largest first (the pool then fits the smaller ones), after warm-ups on a
        side stream; the buffers hold padding throughout, so capture touches only the scratch block."""
        self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.staging.device)
        with torch.inference_mode():
            for n in reversed(self.buckets):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        self._forward(n)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    hidden = self._forward(n)
                self._graphs[n] = _Captured(graph, hidden)
        torch.cuda.synchronize(self.staging.device)
