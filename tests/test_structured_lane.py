"""Structured outputs in the engine core (FakeDevice): grammar rows follow their grammar, and the pipelined lane
streams what the synchronous loop streams with them, even when a bitmask goes stale."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.engine_core import engine as engine_module
from metrale.engine_core.engine import EngineCore
from metrale.testing.fake_device import FakeDevice
from metrale.engine_core.kv_blocks import KvBlockPool
from metrale.ipc.errors import Refused
from metrale.ipc.plan import FedAheadPolicy
from metrale.ipc.sampling import SamplingParams, StructuredOutputs

from engine_harness import Req, run_workload
from fake_grammars import FAKE_GRAMMAR_VOCAB, compiled, text_of

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 999}, "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["a", "b"],
}
CONSTRAINTS = [
    (StructuredOutputs(regex="[0-9]{2,4}(ab|cd)"), lambda text: re.fullmatch("[0-9]{2,4}(ab|cd)", text)),
    (StructuredOutputs(choice=["true", "false", "abc"]), lambda text: text in ("true", "false", "abc")),
    (StructuredOutputs(json=SCHEMA), lambda text: _valid(text)),
]


def _valid(text: str) -> bool:
    """True when text is a JSON object of SCHEMA's shape."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value.get("a"), int) and all(v in ("x", "y") for v in value["b"]) and len(value["b"]) <= 3


def _req(i: int, constraint: int, temperature: float, prompt: list[int] | None = None, **kw) -> Req:
    """A request under CONSTRAINTS[constraint] (-1: none) with enough room to finish its grammar."""
    so = CONSTRAINTS[constraint][0] if constraint >= 0 else None
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 60), temperature=temperature, seed=100 + i,
                            structured_outputs=so, **kw)
    return Req(prompt or [5 + i % 30, 9, 11], params, grammar=compiled(so) if so else None)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("constraint", range(len(CONSTRAINTS)))
def test_grammar_rows_follow_their_grammar(constraint, temperature):
    """Regex, choice and JSON schema: every output (greedy and seeded) is in the grammar's language and stops."""
    reqs = [_req(i, constraint, temperature) for i in range(4)]
    run = run_workload(reqs, pipeline=True, grammar_vocab=FAKE_GRAMMAR_VOCAB)
    _, holds = CONSTRAINTS[constraint]
    for i in range(4):
        assert run.finish[str(i)] == "stop", run.errors
        assert holds(text_of(run.streams[str(i)])), text_of(run.streams[str(i)])


@st.composite
def mixed_requests(draw) -> Req:
    i = draw(st.integers(0, 1000))
    constraint = draw(st.sampled_from([-1, 0, 1, 2]))
    temperature = draw(st.sampled_from([0.0, 0.0, 0.8]))
    prompt = draw(st.lists(st.integers(4, 47), min_size=1, max_size=12))
    req = _req(i, constraint, temperature, prompt, max_tokens=draw(st.integers(1, 40)), ignore_eos=draw(st.booleans()))
    req.arrive_tick = draw(st.integers(0, 15))
    req.abort_after = draw(st.one_of(st.none(), st.none(), st.integers(0, 8)))
    return req


def feed_every_row(monkeypatch) -> None:
    """Let the lane feed grammar rows from the device's token (their bitmasks are then made a token early)."""
    monkeypatch.setattr(engine_module, "can_feed", lambda seq: not seq.params.has_penalties)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(mixed_requests(), min_size=1, max_size=8), pool=st.integers(14, 40), seqs=st.sampled_from([2, 4, 8]))
def test_pipelined_equals_synchronous_with_grammar_rows(monkeypatch, reqs, pool, seqs):
    """Grammar rows beside plain ones, arrivals, aborts, stops and a dry pool (preemption): the lane streams what
    the synchronous loop streams, greedy and seeded, on a device that runs steps at launch or only when awaited;
    forced to feed grammar rows ahead (their bitmasks then go stale), it still does."""
    kw = dict(grammar_vocab=FAKE_GRAMMAR_VOCAB, max_num_seqs=seqs)
    reference = run_workload(reqs, pipeline=False, **kw)
    for extra in ({}, {"num_kv_blocks": pool}, {"deferred": True}, {"forced": True}):
        with monkeypatch.context() as m:
            if extra.pop("forced", False):
                feed_every_row(m)
            piped = run_workload(reqs, pipeline=True, **kw, **extra)
        assert piped.streams == reference.streams
        assert piped.finish == reference.finish


def _stale_workload() -> list[Req]:
    """Grammar rows (greedy and seeded) batched with plain rows, long enough for many launches ahead."""
    return [_req(i, i % 3, 0.0 if i % 2 else 0.8) for i in range(4)] + [_req(9, -1, 0.0, max_tokens=30, ignore_eos=True)]


def test_rewind_stale_grammar_mask_redoes_the_row(monkeypatch):
    """Feed grammar rows ahead anyway: validation finds each bitmask made a token early and runs the row again."""
    reqs = _stale_workload()
    reference = run_workload(reqs, pipeline=False, grammar_vocab=FAKE_GRAMMAR_VOCAB)
    feed_every_row(monkeypatch)
    forced = run_workload(reqs, pipeline=True, grammar_vocab=FAKE_GRAMMAR_VOCAB, count_effects=True)
    assert forced.effects["trim"] > 0, "no stale bitmask was met: the test did not test"
    assert forced.streams == reference.streams


@pytest.mark.parametrize("num_state_slots", [0, 8])
def test_repick_only_stale_grammar_mask_is_sampled_on_the_host(monkeypatch, num_state_slots):
    """RepickOnly: the stale bitmask's forward stands and the host picks under the grammar's current mask; with
    state slots (a recurrent model, whose slots must hold exactly each row's context) too."""
    reqs = _stale_workload()
    kw = dict(grammar_vocab=FAKE_GRAMMAR_VOCAB, policy=FedAheadPolicy.REPICK_ONLY, num_state_slots=num_state_slots)
    reference = run_workload(reqs, pipeline=False, **kw)
    feed_every_row(monkeypatch)
    forced = run_workload(reqs, pipeline=True, count_effects=True, **kw)
    assert forced.effects["resample"] > 0, "no stale bitmask was met: the test did not test"
    assert forced.streams == reference.streams
    assert forced.engine.io.repicks > 0


def test_grammar_rows_wait_for_their_commit_while_plain_rows_run_ahead(monkeypatch):
    """A grammar row is never fed from the device (its next bitmask needs the token in flight), so it is never
    discarded; the plain row beside it is fed (and over-runs only at its finish)."""
    rolled_back = []
    trim = KvBlockPool.trim

    def recording(pool, seq, num_tokens):
        rolled_back.append(seq.request_id)
        return trim(pool, seq, num_tokens)

    monkeypatch.setattr(KvBlockPool, "trim", recording)
    reqs = [_req(0, 2, 0.0), _req(1, -1, 0.0, max_tokens=30, ignore_eos=True)]
    run = run_workload(reqs, pipeline=True, grammar_vocab=FAKE_GRAMMAR_VOCAB)
    assert run.finish["0"] == "stop" and "0" not in rolled_back
    assert any(r.fed for r in run.device.records)


def test_a_resubmitted_request_continues_its_grammar():
    """Resubmitted with the tokens already streamed (an engine-core restart), a grammar row ends as it would have."""
    whole = run_workload([_req(0, 2, 0.8)], pipeline=True, grammar_vocab=FAKE_GRAMMAR_VOCAB)
    tokens = whole.streams["0"]
    eng = EngineCore(FakeDevice(block_size=4))
    eng.set_grammar_vocab(FAKE_GRAMMAR_VOCAB)
    r = _req(0, 2, 0.8)
    eng.add_request("again", r.prompt, r.params, tokens[:5], grammar=r.grammar)
    rest = []
    while eng.has_unfinished():
        for d in eng.step():
            rest += d.new_token_ids
    assert tokens[:5] + rest == tokens


def test_grammar_requests_are_refused_without_a_vocabulary_or_with_output_it_forbids():
    """No GrammarVocab yet, no compiled grammar, or resubmitted tokens the grammar does not allow: bad_request."""
    r = _req(0, 0, 0.0)
    eng = EngineCore(FakeDevice(block_size=4))
    with pytest.raises(Refused, match="no grammar vocabulary"):
        eng.add_request("a", r.prompt, r.params, grammar=r.grammar)
    eng.set_grammar_vocab(FAKE_GRAMMAR_VOCAB)
    with pytest.raises(Refused, match="compiled grammar"):
        eng.add_request("b", r.prompt, r.params)
    with pytest.raises(Refused, match="does not allow output token"):
        eng.add_request("c", r.prompt, r.params, [22], grammar=r.grammar)  # "a": the regex starts with a digit
    eng.add_request("d", r.prompt, r.params, [12, 13], grammar=r.grammar)  # "01" is a fine start
