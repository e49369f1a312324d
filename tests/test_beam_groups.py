"""Beam search in the engine core (engine_core/beam_groups.py) on FakeDevice, whose toy model reads every row's
context back through its block table: a beam forked onto the wrong blocks, or a partial block copied wrong, changes
its logits. Each search must equal metrale.beam_search.BeamSearch fed the toy model's distribution of each beam's
own tokens, beside other requests, pipelined or not, under preemption and aborts, with every block given back."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.beam_search import BeamSearch, BeamSearchParams
from metrale.engine_core.engine import EngineCore, EngineOptions
from metrale.ipc.sampling import SamplingParams
from metrale.testing.fake_device import FakeDevice
from metrale.testing.invariants import check_pool

VOCAB = 32
EOS = 1


def reference(device: FakeDevice, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    """The search BeamSearch makes of the toy model's distributions, computed from each beam's tokens directly."""
    search = BeamSearch(prompt, params, (EOS,))
    k = search.num_logprobs
    while not search.done:
        rows = []
        for tokens in search.next_inputs():
            z = device._logits_for(np.array(tokens)).astype(np.float64)
            z -= z.max()
            rows.append((z - np.log(np.exp(z).sum())).astype(np.float32))
        logp = np.array(rows)
        top = np.argsort(-logp, axis=1, kind="stable")[:, :k]
        search.advance(top, np.take_along_axis(logp, top, axis=1))
    return [(s.output_ids, s.score) for s in search.results()]


def got(delta) -> list[tuple[list[int], float]]:
    return [(h.token_ids, h.score) for h in delta.beams]


def run(engine: EngineCore, limit: int = 2000) -> dict:
    """Step until idle; every request's final delta (with its tokens gathered), by id."""
    finals, tokens = {}, {}
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                finals[d.request_id] = (d, tokens[d.request_id])
    assert not engine.has_unfinished()
    return finals


def assert_all_given_back(engine: EngineCore) -> None:
    pool = engine.pool
    check_pool(pool)
    assert pool.num_used == 0
    assert not engine.scheduler.running and not engine.scheduler.num_waiting and not engine.scheduler.swapped


PROMPTS = [[5, 9, 3, 7, 11, 2, 6], [4, 4, 8], [13, 2, 21, 9, 30, 17, 5, 6, 22, 3, 14]]
SEARCHES = [BeamSearchParams(4, 12), BeamSearchParams(2, 9, length_penalty=0.5),
            BeamSearchParams(3, 10, early_stopping=True, include_stop_str_in_output=True)]


def _engine(pipeline: bool, **device_kw) -> tuple[FakeDevice, EngineCore]:
    device = FakeDevice(vocab_size=VOCAB, eos_token_ids=(EOS,), **device_kw)
    engine = EngineCore(device, EngineOptions(pipeline=pipeline, max_num_batched_tokens=64, max_num_seqs=32,
                                              preemption_mode="swap" if device_kw.get("num_swap_blocks") else
                                              "recompute"))
    return device, engine


def _add_all(engine: EngineCore) -> None:
    for i, (prompt, params) in enumerate(zip(PROMPTS, SEARCHES)):
        engine.add_beam_request(f"beam{i}", prompt, params)
        engine.add_request(f"plain{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        engine.add_request(f"sampled{i}", prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=i))


@pytest.mark.parametrize("pipeline", [True, False])
def test_searches_beside_other_requests_equal_the_reference(pipeline):
    """Three searches (widths 4, 2, 3) and six ordinary requests at once: each search equals BeamSearch on the toy
    model; the ordinary requests' tokens equal a run without the searches; every block comes back."""
    device, engine = _engine(pipeline)
    _add_all(engine)
    finals = run(engine)
    for i, (prompt, params) in enumerate(zip(PROMPTS, SEARCHES)):
        delta, _ = finals[f"beam{i}"]
        assert delta.finish_reason == "stop" and len(delta.beams) == params.beam_width
        assert got(delta) == reference(device, prompt, params)
    assert_all_given_back(engine)
    _, alone = _engine(pipeline)
    for i, prompt in enumerate(PROMPTS):
        alone.add_request(f"plain{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        alone.add_request(f"sampled{i}", prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=i))
    for rid, (_, tokens) in run(alone).items():
        assert finals[rid][1] == tokens


def test_pipelined_and_synchronous_give_the_same_hypotheses():
    outs = []
    for pipeline in (True, False):
        _, engine = _engine(pipeline)
        _add_all(engine)
        outs.append({rid: (got(d) if d.beams else None, tokens) for rid, (d, tokens) in run(engine).items()})
    assert outs[0] == outs[1]


def test_a_forked_beam_shares_its_parents_blocks_and_copies_its_partial_block_on_the_device():
    """Block size 4: after the prompt, every step of a width-4 search runs one token per beam (a fork shares its
    parent's full blocks and gets its partial block copied, ipc/plan.py's device copies), never a recompute."""
    device, engine = _engine(False)
    plans = []
    launch = device.launch

    def recording(plan, *args, **kw):
        plans.append((len(plan.positions), len(plan.seq_lens), int((plan.swap_in[:, 0] < 0).sum())))
        return launch(plan, *args, **kw)

    device.launch = recording
    prompt, params = PROMPTS[0], BeamSearchParams(4, 12, ignore_eos=True)
    engine.add_beam_request("b", prompt, params)
    (delta, _), = run(engine).values()
    assert got(delta) == reference(device, prompt, params)
    assert plans[0][:2] == (len(prompt), 1)
    assert all(tokens == rows for tokens, rows, _ in plans[1:])  # decodes only
    assert sum(copies for _, _, copies in plans) > 0
    assert_all_given_back(engine)


@pytest.mark.parametrize("pipeline", [True, False])
def test_an_abort_at_any_tick_ends_the_search_and_gives_every_block_back(pipeline):
    for at in range(0, 14):
        _, engine = _engine(pipeline)
        _add_all(engine)
        for _ in range(at):
            engine.step()
        engine.abort("beam0")
        engine.abort("beam2")
        finals = run(engine)
        for rid in ("beam0", "beam2"):
            if rid in finals and finals[rid][0].beams is None:
                assert finals[rid][0].finish_reason == "abort"
        assert_all_given_back(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("pipeline", [True, False])
def test_a_small_kv_pool_preempts_beam_rows_and_the_searches_still_equal_the_reference(mode, pipeline):
    """14 blocks of 4 tokens for three searches of up to 4 beams and ordinary requests: rows are preempted (their KV
    recomputed or swapped), and every search still equals the reference."""
    device, engine = _engine(pipeline, num_kv_blocks=14, num_swap_blocks=64 if mode == "swap" else 0)
    _add_all(engine)
    finals = run(engine, limit=5000)
    assert engine.scheduler.num_preemptions > 0
    for i, (prompt, params) in enumerate(zip(PROMPTS, SEARCHES)):
        assert got(finals[f"beam{i}"][0]) == reference(device, prompt, params)
    assert_all_given_back(engine)


def test_a_recurrent_model_runs_forked_beams_from_their_whole_sequence():
    """A model with state slots cannot share a parent's state: a forked beam waits and recomputes its sequence."""
    device, engine = _engine(True, num_state_slots=8)
    for i, (prompt, params) in enumerate(zip(PROMPTS, SEARCHES)):
        engine.add_beam_request(f"beam{i}", prompt, params)
    finals = run(engine)
    for i, (prompt, params) in enumerate(zip(PROMPTS, SEARCHES)):
        assert got(finals[f"beam{i}"][0]) == reference(device, prompt, params)
    assert_all_given_back(engine)


def test_a_search_that_cannot_fit_is_refused_before_it_runs():
    from metrale.ipc.errors import Refused

    _, engine = _engine(True, num_kv_blocks=4)
    with pytest.raises(Refused, match="max_tokens"):
        engine.add_beam_request("b", [5, 6, 7], BeamSearchParams(2, 14))
    with pytest.raises(Refused, match="beam_width"):
        engine.add_beam_request("b", [5, 6, 7], BeamSearchParams(11, 4))
    assert not engine.has_unfinished()
