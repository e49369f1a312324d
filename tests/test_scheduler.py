"""Scheduler behaviour on FakeDevice: continuous batching, chunked prefill, prefix caching, preemption, limits."""

from __future__ import annotations

import pytest

from metrale.engine_core.engine import EngineCore, EngineOptions
from metrale.testing.fake_device import FakeDevice
from metrale.engine_core.scheduler import SchedulerBusy
from metrale.ipc.sampling import SamplingParams
from metrale.testing.invariants import check_pool

from engine_harness import Req, run_workload


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_long_prompt_is_chunked_and_never_stalls_decodes():
    """A 2,000-token prompt among 16 decoding streams: every step still carries all 16 decodes."""
    decoders = [Req([5 + i % 40, 6], greedy(60)) for i in range(16)]
    long = Req([7 + i % 40 for i in range(2000)], greedy(4), arrive_tick=5)
    run = run_workload(decoders + [long], pipeline=True, num_kv_blocks=2048, max_num_seqs=32, max_num_batched_tokens=128, max_model_len=4096)
    records = run.device.records
    chunk_steps = [r for r in records if max(r.q_lens) > 2]  # steps carrying a piece of the long prompt
    assert len(chunk_steps) >= 2000 // 128  # chunked
    for r in chunk_steps:
        assert sum(r.q_lens) <= 128
        assert sum(1 for q in r.q_lens if q == 1) == 16  # every live decode rides along
    unchunked = run_workload(decoders + [long], pipeline=True, num_kv_blocks=2048, max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=4096)
    assert unchunked.streams == run.streams


def test_shared_prefix_is_computed_once():
    """16 requests sharing a 512-token prefix compute it once; outputs equal those with caching off."""
    prefix = [4 + i % 40 for i in range(512)]
    reqs = [Req(prefix + [5 + i, 6 + i], greedy(8), arrive_tick=0 if i == 0 else 3) for i in range(16)]
    cached = run_workload(reqs, pipeline=True, num_kv_blocks=2048, max_num_seqs=16, max_num_batched_tokens=1024)
    computed = sum(sum(r.q_lens) for r in cached.device.records)
    uncached = run_workload(reqs, pipeline=True, num_kv_blocks=2048, max_num_seqs=16, max_num_batched_tokens=1024, prefix_caching=False)
    computed_off = sum(sum(r.q_lens) for r in uncached.device.records)
    assert cached.streams == uncached.streams
    assert computed_off - computed >= 15 * 508  # 15 requests reused (almost) the whole prefix
    assert cached.engine.stats().prefix_cache_hit_rate > 0.8


def test_small_pool_preempts_and_completes_every_request_identically():
    """A pool for ~8 sequences serving 32 long requests: all complete, outputs equal an unconstrained run."""
    reqs = [Req([4 + i, 5, 6], greedy(40), arrive_tick=0) for i in range(32)]
    roomy = run_workload(reqs, pipeline=True, num_kv_blocks=1024, max_num_seqs=32)
    tight = run_workload(reqs, pipeline=True, num_kv_blocks=8 * 11, max_num_seqs=32)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.streams == roomy.streams
    assert all(tight.finish[str(i)] == "length" for i in range(32))


def test_swap_mode_moves_blocks_to_host_and_back_with_identical_outputs():
    """Swap preemption: the same 32 requests on the same small pool, KV parked on the host and brought back."""
    reqs = [Req([4 + i, 5, 6], greedy(40), arrive_tick=0) for i in range(32)]
    roomy = run_workload(reqs, pipeline=True, num_kv_blocks=1024, max_num_seqs=32)
    swapped = run_workload(
        reqs, pipeline=True, num_kv_blocks=8 * 11, max_num_seqs=32, preemption_mode="swap", num_swap_blocks=400
    )
    stats = swapped.engine.stats()
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
    assert swapped.streams == roomy.streams
    assert swapped.engine.scheduler.swap.num_free == 400  # every host block back


def test_full_swap_space_falls_back_to_recompute():
    reqs = [Req([4 + i, 5, 6], greedy(40), arrive_tick=0) for i in range(32)]
    roomy = run_workload(reqs, pipeline=True, num_kv_blocks=1024, max_num_seqs=32)
    tight = run_workload(reqs, pipeline=True, num_kv_blocks=8 * 11, max_num_seqs=32, preemption_mode="swap", num_swap_blocks=12)
    stats = tight.engine.stats()
    assert stats.swapped_out_blocks > 0
    assert stats.preemptions > stats.swapped_out_blocks // 11  # some preemptions had to recompute
    assert tight.streams == roomy.streams


def test_fcfs_and_priority_order_admission():
    """With room for one sequence at a time, a lower priority value runs first; equals run FCFS."""
    dev = FakeDevice(num_kv_blocks=64, block_size=4)
    eng = EngineCore(dev, EngineOptions(max_num_seqs=1))
    eng.add_request("late-urgent", [5, 6], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, priority=-1))
    eng.add_request("a", [5, 6], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.add_request("b", [5, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    order = []
    while eng.has_unfinished():
        for d in eng.step():
            if d.finish_reason:
                order.append(d.request_id)
    assert order == ["late-urgent", "a", "b"]


def test_waiting_queue_bound_answers_busy_and_changes_nothing():
    dev = FakeDevice()
    eng = EngineCore(dev, EngineOptions(max_waiting=2))
    eng.add_request("a", [5], greedy(2))
    eng.add_request("b", [5], greedy(2))
    with pytest.raises(SchedulerBusy, match="busy"):
        eng.add_request("c", [5], greedy(2))
    assert set(eng.requests) == {"a", "b"}


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([5] * 1024, greedy(2), "prompt has 1024 tokens"),
        ([5, 4000], greedy(2), "token_ids"),
        ([5], SamplingParams(max_tokens=-1), "max_tokens"),
        ([5], SamplingParams(top_p=1.5), "top_p"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([], greedy(2), "prompt"),
    ],
)
def test_bad_requests_are_refused_at_admission_naming_the_field(prompt, params, field):
    eng = EngineCore(FakeDevice(max_model_len=1024), EngineOptions())
    with pytest.raises(ValueError, match=field):
        eng.add_request("x", prompt, params)
    assert not eng.requests and not eng.has_unfinished()


def test_abort_frees_blocks_within_one_tick():
    dev = FakeDevice(block_size=4)
    eng = EngineCore(dev, EngineOptions())
    eng.add_request("a", list(range(4, 20)), greedy(100))
    eng.step()
    eng.step()
    assert eng.pool.num_used > 0
    eng.abort("a")
    outs = eng.step()
    assert [(d.request_id, d.finish_reason) for d in outs] == [("a", "abort")]
    eng.step()
    assert eng.pool.num_used == 0
    check_pool(eng.pool)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_request_that_does_not_stream_reports_once_with_every_token(pipeline):
    """stream=False (the offline LLM's requests): one delta, with its finish, carrying what a streamed
    twin got over many ticks."""
    eng = EngineCore(FakeDevice(), EngineOptions(pipeline=pipeline))
    eng.add_request("streamed", [5, 6, 7], greedy(12))
    eng.add_request("final-only", [5, 6, 7], greedy(12), stream=False)
    deltas = {"streamed": [], "final-only": []}
    while eng.has_unfinished():
        for d in eng.step():
            deltas[d.request_id].append(d)
    streamed = [t for d in deltas["streamed"] for t in d.new_token_ids]
    (only,) = deltas["final-only"]
    assert len(deltas["streamed"]) > 1 and len(streamed) == 12
    assert only.finish_reason == "length" and only.new_token_ids == streamed


def test_has_admissible_applies_the_watermark_admission_applies():
    """A waiting head that needs exactly the free blocks is not admissible while others run (admission
    keeps one block spare): the lane does not drain for an arrival that schedule() would not admit."""
    from metrale.engine_core.kv_blocks import KvBlockPool
    from metrale.engine_core.scheduler import Scheduler, SchedulerConfig
    from metrale.engine_core.sequence import Sequence

    pool = KvBlockPool(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), pool)
    running = Sequence.of("run", greedy(4), 0, [1, 2, 3], 3, 0)
    sched.add(running)
    sched.schedule()
    assert sched.running == [running] and pool.num_available == 3
    head = Sequence.of("head", greedy(4), 0, list(range(12)), 12, 1)  # 3 blocks: exactly what is free
    sched.add(head)
    assert not sched.has_admissible()
    assert head not in sched.schedule().seqs
    sched.running.clear()
    pool.free(running)
    assert sched.has_admissible()  # with nothing running there is no watermark


def test_preemption_takes_the_lowest_priority_latest_arrival():
    """A dry pool preempts the running sequence that runs last: the highest priority value, latest arrival."""
    from metrale.engine_core.kv_blocks import KvBlockPool
    from metrale.engine_core.scheduler import Scheduler, SchedulerConfig
    from metrale.engine_core.sequence import Sequence

    pool = KvBlockPool(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), pool)
    seqs = [Sequence.of(name, SamplingParams(max_tokens=9, priority=prio), 0, [1, 2, 3, 4], 4, arrival)
            for arrival, (name, prio) in enumerate([("urgent-early", 0), ("lazy", 1), ("urgent-late", 0)])]
    for s in seqs:
        sched.add(s)
    sched.schedule()  # three prompts of one block each
    for s in seqs:
        s.num_computed = 4
        s.tokens.append(5)  # each decodes next: a second block each, 6 in all
    sched.schedule()
    for s in seqs:
        s.num_computed = 5
        s.tokens.extend([6, 7, 8, 9])
    step = sched.schedule()  # positions 5..8 need a third block each: none is left, so one must go
    assert [s.request_id for s in sched.running] == ["urgent-early", "urgent-late"]
    assert sched.num_preemptions == 1 and seqs[1].num_preemptions == 1
    assert "lazy" not in [s.request_id for s in step.seqs]


def test_min_tokens_bans_stops_until_exactly_min_tokens_exist():
    from metrale.engine_core.pipeline import NO_MASK, init_row_state, row_mask
    from metrale.engine_core.sequence import Sequence
    from metrale.ipc.plan import MASK_BAN

    from engine_harness import TOKS

    seq = Sequence.of("m", SamplingParams(min_tokens=3, stop_token_ids=[9]), 0, [5, 6], 2, 0)
    init_row_state(seq, TOKS)
    for n in range(3):  # 0, 1, 2 outputs so far: the next pick may not stop
        assert row_mask(seq, TOKS, (1,)).kind & MASK_BAN and set(row_mask(seq, TOKS, (1,)).ban) == {1, 9}
        assert row_mask(seq, TOKS, (1,), ahead=1).kind & MASK_BAN or n == 2
        seq.tokens.append(20 + n)
    assert row_mask(seq, TOKS, (1,)) == NO_MASK  # the fourth pick may stop


def test_the_thinking_budget_counts_generated_thinking_only():
    """A prompt that already holds thinking tokens after <think> does not use up the budget."""
    from metrale.engine_core.pipeline import init_row_state, row_mask, update_row_state
    from metrale.engine_core.sequence import Sequence
    from metrale.ipc.plan import MASK_FORCE

    from engine_harness import THINK_END, THINK_START, TOKS

    prompt = [5, THINK_START, 9, 9, 9]
    seq = Sequence.of("t", SamplingParams(max_thinking_tokens=2), 0, list(prompt), len(prompt), 0)
    init_row_state(seq, TOKS)
    for _ in range(2):
        assert not row_mask(seq, TOKS, (1,)).kind & MASK_FORCE
        seq.tokens.append(11)
        update_row_state(seq, 11, TOKS)
    mask = row_mask(seq, TOKS, (1,))
    assert mask.kind & MASK_FORCE and mask.force_token == THINK_END


def test_a_block_is_cached_only_once_every_position_of_it_is_computed():
    """A request that stops right after its first token leaves that token's position uncomputed: the block
    holding it must not be cached, or a request whose prompt continues it reads KV never written."""
    a_prompt = [5, 6, 7, 8, 9, 10, 11]  # 7 tokens: the first output sits at position 7, the end of block 1
    first = run_workload([Req(a_prompt, greedy(1))], pipeline=False)
    b_prompt = a_prompt + first.streams["0"] + [12, 13]
    reqs = [Req(a_prompt, greedy(1)), Req(b_prompt, greedy(6), arrive_tick=6)]
    # Synchronous: the pipelined lane's over-run of the finished request would write that position anyway.
    cached = run_workload(reqs, pipeline=False)
    uncached = run_workload(reqs, pipeline=False, prefix_caching=False)
    assert cached.streams == uncached.streams


def test_a_suspect_runs_alone_until_it_is_past_its_failing_point():
    """After a failed tick every running row is suspect (suspect_running): no waiting request is admitted beside one,
    a suspect requeued is admitted only into an empty batch, and once every running row holds more tokens than when
    the tick failed, requests are admitted again."""
    from metrale.engine_core.kv_blocks import KvBlockPool
    from metrale.engine_core.scheduler import Scheduler, SchedulerConfig
    from metrale.engine_core.sequence import Sequence

    pool = KvBlockPool(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), pool)
    first, second = (Sequence.of(name, greedy(9), 0, [1, 2, 3], 3, i) for i, name in enumerate(("first", "second")))
    sched.add(first)
    sched.schedule()
    first.num_computed = 3
    assert sched.suspect_running(max_failures=3) == []
    sched.add(second)
    assert second not in sched.schedule().seqs and sched.running == [first]  # the suspect runs alone
    first.tokens.append(4)  # past the failing point: no longer suspect
    assert second in sched.schedule().seqs
    assert sched.running == [first, second]
    sched.suspect_running(max_failures=3)  # both suspect again: a newcomer waits
    later = Sequence.of("later", greedy(9), 0, [1, 2, 3], 3, 2)
    sched.add(later)
    assert later not in sched.schedule().seqs
