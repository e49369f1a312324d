"""The pipelined decode lane, and decode bursts, stream exactly what the synchronous loop streams (FakeDevice)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.engine_core.decode_lane import POISONED
from metrale.testing.fake_device import FakeFaults
import numpy as np

from metrale.engine_core import decode_lane
from metrale.engine_core.pipeline import SpecialTokens, init_row_state
from metrale.ipc.plan import FEED_HOST
from metrale.engine_core.sequence import Sequence
from metrale.ipc.plan import FedAheadPolicy
from metrale.ipc.sampling import SamplingParams

from engine_harness import THINK_START, Req, run_workload

VOCAB = 48


PREFIXES = [[7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


@st.composite
def requests(draw) -> Req:
    """A request as serving traffic brings them: often sharing a prompt prefix (blocks of 4 in the harness),
    with any sampling knob (logit_bias too), mask kind and priority, arriving while others decode, sometimes aborted."""
    prompt = draw(st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=24))
    if draw(st.booleans()):
        prompt = draw(st.sampled_from(PREFIXES)) + prompt[: draw(st.integers(0, 6))]
    max_tokens = draw(st.integers(1, 30))
    think = draw(st.one_of(st.none(), st.integers(0, 6)))
    if think is not None and draw(st.booleans()):
        prompt = prompt + [THINK_START]  # a template that opens the thinking block
    penalty = draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, -0.3]))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.3])),
        top_k=draw(st.sampled_from([0, 0, 5])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05])),
        presence_penalty=penalty,
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.2])) if penalty else 0.0,
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.1])),
        seed=draw(st.integers(0, 2**32)),
        stop_token_ids=draw(st.lists(st.integers(4, VOCAB - 1), max_size=2)),
        min_tokens=draw(st.integers(0, min(4, max_tokens))),
        max_thinking_tokens=think,
        adaptive_sampling=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        priority=draw(st.sampled_from([0, 0, 0, 1, -1])),
        logit_bias=draw(st.one_of(st.none(), st.none(), st.dictionaries(
            st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 100.0, 4.0, -2.5, 0.75]), min_size=1, max_size=4))),
    )
    return Req(
        prompt=prompt,
        params=params,
        arrive_tick=draw(st.integers(0, 60)),
        abort_after=draw(st.one_of(st.none(), st.none(), st.integers(0, 12))),
    )


workloads = st.lists(requests(), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=workloads,
    small_pool=st.integers(14, 40),
    seqs=st.sampled_from([2, 4, 8]),
    mode=st.sampled_from(["recompute", "swap"]),
    swap_blocks=st.integers(0, 40),
    deferred=st.booleans(),
)
def test_pipelined_streams_equal_synchronous_for_any_workload(reqs, small_pool, seqs, mode, swap_blocks, deferred):
    """Arrivals during decode, stops, aborts, shared prefixes, penalties, top-p/min-p, priorities, every mask
    kind, a dry pool with preemption by swap or recompute, and a device that runs steps behind the host: the
    same streams as the synchronous loop with room to spare, and no block leaked."""
    reference = run_workload(reqs, pipeline=False, max_num_seqs=seqs)
    piped = run_workload(reqs, pipeline=True, max_num_seqs=seqs, deferred=deferred)
    assert piped.streams == reference.streams
    assert piped.finish == reference.finish
    small = dict(num_kv_blocks=small_pool, max_num_seqs=seqs, preemption_mode=mode, num_swap_blocks=swap_blocks)
    small_sync = run_workload(reqs, pipeline=False, **small)
    small_piped = run_workload(reqs, pipeline=True, deferred=deferred, **small)
    assert small_piped.streams == small_sync.streams == reference.streams
    assert small_piped.finish == small_sync.finish == reference.finish


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(requests().map(lambda r: Req(r.prompt, r.params, r.arrive_tick)), min_size=1, max_size=12),
    small_pool=st.integers(14, 40),
    seqs=st.sampled_from([2, 4, 8]),
    burst=st.integers(2, 6),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_bursts_stream_what_the_synchronous_loop_streams(reqs, small_pool, seqs, burst, mode):
    """Streamed every `burst` tokens, plain decode batches run as bursts of up to `burst` steps: with arrivals,
    stops inside bursts, think budgets and min_tokens (which keep their batch out of bursts) and a dry pool,
    every request's tokens and finish are the synchronous loop's, and no block leaks. (No aborts: when an
    abort lands depends on how many tokens were delivered, which the interval changes.)"""
    reference = run_workload(reqs, pipeline=False, max_num_seqs=seqs)
    small = dict(num_kv_blocks=small_pool, max_num_seqs=seqs, preemption_mode=mode, num_swap_blocks=small_pool)
    for kw in ({"max_num_seqs": seqs}, small):
        bursts = run_workload(reqs, pipeline=True, stream_interval=burst, max_burst=burst, **kw)
        assert bursts.streams == reference.streams
        assert bursts.finish == reference.finish


def test_plain_batches_really_run_as_bursts():
    """Six greedy requests streamed every 4 tokens: the device runs far fewer tickets than tokens."""
    reqs = _finishing_workload()
    bursts = run_workload(reqs, pipeline=True, stream_interval=4, max_burst=4)
    steps = run_workload(reqs, pipeline=True)
    assert bursts.streams == steps.streams
    assert bursts.device._launched < steps.device._launched / 2


def test_biased_rows_stream_in_the_lane_and_bursts_what_the_synchronous_loop_streams():
    """Requests with a logit_bias (plain rows: it never changes) beside unbiased ones, greedy and seeded: the
    pipelined lane and bursts stream what the synchronous loop does; +100 puts its token in every pick, -100
    keeps its token out, and the unbiased requests stream what they stream alone."""
    def params(i: int, bias: dict | None) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True, logit_bias=bias)

    free = [Req([5 + i, 9, 11 + i], params(i, None)) for i in range(4)]
    biased = [Req([6, 9, 12], params(4, {13: 100.0})), Req([7, 9, 13], params(5, {13: 100.0, 14: 3.0})),
              Req([8, 9, 14], params(6, {t: -100.0 for t in range(20, 30)}))]
    reference = run_workload(free + biased, pipeline=False, max_num_seqs=8)
    for kw in ({"pipeline": True}, {"pipeline": True, "stream_interval": 4, "max_burst": 4}):
        run = run_workload(free + biased, max_num_seqs=8, **kw)
        assert run.streams == reference.streams and run.finish == reference.finish
    alone = run_workload(free, pipeline=True, max_num_seqs=8)
    streams = [reference.streams[str(i)] for i in range(7)]
    assert [alone.streams[str(i)] for i in range(4)] == streams[:4]
    assert streams[4] == streams[5] == [13] * 12
    assert not set(streams[6]) & set(range(20, 30))


def _finishing_workload() -> list[Req]:
    """Greedy requests that stop at different lengths while the lane runs ahead."""
    return [Req([5 + i, 9, 11 + i], SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)) for i in range(6)]


@pytest.mark.parametrize("pipeline", [True, False])
def test_stream_interval_reports_the_first_token_then_every_n_then_the_rest(pipeline):
    """The engine holds a streamed request's tokens to every 4th (the first at once, the last with its
    finish); the tokens themselves are those of an interval of 1."""
    reqs = [Req([5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True, seed=n)) for n in (10, 7, 1)]
    held = run_workload(reqs, pipeline=pipeline, stream_interval=4)
    each = run_workload(reqs, pipeline=pipeline)
    assert held.streams == each.streams and held.finish == each.finish
    assert held.delta_sizes == {"0": [1, 4, 4, 1], "1": [1, 4, 2], "2": [1]}
    assert each.delta_sizes["0"] == [1] * 10


def test_the_lane_really_runs_ahead():
    """Most decode steps of a plain greedy workload are launched ahead (fed from the device)."""
    run = run_workload(_finishing_workload(), pipeline=True)
    fed = sum(r.fed for r in run.device.records)
    assert fed > len(run.device.records) // 2


def test_without_overrun_validation_the_property_fails(monkeypatch):
    """A lane that commits the steps that ran past a finish (validation taking every row as valid) streams
    after a finish: the check the property rests on is the one that makes it hold."""
    reqs = _finishing_workload()
    reference = run_workload(reqs, pipeline=False)
    assert run_workload(reqs, pipeline=True).streams == reference.streams

    def every_row_valid(nxt, prev_tokens, io):
        return []

    monkeypatch.setattr(decode_lane, "validate_next", every_row_valid)
    with pytest.raises(AssertionError, match="streamed after its finish"):
        run_workload(reqs, pipeline=True)


def test_device_error_fails_exactly_the_inflight_rows_and_frees_every_block():
    """A failed pipelined step: its rows finish with the error; a later request still succeeds."""
    reqs = _finishing_workload()
    late = Req([7, 7, 7], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), arrive_tick=40)
    run = run_workload(reqs + [late], pipeline=True, device_faults=FakeFaults(fail_steps={4}))
    failed = {rid for rid, why in run.finish.items() if why == "error"}
    assert failed == {str(i) for i in range(6)}
    assert all("injected failure of step 4" in run.errors[r] for r in failed)
    assert run.finish["6"] == "length" and len(run.streams["6"]) == 5


def rewrite_commit(monkeypatch, request_id: str, index: int) -> None:
    """The host commits a token other than the device's for output `index` of request_id (token ^ 1), in the
    lane and in the synchronous step alike: what the device fed a step launched ahead is then not the host's."""
    original = decode_lane.commit_tokens

    def rewritten(io, seqs, tokens, result, skip):
        tokens = np.array(tokens, copy=True)
        for r, s in enumerate(seqs):
            if s.request_id == request_id and s.num_output == index and tokens[r] >= 0:
                tokens[r] ^= 1
        original(io, seqs, tokens, result, skip)

    monkeypatch.setattr(decode_lane, "commit_tokens", rewritten)  # the one commit path, synchronous or not


def test_repick_only_stale_mask_is_resampled_on_the_host():
    """RepickOnly: a step launched ahead whose mask went stale stands, and the host picks its token."""
    think = [Req([5, 6, THINK_START], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, max_thinking_tokens=2))]
    others = [Req([8 + i, 9], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for i in range(3)]
    reference = run_workload(think + others, pipeline=False, policy=FedAheadPolicy.REPICK_ONLY)
    forced = run_workload(think + others, pipeline=True, policy=FedAheadPolicy.REPICK_ONLY, count_effects=True)
    assert forced.effects["resample"] > 0, "no stale mask was met: the test did not test"
    assert forced.streams == reference.streams


def test_rewind_stale_mask_redoes_the_step():
    """Rewind: the same stale mask discards that row of the step launched ahead; it runs again, host-fed."""
    think = [Req([5, 6, THINK_START], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, max_thinking_tokens=2))]
    others = [Req([8 + i, 9], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for i in range(3)]
    reference = run_workload(think + others, pipeline=False)
    forced = run_workload(think + others, pipeline=True, count_effects=True)
    assert forced.effects["trim"] > 0
    assert forced.streams == reference.streams


def test_repick_only_poisoned_row_fails_and_others_are_unaffected(monkeypatch):
    """A RepickOnly row fed a token the host did not commit fails with the seed's message; others go on."""
    reqs = [Req([5 + i, 9], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for i in range(3)]
    rewrite_commit(monkeypatch, "0", 4)
    reference = run_workload(reqs, pipeline=False, policy=FedAheadPolicy.REPICK_ONLY)
    run = run_workload(reqs, pipeline=True, policy=FedAheadPolicy.REPICK_ONLY)
    assert run.finish["0"] == "error" and run.errors["0"] == POISONED
    assert run.streams["0"] == reference.streams["0"][:5]
    for rid in ("1", "2"):
        assert run.streams[rid] == reference.streams[rid]
        assert run.finish[rid] == "length"


def test_rewind_host_rewrite_is_an_overrun_and_is_redone(monkeypatch):
    """Rewind: the same host-side rewrite makes the step launched ahead an over-run; it is run again
    from the host's token and the stream equals the synchronous loop's."""
    reqs = [Req([5 + i, 9], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for i in range(3)]
    rewrite_commit(monkeypatch, "0", 4)
    reference = run_workload(reqs, pipeline=False)
    run = run_workload(reqs, pipeline=True, count_effects=True)
    assert run.effects["trim"] > 0
    assert run.streams == reference.streams
    assert run.finish == reference.finish


@pytest.mark.parametrize(
    "params, plain",
    [
        (SamplingParams(), True),
        (SamplingParams(temperature=0.8, top_k=5, seed=1, stop_token_ids=[7]), True),
        (SamplingParams(min_tokens=2), False),
        (SamplingParams(presence_penalty=0.5), False),
        (SamplingParams(max_thinking_tokens=4), False),
        (SamplingParams(adaptive_sampling=True), False),
        (SamplingParams(logit_bias={7: 100.0, 9: -100.0}), True),  # the same ids and values at every pick
    ],
)
def test_only_rows_whose_masks_and_state_never_matter_are_plain(params, plain):
    """The lane skips masks and row state for plain rows: a row that needs either must not be plain."""
    seq = Sequence.of("r", params, 0, [5, 6], 2, 0)
    init_row_state(seq, SpecialTokens(think_start=THINK_START, think_end=THINK_START + 1))
    assert seq.req.plain is plain


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads, small_pool=st.integers(14, 40), seqs=st.sampled_from([2, 4, 8]), slots=st.integers(1, 8))
def test_a_recurrent_model_streams_what_the_synchronous_loop_streams(reqs, small_pool, seqs, slots):
    """A recurrent FakeDevice (RepickOnly, state slots that must hold exactly each row's context): arrivals,
    stops, aborts, think budgets and min_tokens (stale masks repaired on the host), a dry pool preempting by
    recompute, fewer slots than max_num_seqs; the synchronous loop's streams, no block or slot leaked."""
    reference = run_workload(reqs, pipeline=False, max_num_seqs=seqs)
    for kw in ({}, {"num_kv_blocks": small_pool, "preemption_mode": "swap", "num_swap_blocks": small_pool}):
        piped = run_workload(reqs, pipeline=True, max_num_seqs=seqs, num_state_slots=slots, **kw)
        assert piped.streams == reference.streams
        assert piped.finish == reference.finish


def test_recurrent_repairs_are_counted_and_the_model_serves_without_prefix_caching():
    """Thinking rows whose budget runs out while the lane runs ahead: their stale masks are repaired on the host
    (counted in the stats), the streams are the synchronous loop's, and prefix caching and swap are off."""
    think = [Req([5, 6, THINK_START], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, max_thinking_tokens=2))]
    sampled = [Req([8 + i, 9, THINK_START], SamplingParams(max_tokens=12, temperature=0.9, seed=i, max_thinking_tokens=i))
               for i in range(3)]
    reference = run_workload(think + sampled, pipeline=False)
    run = run_workload(think + sampled, pipeline=True, num_state_slots=4, preemption_mode="swap", num_swap_blocks=8)
    assert run.streams == reference.streams
    stats = run.engine.stats()
    assert stats.repicks > 0 and stats.repicks == run.engine.io.repicks
    assert not run.engine.pool.enable_prefix_caching and run.engine.options.preemption_mode == "recompute"
