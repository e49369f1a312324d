"""The Triton paged attention kernels against the torch path, run by Triton's interpreter on a CPU.

Skipped where triton is not installed (it is not a dependency: CUDA builds of torch ship it); on a GPU
(scripts/gpu_check.sh) the same checks run compiled with METRALE_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from metrale.gpu_worker.layers.attention_backends import TORCH, select_backend
from metrale.gpu_worker.layers.attention_metadata import build_metadata
from metrale.gpu_worker.layers.kv_cache import PagedKVCache

DEVICE = torch.device(os.environ.get("METRALE_TEST_DEVICE", "cpu"))
BLOCK_SIZE = 16
NUM_BLOCKS = 24


KERNELS = "metrale.gpu_worker.layers.triton_attention"
# On a CPU the kernels run under Triton's interpreter, which triton picks when it is first imported (for its own
# helpers too, and again in what it imports lazily), and a triton imported earlier in this process (transformers
# imports it) cannot be imported again: so the tests run in a fresh pytest process with TRITON_INTERPRET set.
CHILD = os.environ.get("METRALE_TRITON_CHILD") == "1"
IN_PROCESS = DEVICE.type != "cpu" or CHILD


@pytest.fixture(scope="module")
def triton_attention():
    """The kernels module (interpreted in the child process on a CPU)."""
    if not IN_PROCESS:
        pytest.skip("on a CPU these run in a fresh process (test_the_kernels_under_the_interpreter)")
    pytest.importorskip("triton")
    try:
        return importlib.import_module(KERNELS)
    except ImportError as exc:
        pytest.skip(f"triton cannot run here: {exc!r}")


@pytest.mark.skipif(IN_PROCESS, reason="this process runs the kernels itself")
def test_the_kernels_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (it is no dependency: CUDA builds of torch ship it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "METRALE_TRITON_CHILD": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env, cwd=os.path.dirname(os.path.dirname(__file__)),
        capture_output=True, text=True, timeout=600,
    )
    tail = (child.stdout + child.stderr)[-3000:]
    assert child.returncode == 0, tail
    assert "10 passed, 2 skipped" in tail, tail  # every kernel test ran (bfloat16 is skipped on the interpreter)


def _step(rows, heads, kv_heads, head_dim, *, seed=0, dtype=torch.float32):
    """Random q/k/v for a step of rows [(context, chunk)], a cache holding random context, and its metadata."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    cache = PagedKVCache(1, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g).to(dtype))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g).to(dtype))
    perm = rng.permutation(NUM_BLOCKS)
    width = max(-(-(c + n) // BLOCK_SIZE) for c, n in rows)
    tables = np.zeros((len(rows), width), dtype=np.int32)
    slots, used = [], 0
    for i, (context, chunk) in enumerate(rows):
        nb = -(-(context + chunk) // BLOCK_SIZE)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        slots += [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context, context + chunk)]
    t = len(slots)
    query_start = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int32)
    seq_lens = np.array([c + n for c, n in rows], dtype=np.int32)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)

    def meta(windows):
        return build_metadata(query_start, seq_lens, tables, slot_mapping, block_size=BLOCK_SIZE, windows=windows,
                              device=DEVICE, dtype=dtype, native=True, masks=True, varlen=True, rows=True)

    return q, k, v, cache, meta


def _both(backend, layer, q, k, v, cache, meta):
    """The backend's output and the torch path's, each over its own copy of the cache."""
    other = PagedKVCache(1, NUM_BLOCKS, BLOCK_SIZE, cache.v[0].shape[2], cache.v[0].shape[3], dtype=q.dtype, device=DEVICE)
    other.k[0].copy_(cache.k[0])
    other.v[0].copy_(cache.v[0])
    return backend.forward(layer, q, k, v, cache, meta), TORCH.forward(layer, q, k, v, other, meta)


CASES = [
    # rows (context, chunk), heads, kv_heads, head_dim, window, softcap
    pytest.param([(5, 1), (37, 1), (16, 1)], 4, 2, 16, None, None, id="decode-gqa"),
    pytest.param([(40, 1), (3, 1), (20, 1)], 4, 1, 16, 8, None, id="decode-window"),
    pytest.param([(21, 1), (33, 1)], 2, 2, 24, None, 30.0, id="decode-softcap-odd-head-dim"),
    pytest.param([(0, 19), (12, 1), (30, 7)], 4, 2, 16, None, None, id="mixed-prefill-with-context"),
    pytest.param([(10, 23), (0, 5)], 4, 2, 16, 6, 20.0, id="prefill-window-softcap"),
    # Later queries of a block see none of the first tile's keys: their softmax must stay finite.
    pytest.param([(0, 40), (50, 3)], 2, 1, 16, 4, None, id="prefill-long-chunk-small-window"),
]


@pytest.mark.parametrize("rows, heads, kv_heads, head_dim, window, softcap", CASES)
def test_triton_kernels_match_the_torch_path(triton_attention, rows, heads, kv_heads, head_dim, window, softcap):
    q, k, v, cache, meta = _step(rows, heads, kv_heads, head_dim)
    layer = SimpleNamespace(layer=0, scale=head_dim**-0.5, window=window, softcap=softcap)
    got, want = _both(triton_attention.TRITON, layer, q, k, v, cache, meta({window}))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the interpreter's tl.dot misreads bfloat16 (numpy has none)")
def test_triton_decode_in_bfloat16_is_close_to_the_torch_path(triton_attention):
    q, k, v, cache, meta = _step([(30, 1), (7, 1)], 4, 2, 16, dtype=torch.bfloat16, seed=2)
    layer = SimpleNamespace(layer=0, scale=0.25, window=None, softcap=None)
    got, want = _both(triton_attention.TRITON, layer, q, k, v, cache, meta({None}))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_the_probe_passes_the_kernels_and_fails_broken_ones(triton_attention, monkeypatch):
    assert triton_attention.works_on.__wrapped__(DEVICE)
    real = triton_attention.paged_prefill
    monkeypatch.setattr(triton_attention, "paged_prefill", lambda q, *a, **kw: real(q * 1.01, *a, **kw))
    assert not triton_attention.works_on.__wrapped__(DEVICE)
    monkeypatch.setattr(triton_attention, "paged_prefill", lambda *a, **kw: 1 / 0)
    assert not triton_attention.works_on.__wrapped__(DEVICE)


def test_cuda_gets_the_triton_backend_when_triton_imports_and_passes_its_probe(triton_attention, monkeypatch):
    monkeypatch.setattr(triton_attention, "works_on", lambda device: True)
    assert select_backend(torch.device("cuda"), native=False) is triton_attention.TRITON
    monkeypatch.setattr(triton_attention, "works_on", lambda device: False)
    assert select_backend(torch.device("cuda"), native=False) is TORCH
    monkeypatch.setattr(triton_attention, "works_on", lambda device: True)
    import builtins

    real_import = builtins.__import__

    def no_triton(name, globals=None, locals=None, fromlist=(), level=0):
        if name.endswith("triton_attention") or "triton_attention" in (fromlist or ()):
            raise ImportError("no triton")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert select_backend(torch.device("cuda"), native=False) is TORCH
    assert select_backend(torch.device("cpu"), native=False) is TORCH


@pytest.mark.parametrize("graphs", [False, True])
def test_a_model_on_the_triton_backend_generates_the_torch_paths_tokens(triton_attention, tiny_model_dir, plans, monkeypatch, graphs):
    # The whole runner on the kernels: chunked prefill with cached context (the varlen batch, no per-row chunks),
    # then decode steps (through the decode graphs' buffers when asked).
    from metrale.gpu_worker import model_runner
    from metrale.gpu_worker.layers import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    path = tiny_model_dir("mistral", sliding_window=8)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(16, 2000, size=n)] for i, n in enumerate((11, 20))]

    def generate(runner):
        blocks = [plans.blocks_for(i, 64) for i in range(len(prompts))]
        first = [plans.Row(p[:6], 0, blocks[i], sample=False) for i, p in enumerate(prompts)]
        runner.execute(plans.make_plan(first))
        out = [runner.execute(plans.make_plan([plans.Row(p[6:], 6, blocks[i]) for i, p in enumerate(prompts)])).tokens]
        for k in range(3):
            rows = [plans.Row([0], len(p) + k, blocks[i], feed_from_row=i) for i, p in enumerate(prompts)]
            out.append(runner.execute(plans.make_plan(rows)).tokens)
        return np.stack(out, axis=1)

    def runner(backend):
        monkeypatch.setattr(model_runner, "select_backend", lambda device, native: backend)
        return model_runner.ModelRunner(path, device=DEVICE, num_kv_blocks=256, max_num_seqs=4, show_progress=False, decode_graphs=graphs)

    want = generate(runner(TORCH))
    on_triton = runner(triton_attention.TRITON)
    assert on_triton.model.attention_backends == {"triton"} and not on_triton.model.uses_row_prefill
    np.testing.assert_array_equal(generate(on_triton), want)
