"""StepBuilder: its plans are byte for byte those of the straightforward row-by-row builder it replaced.

The reference below is the builder as it was before the numpy rows (engine_core/step_builder.py at
commit bf7bc63), kept verbatim in logic; the tests drive both with the same random steps — decodes,
prefill chunks, launch-ahead (fed) steps, masks, penalties, and block tables (rows of the block pool's table)
that grow, roll back, are freed and reallocated between steps, rows passing from one sequence to another — and
compare every field.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from metrale.engine_core.kv_blocks import KvBlockPool
from metrale.engine_core.pipeline import NO_MASK, RowMask
from metrale.engine_core.sequence import Sequence
from metrale.engine_core.step_builder import MAX_BAN_IDS, StepBuilder
from metrale.engine_core.swap import SwapSpace
from metrale.ipc.plan import FEED_HOST, MASK_BAN, MASK_FORCE, MASK_GREEDY, StepPlan
from metrale.ipc.sampling import SamplingParams

BLOCK = 16
MAX_LEN = 6000


class ReferenceBuilder:
    """The previous StepBuilder.build, row by row, into fresh arrays (its buffers' rotation does not matter)."""

    def __init__(self, pool: KvBlockPool, *, max_rows: int, max_model_len: int, max_tokens: int):
        self.pool = pool
        self.block_size = block_size = pool.block_size
        self.max_blocks = -(-max_model_len // block_size) + 1
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.hist_cap = max(4096, max_tokens)

    def build(self, seqs, num_new, masks, *, feed=None) -> StepPlan:
        feed = feed or [FEED_HOST] * len(seqs)
        R = len(seqs)
        T = sum(num_new)
        i32 = np.int32
        input_ids, positions, slot_mapping = np.zeros(T, i32), np.zeros(T, i32), np.zeros(T, np.int64)
        width = max(1, max(-(-(s.num_computed + k) // self.block_size) for s, k in zip(seqs, num_new)))
        tables = np.zeros((R, width), i32)
        hist_need = sum(s.num_tokens + 1 for s in seqs if s.params.has_penalties)
        hist_tokens = np.zeros(max(self.hist_cap, hist_need * 2 if hist_need > self.hist_cap else 0), i32)
        hist_start, hist_prompt_len = np.zeros(R + 1, i32), np.zeros(R, i32)
        ban_ids = np.full((R, MAX_BAN_IDS), -1, i32)
        bs = self.block_size
        floats, ints, seq_lens, samples, kinds, forces = [], [], [], [], [], []
        t = h = 0
        for r, (seq, k, mask) in enumerate(zip(seqs, num_new, masks)):
            fed = feed[r] != FEED_HOST
            start = seq.num_computed
            bt = self.pool.blocks(seq)
            tables[r, : len(bt)] = bt
            if k == 1:
                positions[t] = start
                slot_mapping[t] = bt[start // bs] * bs + start % bs
                input_ids[t] = 0 if fed else seq.tokens[start]
            else:
                pos = np.arange(start, start + k, dtype=np.int32)
                positions[t : t + k] = pos
                slot_mapping[t : t + k] = tables[r, pos // bs].astype(np.int64) * bs + pos % bs
                input_ids[t : t + k] = seq.tokens[start : start + k]
            t += k
            seq_lens.append(start + k)
            samples.append(fed or start + k == seq.num_tokens)
            p = seq.params
            floats.append((p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                           p.frequency_penalty))
            ints.append((p.top_k if p.top_k > 0 else 0, seq.req.seed, -1 if p.logprobs is None else p.logprobs))
            kinds.append(mask.kind)
            forces.append(mask.force_token)
            if mask.ban:
                ban = mask.ban[:MAX_BAN_IDS]
                ban_ids[r, : len(ban)] = ban
            if seq.params.has_penalties:
                n = seq.num_tokens
                hist_tokens[h : h + n] = seq.tokens
                hist_prompt_len[r] = seq.num_prompt
                h += n
                if fed:  # the slot the device fills with the fed token
                    hist_tokens[h] = -1
                    h += 1
            hist_start[r + 1] = h
        f = np.array(floats, dtype=np.float32).reshape(R, 6)
        i = np.array(ints, dtype=np.int64).reshape(R, 3)
        query_start = np.zeros(R + 1, i32)
        np.cumsum(num_new, out=query_start[1:])
        as_i32 = lambda a: np.asarray(a).astype(i32)  # noqa: E731 — the old int32 buffers' casts
        return StepPlan(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start=query_start,
            seq_lens=np.array(seq_lens, i32),
            block_tables=tables,
            sample=np.array(samples, np.bool_),
            feed_from_row=np.array(feed, i32),
            temperature=f[:, 0].copy(),
            top_k=as_i32(i[:, 0]),
            top_p=f[:, 1].copy(),
            min_p=f[:, 2].copy(),
            repetition_penalty=f[:, 3].copy(),
            presence_penalty=f[:, 4].copy(),
            frequency_penalty=f[:, 5].copy(),
            seeds=i[:, 1].copy(),
            mask_kind=np.array(kinds, np.uint8),
            force_token=np.array(forces, i32),
            ban_ids=ban_ids,
            num_logprobs=as_i32(i[:, 2]),
            hist_tokens=hist_tokens[:h],
            hist_start=hist_start,
            hist_prompt_len=hist_prompt_len,
        )


def assert_same_plan(got: StepPlan, want: StepPlan) -> None:
    """Every field: same dtype, same shape, same bytes."""
    for f in dataclasses.fields(StepPlan):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype, f.name
        assert a.shape == b.shape, (f.name, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), f.name


@dataclasses.dataclass
class World:
    """Sequences whose state moves between steps the way the scheduler and block manager move it."""

    rng: random.Random
    seqs: list[Sequence]
    # Blocks enough that a freed one is not handed out again soon (a reallocated table differs from the old one).
    pool: KvBlockPool = dataclasses.field(default_factory=lambda: KvBlockPool(1 << 17, BLOCK, False))

    def step(self, max_rows: int, fed: bool) -> tuple[list[Sequence], list[int], list[RowMask]]:
        """A random step: a subset of sequences in random order, each a decode or a prefill chunk."""
        rng = self.rng
        chosen = rng.sample(self.seqs, rng.randint(1, max_rows))
        num_new = []
        for seq in chosen:
            remaining = seq.num_tokens - seq.num_computed
            k = 1 if fed or remaining == 1 or rng.random() < 0.5 else rng.randint(1, remaining)
            num_new.append(k)
        self.fit(chosen, num_new)
        return chosen, num_new, [self.mask() for _ in chosen]

    def fit(self, chosen: list[Sequence], num_new: list[int]) -> None:
        """Give each row the blocks its tokens need (as the block manager does before a step)."""
        width = max(-(-(s.num_computed + k) // BLOCK) for s, k in zip(chosen, num_new))
        for seq, k in zip(chosen, num_new):
            assert self.pool.allocate(seq, seq.num_computed + k)
            self.pool.trim(seq, width * BLOCK)  # a longer table than any row needs never reaches a plan

    def feed(self, rows: int) -> list[int]:
        """A launch-ahead step's feeds: most rows from some row of the step before, some host-fed (churn)."""
        sources = list(range(rows + 4))
        self.rng.shuffle(sources)
        return [FEED_HOST if self.rng.random() < 0.25 else src for src in sources[:rows]]

    def mask(self) -> RowMask:
        """NO_MASK mostly; sometimes an equal copy, a ban list (longer than MAX_BAN_IDS), a force, greedy."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return NO_MASK
        if roll < 0.7:
            return RowMask()
        ban = tuple(rng.randrange(0, 5000) for _ in range(rng.choice([1, 3, MAX_BAN_IDS + 6])))
        kind = rng.choice([MASK_BAN, MASK_FORCE, MASK_GREEDY, MASK_BAN | MASK_GREEDY])
        return RowMask(kind, rng.randrange(0, 5000) if kind & MASK_FORCE else -1, ban if kind & MASK_BAN else ())

    def advance(self, seqs: list[Sequence], num_new: list[int]) -> None:
        """After a step: commit tokens, sometimes roll back, free and reallocate, or swap a table."""
        rng = self.rng
        for seq, k in zip(seqs, num_new):
            seq.num_computed += k
            if seq.num_computed == seq.num_tokens:
                seq.tokens.append(rng.randrange(3, 5000))
            roll = rng.random()
            if roll < 0.05:  # rollback: the last block goes back
                seq.num_computed = max(0, seq.num_computed - BLOCK)
                self.pool.trim(seq, max(seq.num_computed, 1))
            elif roll < 0.12:  # preempted and readmitted, or swapped in: new blocks, maybe another table row
                n = seq.kv.num_blocks
                self.pool.free(seq)
                self.pool.allocate(seq, n * BLOCK)


def random_params(rng: random.Random, i: int) -> SamplingParams:
    """Params covering every sampling field the plan carries, penalties on a third of them."""
    pen = rng.random() < 0.33
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
        top_k=rng.choice([0, -1, 1, 40]),
        top_p=rng.choice([1.0, 0.9, 0.33333]),
        min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.1, 0.9]) if pen else 1.0,
        presence_penalty=rng.choice([0.0, 0.5]) if pen else 0.0,
        frequency_penalty=rng.choice([0.0, -0.25]) if pen else 0.0,
        logprobs=rng.choice([None, 0, 5]),
        seed=rng.choice([None, i, 2**40 + i]),
    )


def make_world(seed: int, num_seqs: int, long_prompts: bool = False, params: SamplingParams | None = None) -> World:
    rng = random.Random(seed)
    seqs = []
    for i in range(num_seqs):
        n = rng.randint(1, 3000 if long_prompts else 200)
        p = random_params(rng, i)
        seq = Sequence.of(f"r{i}", params or p, rng.randrange(0, 2**62), [rng.randrange(3, 5000) for _ in range(n)], n, i)
        seq.num_computed = rng.randint(0, n - 1)
        seqs.append(seq)
    return World(rng, seqs)


def builders(world: World, max_rows: int) -> tuple[StepBuilder, ReferenceBuilder]:
    kw = dict(max_rows=max_rows, max_model_len=MAX_LEN, max_tokens=8192)
    return StepBuilder(world.pool, swap=SwapSpace(0), **kw), ReferenceBuilder(world.pool, **kw)


@pytest.mark.parametrize("seed", range(6))
def test_plans_equal_the_row_by_row_builder(seed):
    """Random mixed and launch-ahead steps over 40 sequences, 8 rows at most."""
    world = make_world(seed, 40)
    new, ref = builders(world, max_rows=8)
    for step in range(150):
        fed = step % 3 == 2
        if fed:  # a launch-ahead step: every row a decode
            for seq in world.seqs:
                seq.num_computed = seq.num_tokens - 1
        seqs, num_new, masks = world.step(8, fed)
        feed = world.feed(len(seqs)) if fed else None
        assert_same_plan(new.build(seqs, num_new, masks, feed=feed), ref.build(seqs, num_new, masks, feed=feed))
        world.advance(seqs, num_new)


@pytest.mark.parametrize("rows", [1, 32, 64])
def test_all_decode_plans_equal_the_row_by_row_builder(rows):
    """Steps of decodes only (the fast path), synchronous and fed, the same batch for many steps."""
    world = make_world(100 + rows, rows)
    new, ref = builders(world, max_rows=64)
    for seq in world.seqs:
        seq.num_computed = seq.num_tokens - 1
    for step in range(40):
        fed = step % 2 == 1
        seqs, num_new = world.seqs, [1] * rows
        masks = [world.mask() for _ in seqs]
        world.fit(seqs, num_new)
        feed = world.feed(len(seqs)) if fed else None
        assert_same_plan(new.build(seqs, num_new, masks, feed=feed), ref.build(seqs, num_new, masks, feed=feed))
        world.advance(seqs, num_new)
        for seq in seqs:
            seq.num_computed = seq.num_tokens - 1


def test_penalty_history_larger_than_the_buffer_grows_it():
    """Rows whose token histories exceed the 4,096-entry history buffer: the buffer grows, contents match."""
    world = make_world(7, 12, long_prompts=True, params=SamplingParams(repetition_penalty=1.2, seed=1))
    for seq in world.seqs:
        seq.num_computed = seq.num_tokens - 1
    new, ref = builders(world, max_rows=12)
    for _ in range(3):
        seqs, num_new, masks = world.step(12, fed=True)
        plan = new.build(seqs, num_new, masks)
        assert_same_plan(plan, ref.build(seqs, num_new, masks))
        world.advance(seqs, num_new)


def test_a_launched_plan_is_untouched_by_the_next_builds():
    """The buffers rotate: a plan keeps its values while the next two are built."""
    world = make_world(3, 20)
    new, ref = builders(world, max_rows=8)
    kept = []
    for _ in range(3):
        seqs, num_new, masks = world.step(8, fed=False)
        kept.append((new.build(seqs, num_new, masks), ref.build(seqs, num_new, masks)))
        world.advance(seqs, num_new)
    for got, want in kept:
        assert_same_plan(got, want)
