"""The Triton GGUF kernels (layers/triton_gguf.py) against gguf_quant_types' dequantization then a matmul.

Per kept type: random stored blocks, decoded to the common form, laid out for the device; y = x @ W.T through
each kind of launch (the GEMV for a few rows, tl.dot for more, the dequantized weight and torch's matmul for a
prefill), every row of the dispatch table, K split over programs or not, x in float32, bfloat16 and float16,
to float32's rounding of the sums (the GEMV multiplies the exact weight; tl.dot and the dense path the weight
rounded to x's dtype, as a dense copy is) and y's one rounding; the layout's chunks and packing for odd widths;
the prefill path's dequantized weight is gguf's. A stacked layer of two types multiplies through
GgufLinearMethod's Triton runs.

On a CPU the kernels run under Triton's interpreter in a fresh pytest process (as tests/test_triton_attention.py
explains), and are compiled down to sm_90 machine code without running; on a GPU (scripts/gpu_check.sh, stage
gguf) the same checks run compiled with METRALE_TEST_DEVICE=cuda.
Skipped where triton is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from metrale.gpu_worker.layers import gguf_linear
from metrale.gpu_worker.layers import gguf_quant_types as qt
from metrale.gpu_worker.layers.gguf_linear import GgufLinearMethod, tagged
from metrale.gpu_worker.layers.linear import QKVParallelLinear

DEVICE = torch.device(os.environ.get("METRALE_TEST_DEVICE", "cpu"))
KERNELS = "metrale.gpu_worker.layers.triton_gguf"
CHILD = os.environ.get("METRALE_TRITON_CHILD") == "1"
IN_PROCESS = DEVICE.type != "cpu" or CHILD
COLS = 512  # two K-quant blocks: every kernel tile loops
ROWS = 40  # not a whole number of BLOCK_N tiles
# Where each type's fp16 scales lie in its block (the rest of a random block is any bytes).
_SCALE_AT = {
    "Q8_0": (0,), "Q5_0": (0,), "IQ4_NL": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_1": (0, 2),
    "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_XS": (0,),
}


@pytest.fixture(scope="module")
def triton_gguf():
    """The kernel module (interpreted in the child process on a CPU)."""
    if not IN_PROCESS:
        pytest.skip("on a CPU these run in a fresh process (test_the_kernel_under_the_interpreter)")
    pytest.importorskip("triton")
    try:
        return importlib.import_module(KERNELS)
    except ImportError as exc:
        pytest.skip(f"triton cannot run here: {exc!r}")


@pytest.mark.skipif(IN_PROCESS, reason="this process runs the kernel itself")
def test_the_kernel_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (it is no dependency: CUDA builds of torch ship it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "METRALE_TRITON_CHILD": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
        cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True, timeout=600,
    )
    tail = (child.stdout + child.stderr)[-3000:]
    assert child.returncode == 0, tail
    assert "92 passed, 2 skipped" in tail, tail  # every kernel test ran, bfloat16 included


@pytest.mark.skipif(IN_PROCESS, reason="compiled where it runs")
def test_the_kernels_compile_for_a_hopper_gpu():
    """Triton's own compiler down to sm_90 machine code, no GPU needed: what the interpreter cannot catch (layouts,
    the reshapes, the dot operands), and that the codes stream in 16-byte loads (byte loads made the first GEMV
    slower than the dense matmul)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = importlib.import_module(KERNELS + "_kernels")
    if getattr(kernels.gemv_kernel, "arg_names", None) is None:
        pytest.skip("triton's interpreter is on in this process")
    q4_k = dict(SUB=32, SUP=256, H=256, PACKED=True, HAS_MIN=True)
    q6_k = dict(SUB=16, SUP=256, H=256, PACKED=False, HAS_MIN=False)
    q8_0 = dict(SUB=32, SUP=32, H=128, PACKED=False, HAS_MIN=False)
    dot = dict(DOT_F32=False, ROUND_BF16=False, PRECISION="ieee")
    launches = [  # kernel, constants, warps, stages, whether the codes must load 16 bytes at a time
        (kernels.gemv_kernel, dict(q4_k, BLOCK_M=1, BLOCK_N=16, CHUNKS=2, SPLIT=True, ROUND_BF16=False), 4, 1, True),
        (kernels.gemv_kernel, dict(q6_k, BLOCK_M=4, BLOCK_N=16, CHUNKS=1, SPLIT=False, ROUND_BF16=False), 4, 1, True),
        (kernels.dot_kernel, dict(q8_0, BLOCK_M=16, BLOCK_N=64, SPLIT=True, **dot), 4, 2, False),
        (kernels.dot_kernel, dict(q4_k, BLOCK_M=64, BLOCK_N=128, SPLIT=False, **dot), 8, 2, False),
        (kernels.dequantize_kernel, dict(q4_k, BLOCK_N=32, ROUND_BF16=False), 4, 1, True),
        (kernels.sum_splits_kernel, dict(BLOCK=1024, ROUND_BF16=False), 4, 1, False),
    ]
    pointers = {"X": "*bf16", "Y": "*bf16", "W": "*bf16", "P": "*fp32", "SC": "*i8", "MN": "*i8", "D": "*fp16",
                "DM": "*fp16"}
    aligned = {*pointers, "C", "stride_c", "stride_sc", "stride_d", "stride_xm", "stride_ym", "stride_w", "K", "N"}
    for kernel, constants, warps, stages, vectors in launches:
        types = {**pointers, "C": "*u8" if constants.get("PACKED") else "*i8", **{name: "constexpr" for name in constants}}
        names = kernel.arg_names
        signature = {name: types.get(name, "i32") for name in names}
        index = {(names.index(name),): value for name, value in constants.items()}
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned if name in names}  # as launched
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=index, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        except (ImportError, FileNotFoundError) as exc:  # a triton built without the NVIDIA backend or its ptxas
            pytest.skip(f"triton cannot compile for CUDA here: {exc!r}")
        assert compiled.asm.get("cubin"), kernel
        if vectors:
            assert "ld.global.v4.b32" in compiled.asm["ptx"], kernel


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Rows of random `name` blocks (uint8 [rows, cols / block * nbytes]) with small positive fp16 scales."""
    t = qt.TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // t.block, t.nbytes), dtype=np.uint8)
    for at in _SCALE_AT[name]:
        scale = (rng.random((rows, cols // t.block)) * 2e-3 + 1e-4).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _check(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rounded: bool) -> None:
    """y == x @ weight.T (weight float32, as gguf dequantizes it; `rounded`: to x's dtype first, as the tl.dot
    and dense paths multiply it, else exact as the GEMV does) to float32's sums and y's rounding to x's dtype."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0])
    w = (weight.to(x.dtype) if rounded else weight).double()
    want = x.double().cpu() @ w.T
    size = x.double().cpu().abs() @ w.abs().T  # what the float32 sum's rounding scales with
    rtol = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]  # y's one rounding
    assert bool(((y.double().cpu() - want).abs() <= rtol * want.abs() + 1e-5 * size + 1e-30).all()), (
        f"max error {float((y.double().cpu() - want).abs().max()):.3g} of {float(want.abs().max()):.3g}"
    )


def _weight(tg, name: str, rows: int = ROWS, cols: int = COLS, seed: int = 0):
    blocks = qt.decode(name, random_blocks(name, rows, cols, seed))
    return tg.pack_for_triton(blocks, DEVICE), qt.dequantize(blocks)


def _x(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(qt.TYPES))
def test_each_type_multiplies_as_dequantize_then_matmul(triton_gguf, name, dtype, rows):
    """One row: the GEMV (the weight exact); 33: tl.dot (the weight in x's dtype). K split over the programs."""
    w, weight = _weight(triton_gguf, name, seed=len(name))
    x = _x(rows, COLS, dtype, seed=rows)
    assert triton_gguf.config_for(rows).kind == ("gemv" if rows == 1 else "dot")
    _check(triton_gguf.matmul(x.to(DEVICE), w), x, weight, rounded=rows > 1)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "IQ4_XS"])
def test_float16_rows_multiply_on_every_kernel(triton_gguf, name):
    w, weight = _weight(triton_gguf, name, seed=2)
    for rows, kind in ((1, "gemv"), (20, "dot"), (300, "dense")):
        assert triton_gguf.config_for(rows).kind == kind
        x = _x(rows, COLS, torch.float16, seed=rows)
        _check(triton_gguf.matmul(x.to(DEVICE), w), x, weight, rounded=kind != "gemv")


def test_every_row_of_the_table_multiplies(triton_gguf):
    """Each count of rows TABLE names takes its row's launch (the bounds, and one past each), K split or not."""
    w, weight = _weight(triton_gguf, "Q4_K", seed=4)
    bounds = [b for b, _ in triton_gguf.TABLE if b is not None]
    counts = sorted({1, *bounds, *(b + 1 for b in bounds)})
    for rows in counts:
        cfg = triton_gguf.config_for(rows)
        x = _x(rows, COLS, torch.bfloat16, seed=rows)
        for split in ((0, 1) if cfg.kind != "dense" else (0,)):
            one = dataclasses.replace(cfg, split_k=split) if split else cfg
            _check(triton_gguf.matmul(x.to(DEVICE), w, one), x, weight, rounded=cfg.kind != "gemv")
    assert triton_gguf.config_for(10**6).kind == "dense"


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q3_K"])
def test_a_split_over_k_sums_its_spans(triton_gguf, name):
    """Five chunks of 256 inputs split 1, 2 (3 + 2), 3 (2 + 2 + 1) and 5 ways; the GEMV also two chunks a loop
    (a span's last loop half past its end), with rows 1, 3 (of a 4-row tile) and 8."""
    w, weight = _weight(triton_gguf, name, rows=20, cols=1280, seed=7)  # 20: no whole number of 8-, 16- or 32-row tiles
    assert w.k // w.chunk == 5
    for split in (1, 2, 3, 5):
        for rows, cfg in ((1, triton_gguf.Config("gemv", 1, 16, chunks=2)), (3, triton_gguf.Config("gemv", 4, 8)),
                          (8, triton_gguf.Config("gemv", 8, 32, chunks=2)), (17, triton_gguf.Config("dot", 16, 32))):
            x = _x(rows, 1280, torch.float32, seed=split)
            _check(triton_gguf.matmul(x.to(DEVICE), w, dataclasses.replace(cfg, split_k=split)), x, weight,
                   rounded=False)


def test_k_splits_to_fill_the_gpu_while_the_partial_sums_stay_small(triton_gguf):
    """A decode row of an 8B model's Q4_K layer splits K over ~PROGRAMS_PER_SM programs per multiprocessor;
    more rows split less (their float32 partial sums, written and read back, within PARTIAL_SHARE of the weight's
    bytes), a prefill not at all."""
    n, k, meta = 4096, 4096, torch.device("meta")
    w = triton_gguf.TritonWeight(
        codes=torch.empty(n, k // 2, dtype=torch.uint8, device=meta), sc=torch.empty(n, k // 32, dtype=torch.int8,
        device=meta), mn=torch.empty(n, k // 32, dtype=torch.int8, device=meta), d=torch.empty(n, k // 256,
        dtype=torch.float16, device=meta), dm=torch.empty(n, k // 256, dtype=torch.float16, device=meta), sub=32,
        sup=256, chunk=256, n=n, k=k, packed=True,
    )
    weight_bytes = n * k * 9 // 16  # 4.5 bits a weight
    sms = 132
    splits = {}
    for m in (1, 8, 32, 512):
        tiles = -(-n // (16 if m == 1 else 64)) * -(-m // 64)
        splits[m] = triton_gguf._auto_split(w, m, tiles, sms)
        assert splits[m] * 8 * m * n <= triton_gguf.PARTIAL_SHARE * weight_bytes or splits[m] == 1
    assert splits[1] * n // 16 >= triton_gguf.PROGRAMS_PER_SM * sms
    assert splits[1] > 1 and splits[8] > splits[32] > splits[512] == 1


@pytest.mark.parametrize("name, cols, chunk, packed", [
    ("Q4_K", 512, 256, True), ("Q6_K", 512, 256, False), ("Q3_K", 256, 256, True), ("IQ4_XS", 256, 256, False),
    ("Q4_0", 192, 64, True), ("Q4_1", 96, 32, False), ("Q8_0", 160, 32, False), ("IQ4_NL", 384, 128, False),
])
def test_the_layout_chunks_k_and_packs_four_bit_codes(triton_gguf, name, cols, chunk, packed):
    """The chunk is the largest power of two up to 256 dividing K (a packed half whole sub-blocks); codes of at most
    16 values two per byte, the rest (IQ4's table values among them) int8; odd widths multiply too."""
    w, weight = _weight(triton_gguf, name, rows=24, cols=cols, seed=cols)
    assert (w.chunk, w.packed) == (chunk, packed)
    assert tuple(w.codes.shape) == (24, cols // 2 if packed else cols)
    for rows in (1, 17):
        x = _x(rows, cols, torch.float32, seed=rows)
        _check(triton_gguf.matmul(x.to(DEVICE), w), x, weight, rounded=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(qt.TYPES))
def test_each_type_dequantizes_for_the_prefill_product(triton_gguf, name, dtype):
    w, weight = _weight(triton_gguf, name, seed=len(name))
    got = triton_gguf.dequantize(w, dtype).cpu()
    assert got.dtype == dtype
    # float32: the same products, a fused multiply-add at most apart (d*sc*c and dm*mn may cancel, hence the
    # atol); bfloat16: then one rounding
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    atol = 1e-6 * float(weight.abs().max())
    torch.testing.assert_close(got.float(), weight.to(dtype).float(), rtol=rtol, atol=atol)
    x = _x(33, COLS, dtype, seed=5)
    _check(triton_gguf.matmul(x.to(DEVICE), w, dense=True), x, weight, rounded=True)


def test_the_dense_weight_serves_cuda_unless_triton_is_asked_for(monkeypatch):
    """On CUDA the Triton products still run slower than the dense weight: they are opt-in."""
    segments = [("Q8_0", qt.decode("Q8_0", random_blocks("Q8_0", 4, 64)))]
    monkeypatch.delenv(gguf_linear.GGUF_CUDA_ENV, raising=False)
    assert gguf_linear._triton_runs(segments, torch.device("cpu")) is None
    monkeypatch.setenv(gguf_linear.GGUF_CUDA_ENV, "fastest")
    with pytest.raises(ValueError, match="METRALE_GGUF_CUDA"):
        gguf_linear._triton_runs(segments, torch.device("cpu"))


def test_a_stacked_layer_of_two_types_multiplies_through_triton_runs(triton_gguf, monkeypatch):
    monkeypatch.setenv(gguf_linear.GGUF_CUDA_ENV, "triton")
    cols = 256
    parts = {"q": ("Q4_K", 64), "k": ("Q4_K", 32), "v": ("Q6_K", 32)}  # a Q4_K_M file's attention
    layer = QKVParallelLinear(cols, 32, 2, 1, dtype=torch.bfloat16, device=DEVICE, quant_method=GgufLinearMethod())
    raws = {}
    for seed, (shard, (name, rows)) in enumerate(parts.items()):
        raws[shard] = random_blocks(name, rows, cols, seed)
        layer.weight.weight_loader(layer.weight, tagged(raws[shard], name), shard)
    weight = torch.cat([qt.dequantize(qt.decode(name, raws[s])) for s, (name, _) in parts.items()])
    x = torch.randn(3, cols).to(torch.bfloat16)
    runs = gguf_linear._triton_runs(gguf_linear._segments(layer), DEVICE)
    assert [r.rows for r in runs] == [96, 32]  # one run per type, neither dequantized
    _check(torch.cat([r.product(x.to(DEVICE), False) for r in runs], dim=1), x, weight, rounded=False)
    if DEVICE.type == "cuda":  # the method takes the Triton runs itself there
        layer.process_weights_after_loading()
        assert layer.gguf_runs is not None and not hasattr(layer, "dequantized")
        _check(layer(x.to(DEVICE)), x, weight, rounded=False)


def test_a_mismatched_input_is_refused(triton_gguf):
    w, _ = _weight(triton_gguf, "Q8_0", rows=4, cols=64)
    with pytest.raises(ValueError, match="64 inputs"):
        triton_gguf.matmul(torch.zeros(1, 32, device=DEVICE), w)
