"""`metrale bench throughput`: the offline LLM on random prompts, counted exactly, saved with vLLM's keys."""

from __future__ import annotations

import json

from click.testing import CliRunner

from metrale.bench import datasets
from metrale.cli import main
from metrale.frontend.tokenizer import Tokenizer

# vllm/benchmarks/throughput.py's --output-json keys; metrale adds the output-only two.
VLLM_KEYS = {"model_id", "elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"}


def test_throughput_counts_prompt_and_output_tokens(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    out = tmp_path / "throughput.json"
    res = CliRunner().invoke(main, ["bench", "throughput", "--model", str(model), "--num-prompts", "3",
                                    "--input-len", "8", "--output-len", "4", "--seed", "2",
                                    "--output-json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "requests/s" in res.output and "output tokens/s" in res.output
    result = json.loads(out.read_text())
    assert set(result) == VLLM_KEYS | {"total_output_tokens", "output_tokens_per_second"}
    tok = Tokenizer.from_dir(model)
    prompts = datasets.random_requests(tok, 3, 8, 4, seed=2)
    assert result["num_requests"] == 3 and result["total_output_tokens"] == 12
    assert result["total_num_tokens"] == 12 + sum(len(tok.encode(r.prompt)) for r in prompts)
    assert result["requests_per_second"] > 0
