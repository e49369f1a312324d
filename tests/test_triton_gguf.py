"""The Triton GGUF kernel (layers/triton_gguf.py) against gguf_quant_types' dequantization then a matmul.

Per kept type: random stored blocks, decoded to the common form, packed for the device; y = x @ W.T for one
row (the GEMV kernel) and 33 (the tiled one, a ragged tile), x in float32 and bfloat16, to float32's rounding
of the sums (bfloat16: the weight rounded to bfloat16 as the dense path rounds it, and y's one rounding); the
prefill path's weight dequantized on the device is gguf's, and its product the same.
A stacked layer of two types multiplies through GgufLinearMethod's Triton runs.

On a CPU the kernel runs under Triton's interpreter in a fresh pytest process (as tests/test_triton_attention.py
explains); on a GPU (scripts/gpu_check.sh, stage gguf) the same checks run compiled with METRALE_TEST_DEVICE=cuda.
Skipped where triton is not installed.
"""

from __future__ import annotations

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
_PACKED = {"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"}  # codes in a nibble: two per byte


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
    assert "84 passed, 2 skipped" in tail, tail  # every kernel test ran, bfloat16 included


@pytest.mark.skipif(IN_PROCESS, reason="compiled where it runs")
def test_the_kernels_compile_for_a_hopper_gpu():
    """Triton's own compiler down to sm_90 machine code, no GPU needed: what the interpreter cannot catch (layouts
    of the joined nibbles, the reshapes, the dot operands)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tg = importlib.import_module(KERNELS)
    if getattr(tg._gguf_gemv_kernel, "arg_names", None) is None:
        pytest.skip("triton's interpreter is on in this process")
    q4_k = dict(SUB=32, SUP=256, PACKED=True, HAS_LUT=False, HAS_MIN=True)
    q6_k = dict(SUB=16, SUP=256, PACKED=False, HAS_LUT=False, HAS_MIN=False)
    iq4_xs = dict(SUB=32, SUP=256, PACKED=True, HAS_LUT=True, HAS_MIN=False)
    launches = [
        (tg._gguf_gemv_kernel, dict(q4_k, BLOCK_N=16, BLOCK_K=256, SPLIT_K=3, ROUND_BF16=False), 1),
        (tg._gguf_matmul_kernel, dict(q6_k, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, DOT_F32=False, ROUND_BF16=False,
                                      PRECISION="ieee"), 4),
        (tg._gguf_dequantize_kernel, dict(iq4_xs, BLOCK_N=32, BLOCK_K=128, ROUND_BF16=False), 1),
    ]
    pointers = {"X": "*bf16", "Y": "*bf16", "W": "*bf16", "P": "*fp32", "SC": "*i8", "MN": "*i8", "D": "*fp16",
                "DM": "*fp16", "LUT": "*i8"}
    for kernel, constants, stages in launches:
        types = {**pointers, "C": "*u8" if constants["PACKED"] else "*i8", **{name: "constexpr" for name in constants}}
        signature = {name: types.get(name, "i32") for name in kernel.arg_names}
        index = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=index),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
        except (ImportError, FileNotFoundError) as exc:  # a triton built without the NVIDIA backend or its ptxas
            pytest.skip(f"triton cannot compile for CUDA here: {exc!r}")
        assert compiled.asm.get("cubin"), kernel


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Rows of random `name` blocks (uint8 [rows, cols / block * nbytes]) with small positive fp16 scales."""
    t = qt.TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // t.block, t.nbytes), dtype=np.uint8)
    for at in _SCALE_AT[name]:
        scale = (rng.random((rows, cols // t.block)) * 2e-3 + 1e-4).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


def _check(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """y == x @ weight.T (weight float32, as gguf dequantizes it) to float32's sums and x's dtype's roundings."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0])
    w = weight.to(x.dtype).double()  # the dense path's weight: rounded once to x's dtype
    want = x.double().cpu() @ w.T
    size = x.double().cpu().abs() @ w.abs().T  # what the float32 sum's rounding scales with
    rtol = 0.0 if x.dtype == torch.float32 else 2.0**-8  # y's one rounding to bfloat16
    assert bool(((y.double().cpu() - want).abs() <= rtol * want.abs() + 1e-5 * size + 1e-30).all()), (
        f"max error {float((y.double().cpu() - want).abs().max()):.3g} of {float(want.abs().max()):.3g}"
    )


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(qt.TYPES))
def test_each_type_multiplies_as_dequantize_then_matmul(triton_gguf, name, dtype, rows):
    blocks = qt.decode(name, random_blocks(name, ROWS, COLS, seed=len(name)))
    w = triton_gguf.pack_for_triton(blocks, DEVICE)
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows)).to(dtype)
    _check(triton_gguf.matmul(x.to(DEVICE), w), x, qt.dequantize(blocks))


@pytest.mark.parametrize("rows", [8, 100], ids=["decode_tiles", "wide_tiles"])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS"])
def test_rows_between_one_and_a_prefill_take_the_tiled_kernel(triton_gguf, name, rows):
    blocks = qt.decode(name, random_blocks(name, ROWS, COLS, seed=3))
    w = triton_gguf.pack_for_triton(blocks, DEVICE)
    assert triton_gguf.GEMV_ROWS < rows < triton_gguf.DENSE_ROWS
    assert (triton_gguf.config_for(rows, ROWS, COLS).block_m == 16) == (rows <= triton_gguf.DECODE_ROWS)
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _check(triton_gguf.matmul(x.to(DEVICE), w), x, qt.dequantize(blocks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(qt.TYPES))
def test_each_type_dequantizes_for_the_prefill_product(triton_gguf, name, dtype):
    blocks = qt.decode(name, random_blocks(name, ROWS, COLS, seed=len(name)))
    w = triton_gguf.pack_for_triton(blocks, DEVICE)
    weight = qt.dequantize(blocks)
    got = triton_gguf.dequantize(w, dtype).cpu()
    assert got.dtype == dtype
    # float32: the same products, a fused multiply-add at most apart (d*sc*c and dm*mn may cancel, hence the
    # atol); bfloat16: then one rounding
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    atol = 1e-6 * float(weight.abs().max())
    torch.testing.assert_close(got.float(), weight.to(dtype).float(), rtol=rtol, atol=atol)
    x = torch.randn(33, COLS, generator=torch.Generator().manual_seed(5)).to(dtype)
    _check(triton_gguf.matmul(x.to(DEVICE), w, dense=True), x, weight)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_a_row_split_over_k_sums_its_spans(triton_gguf, name):
    blocks = qt.decode(name, random_blocks(name, ROWS, 1280, seed=7))
    w = triton_gguf.pack_for_triton(blocks, DEVICE)
    x = torch.randn(1, 1280, generator=torch.Generator().manual_seed(7))
    for split in (3, 5):  # spans of whole 256-input tiles: 512, 512 and 256; five of 256
        config = triton_gguf.Config(1, 16, 256, split_k=split)
        _check(triton_gguf.matmul(x.to(DEVICE), w, config), x, qt.dequantize(blocks))
    assert triton_gguf.config_for(1, 4096, 4096, sms=132).split_k > 1  # a decode row of a large layer splits


def test_four_bit_codes_are_stored_two_per_byte(triton_gguf):
    for name in sorted(qt.TYPES):
        w = triton_gguf.pack_for_triton(qt.decode(name, random_blocks(name, ROWS, COLS)), DEVICE)
        assert w.packed == (name in _PACKED), name
        assert tuple(w.codes.shape) == (ROWS, COLS // 2 if w.packed else COLS), name
        assert (w.lut is not None) == name.startswith("IQ4"), name


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
    _check(torch.cat([r.product(x.to(DEVICE), False) for r in runs], dim=1), x, weight)
    if DEVICE.type == "cuda":  # the method takes the Triton runs itself there
        layer.process_weights_after_loading()
        assert layer.gguf_runs is not None and not hasattr(layer, "dequantized")
        _check(layer(x.to(DEVICE)), x, weight)


def test_a_mismatched_input_is_refused(triton_gguf):
    w = triton_gguf.pack_for_triton(qt.decode("Q8_0", random_blocks("Q8_0", 4, 64)), DEVICE)
    with pytest.raises(ValueError, match="64 inputs"):
        triton_gguf.matmul(torch.zeros(1, 32, device=DEVICE), w)
