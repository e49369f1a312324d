"""Decode graphs on a CPU: the bucketed persistent buffers and their padding give the eager path's tokens.

On a CPU the wrapper calls the same forward a CUDA graph captures, over the same buffers, so bucketing,
padding and the buffers are checked here; the capture itself runs in scripts/gpu_check.sh.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale.config import EngineArgs
from metrale.gpu_worker.graph_runner import batch_buckets
from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.model_runner import ModelRunner

MAX_LEN = 64
STEPS = 4


def _runner(path, graphs, **kw):
    return ModelRunner(path, device="cpu", num_kv_blocks=256, max_num_seqs=32, show_progress=False, decode_graphs=graphs, **kw)


def _prompts(n, vocab=2048, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(16, vocab, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]


def _generate(runner, plans, prompts, steps=STEPS, **row_kw):
    """Prefill, then `steps` decode steps fed on the device; tokens [rows, steps + 1]."""
    out = [runner.execute(plans.make_plan([plans.Row(p, 0, plans.blocks_for(i, MAX_LEN), **row_kw) for i, p in enumerate(prompts)])).tokens]
    for k in range(steps):
        rows = [plans.Row([0], len(p) + k, plans.blocks_for(i, MAX_LEN), feed_from_row=i, **row_kw) for i, p in enumerate(prompts)]
        out.append(runner.execute(plans.make_plan(rows)).tokens)
    return np.stack(out, axis=1)


def test_buckets_are_the_small_sizes_then_steps_of_16_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("rows", [3, 5, 17])
def test_graph_tokens_equal_eager_tokens_between_buckets(tiny_model_dir, plans, rows):
    path = tiny_model_dir("llama")
    prompts = _prompts(rows)
    eager = _generate(_runner(path, False), plans, prompts)
    graphed = _runner(path, True)
    assert graphed.graphs is not None and graphed.graphs.bucket_for(rows) > rows  # padding rows are run
    np.testing.assert_array_equal(_generate(graphed, plans, prompts), eager)


def test_graph_tokens_equal_eager_tokens_when_sampling(tiny_model_dir, plans):
    path = tiny_model_dir("llama")
    prompts = _prompts(6, seed=3)
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    np.testing.assert_array_equal(_generate(_runner(path, True), plans, prompts, **kw), _generate(_runner(path, False), plans, prompts, **kw))


def test_graph_tokens_equal_eager_on_the_torch_path_with_a_window(tiny_model_dir, plans, monkeypatch):
    # The torch attention path reads the masks the graph computes from the lengths on the device; a sliding
    # window shorter than the prompts makes them cut keys off the front too.
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    path = tiny_model_dir("mistral", sliding_window=8)
    prompts = _prompts(3, seed=1)
    graphed = _runner(path, True)
    assert graphed.model.windows == {8} and graphed.model.uses_masked_decode
    np.testing.assert_array_equal(_generate(graphed, plans, prompts), _generate(_runner(path, False), plans, prompts))


def test_padding_rows_write_only_the_scratch_block(tiny_model_dir, plans):
    runner = _runner(tiny_model_dir("llama"), True)
    cache = runner.kv_cache
    prompts = _prompts(3)  # bucket 4: one padding row per decode step
    owned = sorted({b for i in range(len(prompts)) for b in plans.blocks_for(i, MAX_LEN)})
    before_k = [k.clone() for k in cache.k]
    before_v = [v.clone() for v in cache.v]
    _generate(runner, plans, prompts)
    others = np.setdiff1d(np.arange(cache.num_blocks), owned)
    for layer in range(len(cache.k)):
        assert torch.equal(cache.k[layer][others], before_k[layer][others])
        assert torch.equal(cache.v[layer][others], before_v[layer][others])
        assert not torch.equal(cache.v[layer][cache.scratch_block], before_v[layer][cache.scratch_block])
    assert cache.scratch_block == runner.info.num_kv_blocks  # the engine is never told about it


def test_a_plan_naming_the_scratch_block_is_refused(tiny_model_dir, plans):
    runner = _runner(tiny_model_dir("llama"), True)
    scratch = runner.kv_cache.scratch_block
    with pytest.raises(ValueError, match="outside the KV cache"):
        runner.execute(plans.make_plan([plans.Row([5, 6, 7], 0, [scratch])]))


def test_decode_steps_reuse_the_graph_buffers_and_skip_the_eager_path(tiny_model_dir, plans, monkeypatch):
    runner = _runner(tiny_model_dir("llama"), True)
    g = runner.graphs
    buffers = (g.input_ids, g.positions, g.slots, g.block_tables, g.seq_lens, *g.first_keys.values())
    pointers = [b.data_ptr() for b in buffers]
    prompts = _prompts(5)
    runner.execute(plans.make_plan([plans.Row(p, 0, plans.blocks_for(i, MAX_LEN)) for i, p in enumerate(prompts)]))
    eager = runner._prepare
    monkeypatch.setattr(runner, "_prepare", lambda *a: pytest.fail("a decode step ran eager"))
    for k in range(STEPS):
        rows = [plans.Row([0], len(p) + k, plans.blocks_for(i, MAX_LEN), feed_from_row=i) for i, p in enumerate(prompts)]
        runner.execute(plans.make_plan(rows))
    assert [b.data_ptr() for b in buffers] == pointers
    monkeypatch.setattr(runner, "_prepare", eager)
    np.testing.assert_array_equal(g.seq_lens[:8].numpy(), [len(p) + STEPS for p in prompts] + [1, 1, 1])


def test_graphs_are_off_by_default_on_a_cpu_and_under_enforce_eager(tiny_model_dir):
    path = tiny_model_dir("llama")
    runner = _runner(path, None)
    assert runner.graphs is None and runner.kv_cache.scratch_block is None
    args = EngineArgs(enforce_eager=True)
    assert args.runner_kwargs(str(path))["decode_graphs"] is False
    assert EngineArgs().runner_kwargs(str(path))["decode_graphs"] is None


def test_serve_enforce_eager_reaches_the_engine_args(monkeypatch):
    from click.testing import CliRunner

    from metrale import cli, supervisor

    seen = {}

    class Stop(Exception):
        pass

    def fake_supervisor(config):
        seen["engine"] = config.engine
        raise Stop

    monkeypatch.setattr(supervisor, "Supervisor", fake_supervisor)
    monkeypatch.setattr(cli, "_check_device", lambda device: None)
    result = CliRunner().invoke(cli.main, ["serve", "--enforce-eager"])
    assert isinstance(result.exception, Stop), result.output
    assert seen["engine"].enforce_eager is True


def test_graphs_that_cannot_be_built_leave_the_runner_eager(tiny_model_dir, plans, monkeypatch):
    from metrale.gpu_worker import graph_runner

    def fail(*a, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graph_runner.DecodeGraphs, "__init__", fail)
    path = tiny_model_dir("llama")
    runner = _runner(path, True)
    assert runner.graphs is None
    prompts = _prompts(3)
    np.testing.assert_array_equal(_generate(runner, plans, prompts), _generate(_runner(path, False), plans, prompts))
