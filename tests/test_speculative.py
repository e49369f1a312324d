"""Speculative decoding (prompt lookup) on FakeDevice: the same streams as decoding without drafts, greedy and
seeded, with arrivals, aborts, stops and preemption; drafts really are accepted; rejected drafts' KV goes back."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.engine_core.sequence import Sequence
from metrale.engine_core.speculative import NgramProposer
from metrale.ipc.sampling import SamplingParams

from engine_harness import Req, run_workload


@st.composite
def requests(draw) -> Req:
    motif = draw(st.lists(st.integers(4, 47), min_size=2, max_size=5))
    prompt = (motif * draw(st.integers(1, 5)) + draw(st.lists(st.integers(4, 47), max_size=6)))[:40]
    max_tokens = draw(st.integers(1, 40))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=draw(st.sampled_from([0.0, 0.0, 0.6, 1.2])),
        top_k=draw(st.sampled_from([0, 0, 5])),
        seed=draw(st.integers(0, 2**32)),
        stop_token_ids=draw(st.lists(st.integers(4, 47), max_size=1)),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.sampled_from([0, 0, 0, min(3, max_tokens)])),  # a non-plain row: never drafted
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.0, 0.5])),
    )
    return Req(prompt, params, arrive_tick=draw(st.integers(0, 20)),
               abort_after=draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 10))))


def _without_aborts(reqs: list[Req]) -> list[Req]:
    return [Req(r.prompt, r.params, r.arrive_tick) for r in reqs]


def assert_same_streams(spec, plain, reqs) -> None:
    """Equal streams and finishes; an aborted request's stream (which depends on how many tokens a tick
    delivered when the abort came) is a prefix of its whole stream."""
    for i, r in enumerate(reqs):
        rid = str(i)
        if r.abort_after is not None and spec.finish[rid] == "abort":
            assert plain.streams[rid][: len(spec.streams[rid])] == spec.streams[rid], rid
        else:
            assert spec.streams[rid] == plain.streams[rid], rid
            assert spec.finish[rid] == plain.finish[rid], rid


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(requests(), min_size=1, max_size=10),
    pool=st.integers(14, 40),
    seqs=st.sampled_from([2, 4, 8]),
    k=st.integers(1, 5),
    pipeline=st.booleans(),
    repetitive=st.booleans(),
)
def test_speculative_streams_equal_plain_decoding(reqs, pool, seqs, k, pipeline, repetitive):
    """Any workload, a roomy or a dry pool (preemption), the lane on or off, a model that repeats itself (many
    drafts accepted) or not: speculative decoding streams what plain decoding streams, and no block leaks."""
    for kw in ({}, {"num_kv_blocks": pool}):
        plain = run_workload(_without_aborts(reqs), pipeline=True, max_num_seqs=seqs, repetitive=repetitive, **kw)
        spec = run_workload(reqs, pipeline=pipeline, max_num_seqs=seqs, repetitive=repetitive,
                            speculative="ngram", num_speculative_tokens=k, **kw)
        assert_same_streams(spec, plain, reqs)


def _repeating(n: int = 4, seeded: bool = False) -> list[Req]:
    """Greedy (or seeded) requests on a self-repeating model: prompt lookup finds the cycle."""
    return [Req([5 + i, 9, 11, 5 + i, 9, 11], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9 if seeded else 0.0,
                                                            seed=i)) for i in range(n)]


@pytest.mark.parametrize("pipeline", [True, False])
def test_drafts_are_accepted_and_rejected_kv_goes_back(pipeline):
    """On a model that repeats itself, most drafts are accepted (fewer device steps than tokens), some are not
    (their KV is rolled back), and the tokens are plain decoding's."""
    reqs = _repeating()
    mixed = reqs + _repeating(2, seeded=True)
    assert (run_workload(mixed, pipeline=pipeline, repetitive=True, speculative="ngram").streams
            == run_workload(mixed, pipeline=True, repetitive=True).streams)
    plain = run_workload(reqs, pipeline=True, repetitive=True)
    spec = run_workload(reqs, pipeline=pipeline, repetitive=True, speculative="ngram", num_speculative_tokens=4,
                        count_effects=True)
    assert spec.streams == plain.streams
    stats = spec.engine.speculator.stats
    assert stats.accepted > stats.drafted // 3 > 0
    assert spec.effects["trim"] > 0
    assert spec.device._launched < 0.75 * plain.device._launched


def test_no_drafts_at_the_batch_size_that_disables_them(monkeypatch):
    """--speculative-disable-by-batch-size 3: steps of three or more rows decode plainly, smaller ones verify
    drafts; the tokens are plain decoding's either way."""
    from metrale.engine_core.speculative import Speculator

    verified_rows = []
    drafts = Speculator.drafts

    def drafted(self, seqs):
        out = drafts(self, seqs)
        if out is not None and any(out):
            verified_rows.append(len(seqs))
        return out

    monkeypatch.setattr(Speculator, "drafts", drafted)
    reqs = [Req(r.prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
            for r, n in zip(_repeating(), (8, 20, 30, 40))]  # four rows, then three, two, one
    plain = run_workload(reqs, pipeline=True, repetitive=True)
    spec = run_workload(reqs, pipeline=True, repetitive=True, speculative="ngram", speculative_disable_by_batch_size=3)
    assert spec.streams == plain.streams
    assert verified_rows and max(verified_rows) < 3, verified_rows


def test_a_wrong_verification_is_caught(monkeypatch):
    """A device that kept one pick past the first rejected draft is caught: the streams change, or the host's
    bookkeeping no longer matches the KV the device wrote."""
    from metrale.testing import fake_device

    reqs = _repeating(2)
    plain = run_workload(reqs, pipeline=True)  # the length-keyed model: most drafts are rejected
    original = fake_device.FakeDevice._execute

    def keeps_one_more(self, n, plan):
        out = original(self, n, plan)
        if isinstance(out, list) and len(out) > 1:
            for r in range(len(out[0].tokens)):
                kept = [j for j in range(len(out)) if out[j].tokens[r] >= 0]
                if kept and kept[-1] + 1 < len(out):
                    out[kept[-1] + 1].tokens[r] = plan.input_ids[plan.query_start[r] + 1 + kept[-1]]
        return out

    monkeypatch.setattr(fake_device.FakeDevice, "_execute", keeps_one_more)
    try:
        spec = run_workload(reqs, pipeline=True, speculative="ngram", num_speculative_tokens=3)
    except AssertionError as exc:
        assert "never written" in str(exc)
        return
    assert spec.streams != plain.streams


def test_ngram_proposer_finds_the_latest_match():
    """The longest suffix n-gram (3, then 2, then 1) at its latest earlier occurrence, and what followed it."""
    def seq(tokens):
        return Sequence.of("r", SamplingParams(), 0, tokens, 3, 0)

    assert NgramProposer().propose(seq([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]), 3) == [7, 8, 5]
    assert NgramProposer().propose(seq([4, 6, 4, 5, 6]), 2) == [4, 5]  # "6" was followed by 4 (no longer match exists)
    assert NgramProposer().propose(seq([1, 2, 3]), 2) == []


def test_rows_without_drafts_keep_their_masks_in_a_verify_step():
    """min_tokens and grammar rows ride undrafted in verify steps beside drafted rows, under their own masks."""
    from fake_grammars import FAKE_GRAMMAR_VOCAB, compiled, text_of
    from metrale.ipc.sampling import StructuredOutputs

    so = StructuredOutputs(regex="[0-9]{3,6}(ab|cd)")
    reqs = _repeating(3) + [  # the last two arrive once the drafted rows cycle (verify steps all along)
        Req([4, 4, 4], SamplingParams(max_tokens=6, min_tokens=6, temperature=0.6, seed=1), arrive_tick=14),
        Req([5, 6], SamplingParams(max_tokens=20, temperature=0.7, seed=2, structured_outputs=so), grammar=compiled(so),
            arrive_tick=14),
    ]
    kw = dict(repetitive=True, grammar_vocab=FAKE_GRAMMAR_VOCAB)
    plain = run_workload(reqs, pipeline=True, **kw)
    spec = run_workload(reqs, pipeline=True, speculative="ngram", **kw)
    assert spec.streams == plain.streams and spec.engine.speculator.stats.accepted > 0
    assert len(spec.streams["3"]) == 6 and spec.finish["4"] == "stop"
    assert text_of(spec.streams["4"])[-2:] in ("ab", "cd")


def test_a_recurrent_model_never_speculates():
    """A model with recurrent state slots cannot drop rejected drafts from its state, so its engine runs as if
    --speculative were not given: no verify step, no draft, and the streams of plain decoding (FakeDevice's
    slots must hold exactly each row's context, so a draft run through them would fail the next step)."""
    reqs = _repeating() + _repeating(2, seeded=True)
    plain = run_workload(reqs, pipeline=True, repetitive=True, num_state_slots=8)
    spec = run_workload(reqs, pipeline=True, repetitive=True, num_state_slots=8, speculative="ngram",
                        num_speculative_tokens=4)
    assert spec.engine.speculator is None and spec.engine.options.speculative is None
    assert spec.engine.stats().spec_draft_tokens == 0
    assert spec.device._launched == plain.device._launched  # no verify step saved a launch
    assert spec.streams == plain.streams and spec.finish == plain.finish


def test_a_verify_step_the_device_fails_fails_its_rows_and_nothing_else(monkeypatch):
    """The device fails the first verify step: its rows finish with the device's error, the tick does not raise,
    and the requests that arrive after it stream as plain decoding does."""
    from metrale.testing.fake_device import FakeDevice, FakeFaults
    from metrale.ipc.plan import StepKind

    launch = FakeDevice.launch
    failed = []

    def fail_first_verify(self, plan, kind=StepKind.STEP, steps=1):
        if kind == StepKind.VERIFY and not failed:
            failed.append(self._launched)
            self.faults.fail_steps.add(self._launched)
        return launch(self, plan, kind, steps)

    monkeypatch.setattr(FakeDevice, "launch", fail_first_verify)
    late = [Req([7, 9, 11, 7, 9, 11], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0), arrive_tick=60)]
    run = run_workload(_repeating(3) + late, pipeline=True, repetitive=True, speculative="ngram",
                       device_faults=FakeFaults())
    assert failed
    assert [run.finish[str(i)] for i in range(3)] == ["error"] * 3
    plain = run_workload(late, pipeline=True, repetitive=True)
    assert run.streams["3"] == plain.streams["0"] and run.finish["3"] == "length"


def test_drafts_are_cut_to_the_step_s_token_capacity():
    """Four rows of four drafts (20 tokens) with a step of at most 8: the drafts are cut so the verify step fits
    the plan builder and the ring, and the streams are plain decoding's."""
    reqs = _repeating(4)
    plain = run_workload(reqs, pipeline=True, repetitive=True, max_num_seqs=4, max_num_batched_tokens=8)
    spec = run_workload(reqs, pipeline=True, repetitive=True, max_num_seqs=4, max_num_batched_tokens=8,
                        speculative="ngram", num_speculative_tokens=4)
    assert spec.streams == plain.streams
    assert spec.engine.speculator.stats.accepted > 0
