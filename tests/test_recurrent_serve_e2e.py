"""A recurrent model (Bamba: Mamba 2 state in state slots, RepickOnly) through `metrale serve`: the pipelined lane
streams what the synchronous loop streams, with its stale masks repaired on the host from the worker's logits."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from metrale import LLM, SamplingParams
from metrale.frontend.client import AsyncClient
from metrale.gpu_worker.tiny_model import SPECIAL_TOKENS, THINK

from conftest import expected_kernels
from serve_fixture import running_server

N = 12


def _prompts() -> list[list[int]]:
    """Token prompts that open a thinking block (as a reasoning template does)."""
    think = SPECIAL_TOKENS.index(THINK)
    return [[20 + 7 * i + j for j in range(3 + i % 5)] + [think] for i in range(N)]


def _params(i: int) -> SamplingParams:
    """A thinking budget of a few tokens (the step after each forced </think> goes stale), min_tokens; greedy
    and seeded rows."""
    return SamplingParams(
        max_tokens=16, min_tokens=8, max_thinking_tokens=1 + i % 4, temperature=0.0 if i % 2 else 0.9,
        top_k=0 if i % 3 else 20, seed=500 + i,
    )


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return hf_model_dir("bamba")


def test_pipelined_serve_streams_what_the_synchronous_loop_streams_with_repairs_counted(model_dir):
    with LLM(str(model_dir), show_progress=False, pipeline=False) as sync:
        reference = sync.generate(_prompts(), [_params(i) for i in range(N)])
        assert sync.stats().repicks == 0
    with running_server(model_dir, "--max-num-seqs", "8") as server:
        got = asyncio.run(_stream_all(server.port))
        for i, (ids, finish) in enumerate(got):
            assert ids == reference[i].token_ids, f"request {i}"
            assert finish == reference[i].finish_reason
        with server.client() as client:
            stats = client.stats()
        assert stats.repicks > 0, "no stale mask was repaired: the test did not test"
        status = subprocess.run(
            [sys.executable, "-m", "metrale.cli", "status", "--port", str(server.port)],
            capture_output=True, text=True, timeout=60,
        )
        assert f"{stats.repicks} repicks" in status.stdout, status.stdout  # nothing runs: it stays put
        assert stats.kernels == expected_kernels() and f"{stats.kernels} kernels" in status.stdout, status.stdout


async def _stream_all(port: int) -> list[tuple[list[int], str | None]]:
    """Every prompt at once; each one's token ids and finish reason."""
    async with AsyncClient("127.0.0.1", port, timeout=120) as client:

        async def one(i: int):
            ids, finish = [], None
            async for d in client.generate(token_ids=_prompts()[i], params=_params(i)):
                ids += d.token_ids
                finish = d.finish_reason or finish
            return ids, finish

        return await asyncio.gather(*(one(i) for i in range(N)))
