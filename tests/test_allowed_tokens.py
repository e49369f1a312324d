"""allowed_token_ids and logprob_token_ids in the engine (vLLM's SamplingParams fields): an allowed row's picks stay
in its set in the pipelined lane and the synchronous loop alike, fed ahead and in bursts as any plain row (its
bitmask is the same every step), ANDed with a grammar's, and repicked under it on the host; a pinning row's
logprobs list its ids, through the offline LLM on the real sampler as on FakeDevice."""

from __future__ import annotations

import numpy as np
import pytest

from metrale import LLM
from metrale.engine_core import engine as engine_module
from metrale.engine_core.step_builder import StepBuilder
from metrale.engine_core.kv_blocks import KvBlockPool
from metrale.engine_core.pipeline import NO_MASK
from metrale.engine_core.sequence import Sequence
from metrale.ipc.plan import MASK_GRAMMAR, FedAheadPolicy, unpack_bitmask
from metrale.ipc.sampling import SamplingParams, StructuredOutputs

from engine_harness import Req, run_workload
from fake_grammars import FAKE_GRAMMAR_VOCAB, FAKE_VOCAB, compiled, text_of

ALLOWED = [12, 13, 22, 31, 40]  # "0", "1", "a", "true", "12"


def _req(i: int, temperature: float, allowed: list[int] | None = ALLOWED, **kw) -> Req:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 20), temperature=temperature, seed=50 + i,
                            allowed_token_ids=allowed, ignore_eos=True, **kw)
    return Req([5 + i, 9, 11], params, grammar=compiled(params.structured_outputs) if params.structured_outputs else None)


@pytest.mark.parametrize("pipeline", [False, True])
def test_allowed_rows_pick_only_their_tokens_beside_free_rows(pipeline):
    reqs = [_req(0, 0.0), _req(1, 0.9), _req(2, 1.5, allowed=[7]), _req(3, 0.9, allowed=None)]
    run = run_workload(reqs, pipeline=pipeline)
    for i in (0, 1):
        assert len(run.streams[str(i)]) == 20 and set(run.streams[str(i)]) <= set(ALLOWED)
    assert run.streams["2"] == [7] * 20
    assert not set(run.streams["3"]) <= set(ALLOWED)  # the free row beside them is not masked
    assert len(set(run.streams["1"])) > 1  # sampled: the mask leaves a choice


def test_allowed_rows_are_fed_ahead_and_stream_what_the_synchronous_loop_streams():
    """A static mask needs no commit (unlike a grammar's): the lane feeds the rows from the device's token."""
    reqs = [_req(i, t) for i, t in enumerate((0.0, 0.8, 1.2, 0.0))]
    reference = run_workload(reqs, pipeline=False)
    piped = run_workload(reqs, pipeline=True, deferred=True)
    assert piped.streams == reference.streams
    assert any(r.fed for r in piped.device.records), "no allowed row was fed ahead"


def test_allowed_token_ids_and_a_grammar_both_apply():
    """A choice grammar ANDed with allowed ids that spell one of its choices: that choice, whatever the sampling."""
    so = StructuredOutputs(choice=["true", "false", "abc"])
    abc = FAKE_VOCAB.index("abc")
    for temperature in (0.0, 1.5):
        reqs = [_req(i, temperature, allowed=[abc, 1], structured_outputs=so) for i in range(3)]
        for pipeline in (False, True):
            run = run_workload(reqs, pipeline=pipeline, grammar_vocab=FAKE_GRAMMAR_VOCAB)
            for i in range(3):
                assert run.finish[str(i)] == "stop" and text_of(run.streams[str(i)]) == "abc", run.errors


@pytest.mark.parametrize("num_state_slots", [0, 8])
def test_a_host_repick_keeps_to_the_allowed_tokens(monkeypatch, num_state_slots):
    """RepickOnly: grammar rows fed ahead anyway go stale and the host picks again; it picks under the allowed ids
    too, so the lane streams what the synchronous loop streams."""
    so = StructuredOutputs(regex="[0-9]{2,6}(ab|cd)")
    allowed = [FAKE_VOCAB.index(t) for t in ("1", "2", "7", "ab", "cd", "</s>")]
    reqs = [_req(i, 0.0 if i % 2 else 0.9, allowed=allowed, structured_outputs=so, max_tokens=12) for i in range(4)]
    kw = dict(grammar_vocab=FAKE_GRAMMAR_VOCAB, num_state_slots=num_state_slots, policy=FedAheadPolicy.REPICK_ONLY)
    reference = run_workload(reqs, pipeline=False, **kw)
    monkeypatch.setattr(engine_module, "can_feed", lambda seq: True)
    forced = run_workload(reqs, pipeline=True, **kw)
    assert forced.engine.io.repicks > 0, "no stale bitmask was met: the test did not test"
    assert forced.streams == reference.streams
    for i in range(4):
        assert set(forced.streams[str(i)]) <= set(allowed), forced.errors


def test_the_step_builder_gives_an_allowed_row_a_bitmask_and_keeps_it_plain():
    """A plain row with allowed_token_ids gets MASK_GRAMMAR and the ids' bitmask, with no RowMask of its own (so it
    stays plain: no row state, fed ahead, bursts); its neighbours get none."""
    pool = KvBlockPool(16, 4)
    builder = StepBuilder(pool, max_tokens=8, max_rows=4, max_model_len=32, vocab_size=100)
    seqs = [Sequence.of(str(i), SamplingParams(allowed_token_ids=ids), 0, [3, 4], 2, i)
            for i, ids in enumerate(([5, 99, 64], None, [0]))]
    for seq in seqs:
        assert seq.req.plain
        assert pool.allocate(seq, 2)
    plan = builder.build(seqs, [2, 2, 2], [NO_MASK] * 3)
    assert plan.mask_kind.tolist() == [MASK_GRAMMAR, 0, MASK_GRAMMAR]
    bits = unpack_bitmask(plan.grammar_bitmask, 100)
    assert [np.flatnonzero(row).tolist() for row in bits] == [[5, 64, 99], [0]]


def test_logprob_token_ids_through_the_offline_llm_on_the_real_sampler(tiny_model_dir):
    """One pinning request beside a top-N one and a plain one, greedy under allowed ids: the pick is allowed, the
    pinned ids' logprobs equal those the whole vocabulary's list gives them, and bursts change nothing."""
    prompts = [[5, 9, 30, 2], [7, 7, 8], [40, 41]]
    asked = [17, 3, 250]
    results, launches = [], []
    with LLM(str(tiny_model_dir("llama")), show_progress=False, max_logprobs=-1) as llm:
        vocab = llm.engine.info.vocab_size
        whole = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, logprobs=vocab,
                                                         allowed_token_ids=[3, 17, 99]))[0].outputs[0]
    for burst in (1, 8):
        with LLM(str(tiny_model_dir("llama")), show_progress=False, decode_burst=burst) as llm:
            params = [SamplingParams(max_tokens=4, temperature=0, logprobs=0, logprob_token_ids=asked,
                                     allowed_token_ids=[3, 17, 99]),
                      SamplingParams(max_tokens=4, temperature=0.7, seed=1, logprobs=3),
                      SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=[8])]
            results.append([o.outputs[0] for o in llm.generate(prompts, params)])
            launches.append(llm.device._next_seq)  # tickets: one per step, or per burst
    assert launches[1] < launches[0], "the allowed and pinning rows never ran as bursts"
    assert results[0][0].token_ids == results[1][0].token_ids == whole.token_ids
    assert results[0][2].token_ids == [8] * 4
    for pinned, full in zip(results[0][0].logprobs, whole.logprobs, strict=True):
        assert pinned.token_id in (3, 17, 99) and pinned.top_ids == asked
        of = dict(zip(full.top_ids, full.top_logprobs))
        assert pinned.top_logprobs == pytest.approx([of[i] for i in asked], abs=1e-5)
        assert np.isfinite(pinned.top_logprobs).all()
    assert [len(t.top_ids) for t in results[0][1].logprobs] == [3] * 4
    for a, b in zip(results[0], results[1], strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("policy", [FedAheadPolicy.REWIND, FedAheadPolicy.REPICK_ONLY])
def test_fake_device_lists_pinned_ids_and_a_host_repick_does_too(monkeypatch, policy):
    """FakeDevice reports a pinning row's ids with the logprobs its top-N gives them; grammar rows fed ahead anyway
    (stale bitmasks: rewound, or repicked on the host under RepickOnly) report the same as the synchronous loop."""
    so = StructuredOutputs(regex="[0-9]{2,6}(ab|cd)")
    top = run_workload([_req(0, 0.0, allowed=None, logprobs=5)], pipeline=False).logprobs["0"]
    asked = [top[0].top_ids[::-1]]
    reqs = [_req(0, 0.0, allowed=None, logprob_token_ids=asked[0])]
    pinned = run_workload(reqs, pipeline=True).logprobs["0"]
    assert pinned[0].top_ids == asked[0]
    assert pinned[0].top_logprobs == pytest.approx(top[0].top_logprobs[::-1])
    reqs = [_req(i, 0.0 if i % 2 else 0.9, allowed=None, structured_outputs=so, max_tokens=12,
                 logprob_token_ids=[12, 27, 28, 5]) for i in range(4)]
    kw = dict(grammar_vocab=FAKE_GRAMMAR_VOCAB, policy=policy)
    reference = run_workload(reqs, pipeline=False, **kw)
    monkeypatch.setattr(engine_module, "can_feed", lambda seq: True)
    forced = run_workload(reqs, pipeline=True, count_effects=True, **kw)
    assert (forced.engine.io.repicks if policy == FedAheadPolicy.REPICK_ONLY else forced.effects["trim"]) > 0
    assert forced.logprobs == reference.logprobs
    assert all(t.top_ids == [12, 27, 28, 5] for lps in forced.logprobs.values() for t in lps)
