"""The native CPU kernels (gpu_worker/layers/cpu_kernels.py) against plain torch references.

Skipped where the kernels cannot be built (no compiler): every caller then keeps its torch path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers import cpu_kernels

native = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable here")
pytestmark = pytest.mark.usefixtures("kernel_isa")  # every test on each kernel class this CPU can run

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _reference_decode(q, k_blocks, v_cache, tables, seq_lens, first_key, scale):
    """Each row's attention over keys first_key[r] <= t < seq_lens[r], by gather + softmax in float32."""
    bs = k_blocks.shape[3]
    out = torch.empty_like(q, dtype=torch.float32)
    group = q.shape[1] // k_blocks.shape[1]
    for r in range(q.shape[0]):
        t = torch.arange(int(first_key[r]), int(seq_lens[r]))
        blocks = tables[r, t // bs]
        k = k_blocks[blocks, :, :, t % bs].float()  # [n, kv_heads, dim]
        v = v_cache[blocks, t % bs].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].float() * scale, k)
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [(8, 4, 64, 16), (9, 3, 64, 16), (4, 4, 64, 16), (16, 4, 128, 16), (8, 1, 64, 16), (6, 2, 80, 16), (4, 2, 32, 8), (2, 1, 24, 4)],
)
def test_paged_decode_matches_reference(dtype, heads, kv_heads, dim, block_size):
    """Scattered blocks, unequal lengths, rows starting past key 0 (sliding windows), any group size."""
    g = torch.Generator().manual_seed(heads * 1000 + dim)
    num_blocks, rows = 128, 7
    k_blocks = torch.randn(num_blocks, kv_heads, dim, block_size, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    seq_lens = torch.tensor([1, 5, block_size, block_size + 1, 3 * block_size + 2, 40, 61], dtype=torch.int64)
    first_key = torch.tensor([0, 0, 3, 0, block_size + 5, 39, 7], dtype=torch.int64)
    width = -(-int(seq_lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: rows * width].reshape(rows, width).contiguous()
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    scale = dim**-0.5
    got = cpu_kernels.paged_decode(q, k_blocks, v_cache, tables, seq_lens, first_key, scale)
    want = _reference_decode(q, k_blocks, v_cache, tables, seq_lens, first_key, scale)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_gives_a_row_alone_its_bits_in_a_batch(dtype):
    """A lone row is split by KV head across threads; a batch's rows are not: the same bits either way."""
    g = torch.Generator().manual_seed(5)
    k_blocks = torch.randn(64, 3, 64, 16, generator=g).to(dtype)
    v_cache = torch.randn(64, 16, 3, 64, generator=g).to(dtype)
    q = torch.randn(8, 9, 64, generator=g).to(dtype)
    tables = torch.randperm(64, generator=g)[:48].reshape(8, 6).contiguous()
    seq_lens = torch.tensor([90, 17, 33, 5, 70, 96, 1, 60], dtype=torch.int64)
    first_key = torch.tensor([0, 0, 20, 0, 3, 40, 0, 0], dtype=torch.int64)
    batch = cpu_kernels.paged_decode(q, k_blocks, v_cache, tables, seq_lens, first_key, 0.125)
    for r in range(8):
        alone = cpu_kernels.paged_decode(q[r : r + 1], k_blocks, v_cache, tables[r : r + 1], seq_lens[r : r + 1], first_key[r : r + 1], 0.125)
        assert torch.equal(alone[0], batch[r]), f"row {r}"


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (8, 1, 64, 16), (6, 2, 80, 16), (4, 2, 32, 8)])
def test_paged_decode_splits_long_rows_and_merges_them(dtype, heads, kv_heads, dim, block_size):
    """Few rows with many blocks: each row's keys are split into chunks across the threads and the chunks'
    softmax states merged (flash-decoding): the reference's result, with a sliding window starting mid-block,
    a ragged last block, a last chunk of one key; a row's bits the same alone, in a batch and on one thread."""
    g = torch.Generator().manual_seed(heads * 100 + dim + block_size)
    num_blocks = 256
    k_blocks = torch.randn(num_blocks, kv_heads, dim, block_size, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    seq_lens = torch.tensor([1000, 257, 700, 1024], dtype=torch.int64)
    first_key = torch.tensor([0, 0, 300 + block_size // 2 + 1, 5], dtype=torch.int64)
    width = -(-int(seq_lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(4)]).contiguous()
    q = (2 * torch.randn(4, heads, dim, generator=g)).to(dtype)
    scale = dim**-0.5
    want = _reference_decode(q, k_blocks, v_cache, tables, seq_lens, first_key, scale)
    alone = [
        cpu_kernels.paged_decode(q[r : r + 1], k_blocks, v_cache, tables[r : r + 1], seq_lens[r : r + 1], first_key[r : r + 1], scale)
        for r in range(4)
    ]
    for r in range(4):
        torch.testing.assert_close(alone[r][0].float(), want[r], atol=TOL[dtype], rtol=TOL[dtype], msg=f"row {r}")
    pair = cpu_kernels.paged_decode(q[:2], k_blocks, v_cache, tables[:2], seq_lens[:2], first_key[:2], scale)
    batch = cpu_kernels.paged_decode(q.repeat(2, 1, 1), k_blocks, v_cache, tables.repeat(2, 1), seq_lens.repeat(2), first_key.repeat(2), scale)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = cpu_kernels.paged_decode(q[:1], k_blocks, v_cache, tables[:1], seq_lens[:1], first_key[:1], scale)
    finally:
        torch.set_num_threads(threads)
    for r in range(4):
        assert torch.equal(batch[r], alone[r][0]) and torch.equal(batch[r + 4], alone[r][0]), f"row {r}"
    assert torch.equal(pair[0], alone[0][0]) and torch.equal(pair[1], alone[1][0])
    assert torch.equal(serial[0], alone[0][0])


@native
def test_paged_decode_reads_strided_queries():
    """q may be a view of a wider projection (the model passes q out of the stacked q/k/v)."""
    g = torch.Generator().manual_seed(7)
    k_blocks = torch.randn(8, 2, 64, 16, generator=g)
    v_cache = torch.randn(8, 16, 2, 64, generator=g)
    wide = torch.randn(3, 6, 64, generator=g)
    q = wide[:, :4]
    tables = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int64)
    seq_lens = torch.tensor([20, 32, 9], dtype=torch.int64)
    first_key = torch.zeros(3, dtype=torch.int64)
    got = cpu_kernels.paged_decode(q, k_blocks, v_cache, tables, seq_lens, first_key, 0.125)
    want = cpu_kernels.paged_decode(q.contiguous(), k_blocks, v_cache, tables, seq_lens, first_key, 0.125)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_keys_transposed_and_values_plain(dtype):
    """Every token's key lands at [block, head, :, offset] and its value at [block, offset]."""
    g = torch.Generator().manual_seed(3)
    blocks, bs, kv_heads, dim, tokens = 16, 16, 4, 64, 37
    k_blocks = torch.zeros(blocks, kv_heads, dim, bs, dtype=dtype)
    v_cache = torch.zeros(blocks, bs, kv_heads, dim, dtype=dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    kv = torch.randn(tokens, 2 * kv_heads, dim, generator=g).to(dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]  # strided views, as the model passes them
    cpu_kernels.write_kv(k, v, k_blocks, v_cache, slots)
    assert torch.equal(k_blocks[slots // bs, :, :, slots % bs], k)
    assert torch.equal(v_cache[slots // bs, slots % bs], v)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not k_blocks.permute(0, 3, 1, 2).reshape(blocks * bs, -1)[untouched].any()
    assert not v_cache.reshape(blocks * bs, -1)[untouched].any()


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_matches_hf_rounding(dtype, with_delta):
    """bf16 bit for bit with HF's norm (float32 within an ulp); the residual add happens in place first."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(33, 512, generator=g).to(dtype)
    delta = torch.randn(33, 512, generator=g).to(dtype) if with_delta else None
    weight = torch.randn(512, generator=g).to(dtype)
    residual = x + delta if with_delta else x.clone()
    hidden = residual.float()
    want = weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = cpu_kernels.rms_norm(x, weight, 1e-6, delta)
    assert torch.equal(x, residual)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_first_of_ties(dtype):
    """torch's max(dim).indices: the first index among equal maxima (bf16 rows have many ties)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 1001, generator=g).to(dtype)
    x[3, 17] = x[3, 900] = 100.0
    x[5, -1] = 100.0
    assert torch.equal(cpu_kernels.argmax_rows(x), x.float().max(dim=1).indices)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1408, 40, 3])
def test_silu_mul_matches_torch(dtype, cols):
    """silu(gate) * up with torch's rounding points: gate's silu rounded to the dtype, then the product."""
    g = torch.Generator().manual_seed(13)
    gate_up = (4 * torch.randn(17, 2 * cols, generator=g)).to(dtype)
    gate, up = gate_up.split(cols, dim=-1)
    want = torch.mul(F.silu(gate), up)
    got = cpu_kernels.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        # The exp differs from torch's in the last float32 bits: rarely, one bf16 rounding flips.
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2**-7 + 1e-30).all()
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_kernels_build_where_a_compiler_exists():
    """A build broken by a source change must fail here, not fall back to torch unnoticed."""
    import shutil

    if cpu_kernels.choice() == "torch" or not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no compiler, or the torch path was asked for")
    assert cpu_kernels.available(), cpu_kernels.error()


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_identical_to_the_torch_path(dtype):
    """In place on a strided q/k view, the same bits as apply_rotary (HF's rounding points)."""
    from metrale.gpu_worker.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary

    cfg = RopeConfig(head_dim=64, theta=10000.0, rope_type="default", factor=1.0, max_position_embeddings=512)
    rope = RotaryEmbedding(cfg, 512, dtype=dtype, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(17)
    qkv = torch.randn(21, 14, 64, generator=g).to(dtype)
    positions = torch.randint(0, 512, (21,), generator=g)
    qk = qkv[:, :12]
    cos, sin = rope.cos_sin(positions)
    want = apply_rotary(qk, cos, sin)
    v_before = qkv[:, 12:].clone()
    got = cpu_kernels.rotary(qk, rope.table, positions)
    assert got.data_ptr() == qk.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, 12:], v_before)


@native
def test_kernels_are_built_to_run_on_torchs_threads():
    """With torch's OpenMP backend, at::parallel_for's pragma must be compiled in (else every kernel is
    serial): the library then calls libgomp's GOMP_parallel, shared with torch."""
    if not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP: at::parallel_for is torch's own code")
    lib = cpu_kernels._build()
    assert b"GOMP_parallel" in lib.read_bytes()


def test_prebuild_starts_no_build_once_told_to_stop(tmp_path, monkeypatch):
    """A test session that ends before its background prebuild stops it: no queued build starts after that."""
    import threading

    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    stop = threading.Event()
    stop.set()
    assert cpu_kernels.prebuild(["generic"], jobs=2, stop=stop) == {}
    assert not list(tmp_path.rglob("*.so"))


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 33])
@pytest.mark.parametrize(("out", "inp"), [(64, 64), (43, 70), (130, 576)])
def test_linear_is_the_float32_product_to_one_bf16_rounding(kernel_isa, rows, out, inp):
    """Every class's bf16 product (the GEMVs, the widened chunks, oneDNN's): within one bfloat16 rounding of the
    float32 product, ragged rows and a ragged last line included; oneDNN's own where the class multiplies bf16
    natively past two rows."""
    from metrale import cpu_isa

    g = torch.Generator().manual_seed(rows * 100 + out)
    w = torch.randn(out, inp, generator=g).to(torch.bfloat16)
    b = torch.randn(out, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, inp, generator=g).to(torch.bfloat16)
    for bias in (None, b):
        got = cpu_kernels.linear(x, w, bias).float()
        exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert ((got - exact).abs() <= 2**-8 * exact.abs() + 1e-4 * exact.abs().max()).all()
        if rows > 2 and cpu_isa.has_native_bf16(kernel_isa):
            assert torch.equal(got, F.linear(x, w, bias).float())
