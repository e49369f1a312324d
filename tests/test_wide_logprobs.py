"""Whole-vocabulary logprobs (vLLM's --max-logprobs -1): the ticket ring's alternatives regions hold a bounded number
of rows, the scheduler chunks a prompt_logprobs prefill to that bound, and a wide row does not burst; the entries
equal those of the unchunked path."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.ipc.plan import StepResult
from metrale.ipc.ticket_layout import LOGPROB_ALTERNATIVES, RingGeometry, prompt_counts, region_offsets, result_counts


def test_the_default_width_keeps_a_row_for_every_token_and_every_burst_step():
    g = RingGeometry(max_tokens=2048, max_rows=64, max_burst=32, max_logprobs=20)
    assert g.prompt_logprob_rows == 2048 and g.sample_logprob_rows == 64 * 32


def test_a_whole_vocabulary_ring_is_bounded_and_still_holds_one_step_of_every_row():
    """SmolLM2's 49,152 alternatives with the default 2,048 tokens and 64 rows a step: a ring of a few hundred MiB,
    not several GiB; each region holds LOGPROB_ALTERNATIVES, and one step's 64 rows fit whatever the width."""
    g = RingGeometry(max_tokens=2048, max_rows=64, max_burst=32, max_logprobs=49152)
    assert g.num_slots * region_offsets(g)["_end"] < 1 << 30
    assert g.prompt_logprob_rows == LOGPROB_ALTERNATIVES // 49152 < 2048
    assert g.sample_logprob_rows == 85 > 64
    wide = RingGeometry(max_tokens=2048, max_rows=64, max_burst=32, max_logprobs=151936)
    assert wide.sample_logprob_rows == 64 and wide.prompt_logprob_rows == LOGPROB_ALTERNATIVES // 151936


def _result(rows: int, n: int) -> StepResult:
    return StepResult(tokens=np.zeros(rows, np.int32), logprobs=np.zeros(rows, np.float32),
                      top_ids=np.zeros((rows, n), np.int32), top_logprobs=np.zeros((rows, n), np.float32))


def test_results_past_the_rows_bound_are_refused_by_the_layout():
    g = RingGeometry(max_tokens=2048, max_rows=64, max_burst=32, max_logprobs=49152)
    assert result_counts([_result(64, 49152)], g)[:2] == (64, 49152)
    with pytest.raises(ValueError, match="rows of 49152"):
        result_counts([_result(64, 49152)] * 2, g)  # a burst of wide rows
    assert result_counts([_result(64, 20)] * 32, g)[:2] == (64, 20)  # a default-width burst fits
    lp = np.zeros(g.prompt_logprob_rows + 1, np.float32)
    over = StepResult(tokens=np.zeros(1, np.int32), prompt_logprobs=lp,
                      prompt_top_ids=np.zeros((len(lp), 49152), np.int32),
                      prompt_top_logprobs=np.zeros((len(lp), 49152), np.float32))
    with pytest.raises(ValueError, match="positions"):
        prompt_counts(over, g)


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, stream=False)
    got, tops = {}, {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.prompt_logprobs is not None:
                got[d.request_id] = d.prompt_logprobs
            for lp in d.logprobs or []:
                tops.setdefault(d.request_id, []).append(lp)
    return got, tops


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_whole_vocabulary_prompt_logprobs_prefill_is_chunked_to_the_bound_with_the_same_entries(pipeline):
    """FakeDevice, 512 tokens, --max-logprobs -1: two requests asking every alternative of every prompt position run
    at most 5 such positions a step (the ring's bound, set small), beside a plain request; their entries equal an
    unbounded run's; and their decodes (whole-vocabulary sample logprobs) run one step a ticket (no burst)."""
    from metrale.engine_core.engine import EngineCore, EngineOptions
    from metrale.ipc.sampling import SamplingParams
    from metrale.testing.fake_device import FakeDevice

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (23, 4, 17)]
    wide = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=512, logprobs=512, temperature=0.0)
    runs = []
    for bound in (None, 5):
        device = FakeDevice(vocab_size=512, num_kv_blocks=64, block_size=4, max_burst=8)
        engine = EngineCore(device, EngineOptions(max_num_batched_tokens=16, max_num_seqs=8, pipeline=pipeline,
                                                  max_logprobs=-1, decode_burst=8))
        if bound is not None:
            engine.scheduler.config.max_prompt_logprob_rows = bound
        plans, launch = [], device.launch

        def recording(plan, kind=None, steps=1, launch=launch):
            plans.append((int(plan.prompt_lp_count.sum()), bool((plan.num_logprobs > 20).any()), steps))  # buffers are reused
            return launch(plan, kind, steps) if kind is not None else launch(plan, steps=steps)

        device.launch = recording
        got, tops = _run(engine, prompts, wide)
        engine.add_request("plain", prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), stream=False)
        while engine.has_unfinished():
            engine.step()
        runs.append((got, tops))
        asked = [n for n, _, _ in plans]
        if bound is not None:
            assert max(asked) <= bound and sum(asked) == sum(len(p) - 1 for p in prompts)
        else:
            assert max(asked) > 5
        assert all(steps == 1 for _, wide_row, steps in plans if wide_row)
        assert any(steps > 1 for _, wide_row, steps in plans if not wide_row)  # the plain request did burst
    (chunked, chunked_tops), (whole, whole_tops) = runs[1], runs[0]
    assert sorted(chunked) == ["r0", "r1", "r2"]
    for rid in whole:
        assert [(e.token_id, e.logprob, e.top_ids, e.top_logprobs) for e in chunked[rid][1:]] == \
            [(e.token_id, e.logprob, e.top_ids, e.top_logprobs) for e in whole[rid][1:]]
        assert len(chunked[rid][1].top_ids) == 512
    assert chunked_tops == whole_tops
