"""Decode bursts (engine_core/step_kinds.py): several decode steps per tick give exactly the single steps' tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from metrale import LLM, SamplingParams
from metrale.engine_core.step_kinds import burst_length
from metrale.engine_core.sequence import Sequence
from metrale.testing.invariants import check_pool


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _mixed_params(stop_id: int | None = None) -> list[SamplingParams]:
    """Greedy and seeded rows, logprobs on some, max_tokens that end rows inside and at the end of bursts."""
    return [
        SamplingParams(
            max_tokens=9 + 5 * i,
            temperature=0.0 if i % 2 else 0.8,
            seed=100 + i,
            logprobs=2 if i % 3 == 0 else None,
            stop_token_ids=[] if stop_id is None or i % 2 else [stop_id],
        )
        for i in range(10)
    ]


def _run(model_dir, prompts, params, burst: int):
    with LLM(str(model_dir), show_progress=False, max_num_seqs=16, decode_burst=burst) as llm:
        outs = llm.generate(prompts, params)
        launches = llm.device._next_seq  # tickets: one per step, or per burst
        pool = llm.engine.pool
        check_pool(pool)
        assert pool.num_used == 0, "a burst's reserved blocks outlived its requests"
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs], launches


def test_bursts_give_the_single_steps_tokens_logprobs_and_finishes(tiny_model_dir):
    """10 requests, greedy and seeded, some with logprobs, some stopping on a stop id inside a burst."""
    model = tiny_model_dir("llama")
    prompts = _prompts(10, seed=5)
    single, _ = _run(model, prompts, _mixed_params(), burst=1)
    # A stop id that request 0 (seeded) reaches at its 4th token: it stops inside the first burst.
    stop_id = single[0][0][3]
    single, single_launches = _run(model, prompts, _mixed_params(stop_id), burst=1)
    burst, burst_launches = _run(model, prompts, _mixed_params(stop_id), burst=8)
    assert burst == single
    assert single[0][1] == "stop" and len(single[0][0]) <= 4
    assert burst_launches < single_launches / 2, "the batch never ran as bursts"


def test_a_streamed_request_keeps_the_batch_at_one_token_per_tick(tiny_model_dir):
    """A request with stop strings is detokenized as it goes: with it in the batch, no tick bursts."""
    model = tiny_model_dir("llama")
    prompts = _prompts(3, seed=6)
    params = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.0, stop=["\x00never"])]
    params.append(SamplingParams(max_tokens=24, temperature=0.0))
    single, single_launches = _run(model, prompts, params, burst=1)
    burst, burst_launches = _run(model, prompts, params, burst=8)
    assert burst == single
    assert burst_launches == single_launches


def _seq(max_tokens=50, *, out=0, stream=False, plain=True, prompt=10) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, presence_penalty=0.0 if plain else 0.5)
    return Sequence.of("r", params, 0, list(range(prompt + out)), prompt, 0, stream=stream)


@pytest.mark.parametrize(
    "rows, expected",
    [
        ([_seq(), _seq()], 8),
        ([_seq(), _seq(stream=True)], 1),  # someone reads it token by token
        ([_seq(), _seq(plain=False)], 1),  # its next pick may depend on the token before
        ([_seq(max_tokens=20, out=17), _seq()], 3),  # ends at the burst's last step
        ([_seq(prompt=60)], 4),  # the model's context (64) ends it
    ],
)
def test_burst_length(rows, expected):
    assert burst_length(rows, 8, 1, max_model_len=64) == expected


def test_streamed_rows_burst_up_to_their_stream_interval():
    assert burst_length([_seq(stream=True), _seq(stream=True)], 8, 4, max_model_len=64) == 4
    assert burst_length([_seq(stream=True), _seq()], 8, 4, max_model_len=64) == 4  # the stricter row
    assert burst_length([_seq(), _seq()], 1, 4, max_model_len=64) == 1  # final-only rows: bursts off


def test_execute_burst_refuses_a_prefill_plan(tiny_model_dir, plans):
    """A burst moves decode rows one position on: a chunk of several tokens is a ValueError, nothing runs."""
    from metrale.gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir("llama"), num_kv_blocks=64, show_progress=False)
    plan = plans.make_plan([plans.Row(list(range(5, 12)), 0, [1, 2])])
    with pytest.raises(ValueError, match="one token per row"):
        runner.execute_burst(plan, 4)
    assert runner.steps_executed == 0
    assert np.all(plan.positions == np.arange(7))
