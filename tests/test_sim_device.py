"""The simulated device (gpu_worker/sim_runner.py): `metrale serve` around it streams its deterministic tokens,
pipelined and synchronous alike, and its step sleeps rather than spins."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from serve_fixture import running_server

from metrale.gpu_worker.sim_runner import SimRunner, StepCost, expected_tokens, write_weightless_model
from metrale.gpu_worker.worker import SIMULATE_ENV
from metrale.ipc.sampling import SamplingParams


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory):
    """A weightless model folder (config.json and tokenizer only) and its vocab size."""
    path = write_weightless_model(tmp_path_factory.mktemp("sim-model"), preset="test")
    return path, json.loads((path / "config.json").read_text())["vocab_size"]


def _workload(vocab: int):
    """Eight requests at once: a shared prefix, mixed lengths, penalties, a seed, a min_tokens row."""
    prefix = [1] + list(range(100, 140))
    rows = []
    for i in range(8):
        prompt = prefix + [200 + i] * (1 + i % 3) if i % 2 else [1, 300 + i, 301 + i]
        params = dict(max_tokens=6 + 3 * i, ignore_eos=True, temperature=0.0 if i % 3 else 0.8, seed=i)
        if i % 4 == 1:
            params.update(repetition_penalty=1.2, frequency_penalty=0.5)
        if i == 6:
            params.update(min_tokens=4)
        rows.append((prompt, SamplingParams(**params)))
    return rows


async def _stream_all(port: int, rows) -> list[list[int]]:
    from metrale import AsyncClient

    async def one(prompt, params, i):
        async with AsyncClient(port=port, timeout=60.0) as client:
            tokens = []
            async for delta in client.generate(token_ids=prompt, params=params, request_id=f"sim-{i}"):
                tokens += delta.token_ids
            return tokens

    return await asyncio.gather(*(one(p, sp, i) for i, (p, sp) in enumerate(rows)))


@pytest.mark.parametrize("mode", ["pipelined", "synchronous"])
def test_streams_equal_the_simulated_devices_tokens(sim_model, mode, monkeypatch):
    path, vocab = sim_model
    monkeypatch.setenv(SIMULATE_ENV, "0.5,0.001,0.001")
    rows = _workload(vocab)
    args = ["--no-pipeline"] if mode == "synchronous" else []
    with running_server(path, *args, ready_timeout=120.0) as server:
        got = asyncio.run(_stream_all(server.port, rows))
        assert "simulated device" in server.log()
    for (prompt, params), tokens in zip(rows, got):
        assert tokens == expected_tokens(prompt, params.max_tokens, vocab)


def test_a_step_sleeps_its_calibrated_time_and_feeds_the_next(sim_model, plans):
    path, vocab = sim_model
    runner = SimRunner(str(path), step_ms="20,0.5,0.25")
    bs = runner.info.block_size
    prompt, blocks = [1, 50, 60, 70, 80], plans.blocks_for(0, 64, bs)
    prefill = plans.make_plan([plans.Row(prompt, 0, blocks)], block_size=bs)
    wall, cpu = time.perf_counter(), time.process_time()
    first = runner.execute(prefill)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    want = StepCost(20, 0.5, 0.25).seconds(1, len(prompt))
    assert want <= wall < want + 0.05
    assert cpu < want / 2  # slept, not spun
    fed = plans.make_plan([plans.Row([0], len(prompt), blocks, feed_from_row=0)], block_size=bs)
    second = runner.execute(fed)  # its input is the first step's token, taken on the "device"
    assert [int(first.tokens[0]), int(second.tokens[0])] == expected_tokens(prompt, 2, vocab)


def test_step_cost_parses_a_b_c_in_ms():
    assert StepCost.parse("") == StepCost()
    assert StepCost.parse("5, 0.01, 0.002").seconds(100, 200) == pytest.approx((5 + 1 + 0.4) / 1e3)
    with pytest.raises(ValueError):
        StepCost.parse("5,1")
    with pytest.raises(ValueError):
        StepCost.parse("-1,0,0")


def test_prompt_logprobs_are_zero_for_every_asked_position(sim_model, plans):
    """The simulated device answers a prefill that asks for prompt logprobs with 0.0 per asked position (as it
    gives 0.0 for sampled tokens), so the engine gets one entry per prompt token."""
    path, _ = sim_model
    runner = SimRunner(str(path), step_ms="0,0,0")
    bs = runner.info.block_size
    plan = plans.make_plan([plans.Row([1, 50, 60, 70], 0, plans.blocks_for(0, 64, bs))], block_size=bs)
    plan.prompt_lp_n[0], plan.prompt_lp_count[0] = 2, 3
    assert runner.execute(plan).prompt_logprobs.tolist() == [0.0, 0.0, 0.0]
    assert runner.execute(plans.make_plan([plans.Row([5], 0, plans.blocks_for(1, 64, bs))], block_size=bs)).prompt_logprobs is None
