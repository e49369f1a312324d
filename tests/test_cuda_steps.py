"""The GPU path on CUDA: decode steps queue without a host sync, captured decode graphs give the eager tokens,
and the Triton backend gives the torch path's. Skipped without CUDA (scripts/gpu_check.sh runs them on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale.gpu_worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MAX_LEN = 64


def _runner(path, **kw):
    return ModelRunner(path, device="cuda", num_kv_blocks=256, max_num_seqs=32, show_progress=False, **kw)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(16, 2000, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]


def _prefill(plans, prompts, **kw):
    return plans.make_plan([plans.Row(p, 0, plans.blocks_for(i, MAX_LEN), **kw) for i, p in enumerate(prompts)])


def _decode(plans, prompts, k, fed=True, tokens=None, **kw):
    rows = []
    for i, p in enumerate(prompts):
        token, feed = ([0], i) if fed else ([int(tokens[i])], -1)
        rows.append(plans.Row(token, len(p) + k, plans.blocks_for(i, MAX_LEN), feed_from_row=feed, **kw))
    return plans.make_plan(rows)


SAMPLING = {
    "greedy": {},
    "top-k-top-p": dict(temperature=0.9, top_k=40, top_p=0.8, seed=3),
    "top-p-alone": dict(temperature=0.7, top_p=0.9, seed=4),
    "penalties": dict(temperature=0.8, seed=5, hist=[17, 18, 19, 17]),
}


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("kind", list(SAMPLING))
def test_decode_steps_launch_without_a_host_sync(tiny_model_dir, plans, graphs, kind):
    runner = _runner(tiny_model_dir("llama"), decode_graphs=graphs)
    kw = SAMPLING[kind]
    prompts = _prompts(5)
    first = runner.execute(_prefill(plans, prompts, **kw))
    runner.execute(_decode(plans, prompts, 0, **kw))  # warm-up: scratch buffers, pinned blocks
    plan = _decode(plans, prompts, 1, fed=False, tokens=first.tokens, **kw)
    if kind == "penalties":
        plan.repetition_penalty[:] = 1.3
        plan.frequency_penalty[:] = 0.4
        plan.presence_penalty[:] = 0.2
    plan.min_p[:] = 0.05 if kind != "greedy" else 0.0
    runner.execute(plan)  # the host-fed variant warmed up too
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = [runner.launch(_decode(plans, prompts, 2, **kw)), runner.launch(plan)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all((p.result().tokens >= 0).all() for p in pending)


@pytest.mark.parametrize("rows", [3, 11, 30])
def test_captured_graphs_give_the_eager_tokens(tiny_model_dir, plans, rows):
    path = tiny_model_dir("llama")
    prompts = _prompts(rows, seed=rows)

    def generate(runner):
        out = [runner.execute(_prefill(plans, prompts)).tokens]
        out += [runner.execute(_decode(plans, prompts, k)).tokens for k in range(6)]
        return np.stack(out, axis=1)

    graphed = _runner(path, decode_graphs=True)
    assert graphed.graphs is not None and graphed.graphs.captured
    np.testing.assert_array_equal(generate(graphed), generate(_runner(path, decode_graphs=False)))


def test_cuda_runs_the_triton_backend_and_it_matches_the_torch_path(tiny_model_dir, plans, monkeypatch):
    pytest.importorskip("triton")
    from metrale.gpu_worker import model_runner
    from metrale.gpu_worker.layers.attention_backends import TORCH

    path = tiny_model_dir("mistral", sliding_window=8)
    prompts = _prompts(4, seed=9)

    def generate(runner):
        out = [runner.execute(_prefill(plans, prompts)).tokens]
        out += [runner.execute(_decode(plans, prompts, k)).tokens for k in range(5)]
        return np.stack(out, axis=1)

    on_triton = _runner(path, decode_graphs=False)
    assert on_triton.model.attention_backends == {"triton"}
    got = generate(on_triton)
    monkeypatch.setattr(model_runner, "select_backend", lambda device, native: TORCH)
    np.testing.assert_array_equal(got, generate(_runner(path, decode_graphs=False)))


def test_llm_tokens_are_the_same_with_and_without_enforce_eager(tiny_model_dir):
    from metrale import LLM, SamplingParams

    path = str(tiny_model_dir("llama"))
    prompts = [list(p) for p in _prompts(40, seed=11)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True) for i in range(len(prompts))]
    outs = {}
    for eager in (False, True):
        llm = LLM(path, device="cuda", max_num_seqs=48, enforce_eager=eager, show_progress=False)
        try:
            assert (llm.runner.graphs is None) == eager
            outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert outs[False] == outs[True]
