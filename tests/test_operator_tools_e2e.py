"""`metrale bench serve` and `metrale top` against a live `metrale serve --http-port` on the tiny model."""

from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from metrale.bench import datasets
from metrale.cli import main
from metrale.frontend.tokenizer import Tokenizer
from metrale.ipc.sampling import SamplingParams
from metrale.top.snapshot import Sampler
from metrale.top.view import render

from serve_fixture import http_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with http_server(model_dir) as s:
        yield s


def bench(tmp_path, server, model_dir, *args: str) -> dict:
    out = tmp_path / "result.json"
    res = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.http, "--model", str(model_dir),
                                    "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                                    "--result-filename", out.name, "--seed", "5", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_bench_serve_counts_metrale_serve_exactly(tmp_path, server, model_dir):
    result = bench(tmp_path, server, model_dir, "--num-prompts", "4", "--random-input-len", "16",
                   "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "2")
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["output_lens"] == [8] * 4 and result["total_output_tokens"] == 32
    # The server counts each prompt as its tokenizer encodes it (with BOS): the same prompts, drawn again.
    tok = Tokenizer.from_dir(model_dir)
    prompts = datasets.random_requests(tok, 4, 16, 8, seed=5)
    assert result["input_lens"] == [len(tok.encode(r.prompt)) for r in prompts]
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert all(len(itl) <= 7 for itl in result["itls"])  # at most one gap per token after the first


def test_bench_serve_chat_counts_exactly(tmp_path, server, model_dir):
    result = bench(tmp_path, server, model_dir, "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                   "--random-input-len", "12", "--random-output-len", "6", "--ignore-eos")
    assert (result["completed"], result["total_output_tokens"]) == (2, 12), result["errors"]
    assert result["backend"] == "openai-chat"


def test_top_renders_a_live_frame_with_real_pids_and_counters(server, model_dir):
    prompt = "def fibonacci(n):"
    with server.client() as client:
        before = client.server_stats().frontend.prompt_tokens
        for _ in range(2):
            done = client.complete(prompt, params=SamplingParams(max_tokens=5, ignore_eos=True, temperature=0))
            assert len(done.token_ids) == 5
        sampler = Sampler(client, "127.0.0.1", server.port)
        sampler.sample()
        snap = sampler.sample()
        stats = client.stats()
    pids = server.children()
    assert {p.pid for p in snap.processes} == set(pids.values())
    assert all(p.rss_bytes and p.cpu_percent is not None for p in snap.processes)
    assert snap.stats.generated_tokens == stats.generated_tokens >= 10
    assert snap.frontend.ttft_samples >= 2 and snap.frontend.itl_samples >= 2
    assert snap.frontend.prompt_tokens - before == 2 * len(Tokenizer.from_dir(model_dir).encode(prompt))
    assert snap.tokens_out_per_s == 0.0  # nothing ran between the two looks
    console = Console(file=io.StringIO(), width=140, record=True, color_system=None)
    console.print(render(snap))
    text = console.export_text()
    for name, pid in pids.items():
        assert name in text and str(pid) in text
    assert str(stats.generated_tokens) in text and "healthy" in text, text  # the frame says why when not
    # The frame's own sample: a finished request's blocks may be freed on a tick between the frame and `stats`.
    assert f"{snap.stats.kv_blocks_used} / {snap.stats.kv_blocks_total}" in text
