"""`metrale bench serve` against a recorded fake OpenAI server: exact counts, vLLM's result keys; its datasets,
arrival times and metrics on their own."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from metrale.bench import datasets, metrics
from metrale.bench.arrivals import arrival_offsets
from metrale.bench.driver import RequestResult
from metrale.cli import main
from metrale.frontend.tokenizer import Tokenizer

from fake_openai import MODEL, fake_openai_server

# The keys vLLM 0.32's `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py: main_async's
# result_json, benchmark()'s result, less the per-request lists it drops without --save-detailed).
VLLM_BASE_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "latencies", "queue_times",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
}
VLLM_DETAILED_KEYS = {"input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"}


def vllm_metric_keys(metric_names: list[str], percentiles: list[str]) -> set[str]:
    """process_one_metric's keys: mean/median/std and one per percentile, for each selected metric."""
    return {f"{stat}_{m}_ms" for m in metric_names for stat in ["mean", "median", "std"] + [f"p{p}" for p in percentiles]}


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def bench(tmp_path, base_url, tokenizer_dir, *args: str) -> dict:
    """Run `metrale bench serve` through the CLI; the saved result JSON."""
    out = tmp_path / "result.json"
    cmd = ["bench", "serve", "--base-url", base_url, "--tokenizer", str(tokenizer_dir), "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", out.name, *args]
    res = CliRunner().invoke(main, cmd, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "Serving Benchmark Result" in res.output
    return json.loads(out.read_text())


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_counts_against_the_fake_server_are_exact(tmp_path, tokenizer_dir, endpoint):
    with fake_openai_server(fail={2}) as server:
        result = bench(tmp_path, server.base_url, tokenizer_dir, "--endpoint", endpoint, "--num-prompts", "8",
                       "--random-input-len", "12", "--random-output-len", "6", "--random-range-ratio", "0.5",
                       "--max-concurrency", "3", "--percentile-metrics", "ttft,tpot,itl,e2el",
                       "--metric-percentiles", "50,99", "--save-detailed")
    assert len(server.served) == 8
    ok = [s for s in server.served if not s.failed]
    assert result["completed"] == 7 and result["failed"] == 1
    assert result["total_output_tokens"] == sum(s.completion_tokens for s in ok)
    assert result["total_input_tokens"] == sum(s.prompt_tokens for s in ok)
    assert result["model_id"] == MODEL  # asked of /v1/models: no --model given
    assert sum(1 for e in result["errors"] if e) == 1 and "500" in next(e for e in result["errors"] if e)
    # Tokens come two to a chunk, so a request of n tokens has ceil(n / 2) - 1 inter-chunk gaps; a chat stream's
    # role chunk counts as one more (the first), as in vLLM's bench.
    by_len = sorted(len(itl) for itl, e in zip(result["itls"], result["errors"]) if not e)
    opening = 1 if endpoint.endswith("chat/completions") else 0
    assert by_len == sorted(math.ceil(s.completion_tokens / 2) - 1 + opening for s in ok)
    texts = sorted(t for t, e in zip(result["generated_texts"], result["errors"]) if not e)
    assert texts == sorted("tok " * s.completion_tokens for s in ok)
    assert all(s.body.get("ignore_eos") is True for s in server.served)  # random prompts: as vLLM does
    expected = VLLM_BASE_KEYS | VLLM_DETAILED_KEYS | vllm_metric_keys(["ttft", "tpot", "itl", "e2el"], ["50", "99"])
    assert set(result) == expected


def test_result_keys_equal_vllms_with_its_default_metrics_and_goodput(tmp_path, tokenizer_dir):
    with fake_openai_server() as server:
        result = bench(tmp_path, server.base_url, tokenizer_dir, "--model", MODEL, "--num-prompts", "4",
                       "--random-input-len", "8", "--random-output-len", "4", "--percentile-metrics", "ttft,tpot,itl",
                       "--goodput", "ttft:60000", "tpot:60000", "--request-rate", "200", "--seed", "3")
    assert set(result) == VLLM_BASE_KEYS | vllm_metric_keys(["ttft", "tpot", "itl"], ["99"])
    assert result["completed"] == 4 and result["total_output_tokens"] == 16
    # Every request meets a one-minute SLO: goodput is the request throughput.
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["request_rate"] == 200.0 and result["max_concurrency"] is None


def test_client_queue_metrics_under_max_concurrency_at_a_finite_rate(tmp_path, tokenizer_dir):
    with fake_openai_server() as server:
        result = bench(tmp_path, server.base_url, tokenizer_dir, "--num-prompts", "4", "--random-input-len", "8",
                       "--random-output-len", "3", "--max-concurrency", "1", "--request-rate", "500",
                       "--percentile-metrics", "e2el,client_queue_time,e2el_including_client_queue")
    assert set(result) == VLLM_BASE_KEYS | vllm_metric_keys(
        ["e2el", "client_queue_time", "e2el_including_client_queue"], ["99"])


def test_a_bad_goodput_is_refused_before_anything_is_sent(tmp_path, tokenizer_dir):
    with fake_openai_server() as server:
        res = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.base_url, "--tokenizer",
                                        str(tokenizer_dir), "--goodput", "latency:5", "--disable-tqdm"])
    assert res.exit_code == 2 and "latency" in res.output
    assert server.served == []


def test_random_prompts_have_the_drawn_lengths(tokenizer_dir):
    tok = Tokenizer.from_dir(tokenizer_dir)
    reqs = datasets.random_requests(tok, 20, input_len=24, output_len=10, range_ratio=0.25, prefix_len=5, seed=7)
    special = datasets.num_special_tokens(tok)
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))
        assert 5 + math.floor((24 - special) * 0.75) <= r.prompt_len <= 5 + math.ceil((24 - special) * 1.25)
        assert 7 <= r.expected_output_len <= 13
    assert len({r.prompt_len for r in reqs}) > 1 and len({r.expected_output_len for r in reqs}) > 1
    again = datasets.random_requests(tok, 20, input_len=24, output_len=10, range_ratio=0.25, prefix_len=5, seed=7)
    assert again == reqs
    prefix = tok.encode(reqs[0].prompt, add_special_tokens=False)[:4]
    assert all(tok.encode(r.prompt, add_special_tokens=False)[:4] == prefix for r in reqs)


def test_sharegpt_file_is_parsed_and_filtered(tmp_path, tokenizer_dir):
    tok = Tokenizer.from_dir(tokenizer_dir)
    long_text = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
    data = [
        {"conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": long_text + " # ok"}]},
        {"conversations": [{"from": "human", "value": "only one turn here, which is not enough"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_text}]},  # prompt too short
        {"id": "no conversations"},
        {"conversations": [{"from": "human", "value": long_text + " again"}, {"from": "gpt", "value": long_text}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = datasets.sharegpt_requests(str(path), tok, 2, shuffle=False)
    assert [r.prompt for r in reqs] == [long_text, long_text + " again"]
    assert [r.expected_output_len for r in reqs] == [len(tok.encode(long_text + " # ok")), len(tok.encode(long_text))]
    assert reqs[0].prompt_len == len(tok.encode(long_text))
    fixed = datasets.sharegpt_requests(str(path), tok, 5, output_len=3, seed=1)
    assert len(fixed) == 5 and {r.expected_output_len for r in fixed} == {3}  # oversampled to 5
    assert len({r.request_id for r in fixed}) == 5


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    poisson = arrival_offsets(50, 10.0, seed=1)
    assert poisson == sorted(poisson) and poisson[-1] == pytest.approx(5.0)
    assert poisson != arrival_offsets(50, 10.0, seed=2)
    assert arrival_offsets(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        arrival_offsets(4, 2.0, burstiness=0)


def test_metrics_follow_vllms_definitions():
    a = RequestResult(prompt_len=10, success=True, output_tokens=5, ttft=0.1, itl=[0.1] * 4, latency=0.5)
    b = RequestResult(prompt_len=20, success=True, output_tokens=1, ttft=0.3, latency=0.3, start_time=0.5)
    c = RequestResult(prompt_len=7, success=False, error="boom")
    m = metrics.compute([a, b, c], 2.0, None, [50.0], {"ttft": 200, "tpot": 150})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 30, 6)
    assert m.output_lens == [5, 1, 0]
    assert m.latencies["tpot"].mean == pytest.approx(100.0)  # (0.5 - 0.1) / 4, b has one token: no TPOT
    assert m.latencies["ttft"].median == pytest.approx(200.0)
    assert m.request_goodput == pytest.approx(0.5)  # only a meets TTFT <= 200 ms (b's TPOT counts as 0)
    assert m.output_throughput == pytest.approx(3.0) and m.total_token_throughput == pytest.approx(18.0)
    with pytest.raises(ValueError):
        metrics.parse_goodput(["ttft=5"])


def test_a_sharegpt_run_asks_for_each_replys_length(tmp_path, tokenizer_dir):
    tok = Tokenizer.from_dir(tokenizer_dir)
    turns = [("def add(a, b): return a + b  # numbers", "It adds two numbers and returns the sum."),
             ("class Stack: a list with push and pop methods", "Push appends; pop removes the last item.")]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                for q, a in turns]))
    with fake_openai_server() as server:
        result = bench(tmp_path, server.base_url, tokenizer_dir, "--dataset-name", "sharegpt", "--dataset-path",
                       str(path), "--num-prompts", "2", "--disable-shuffle")
    assert sorted(s.body["prompt"] for s in server.served) == sorted(q for q, _ in turns)  # sent at once: any order
    assert result["total_output_tokens"] == sum(len(tok.encode(a)) for _, a in turns)
    assert all("ignore_eos" not in s.body for s in server.served)  # only random prompts force it
