"""cpu_quant.cpp's int8 and 4-bit products on every instruction-set class this CPU has (the kernel_isa fixture),
against their exact integer reference: the activations quantized by quantization.py's quantize_activations (the
kernels must give the same codes and scales bit for bit), times the dequantized weight, summed in float64. The
kernels sum the blocks in float32, so they agree to float32's rounding; ragged shapes cover the zero padding of
the last panel and the last block. The amx class's wide product (many bf16 rows, the weight dequantized to bf16)
is checked against x times the dequantized weight rounded to bf16.
"""

from __future__ import annotations

import pytest
import torch

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.layers.quantization import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    pack_int8,
    quantize_activations,
    quantize_int4,
    quantize_int8,
)

# (output rows, inputs): whole panels and blocks, a ragged last panel, a ragged last block (int8 only), and a
# panel count that is odd (the AVX-512 kernels take panels two at a time).
SHAPES = [(64, 128), (37, 96), (50, 100), (48, 64)]
ROWS = [1, 2, 3, 4, 5, 32]


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 x @ weight.T with x quantized per block (the kernels' integers, exactly)."""
    codes, scales = quantize_activations(x)
    xq = (codes.double().view(*scales.shape, 32) * scales.double()[..., None]).flatten(1)[:, : x.shape[1]]
    return xq @ weight.double().T


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # float32 sums; bf16's one rounding of the result
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_quantize_activations_as_the_reference(kernel_isa, dtype):
    x = torch.randn(5, 100).to(dtype)
    x[1, :32] = 0  # a block of zeros
    x[2, 40] = 1e4  # an outlier coarsens only its own block
    codes, scales = cpu_kernels.ops().quantize_activations(x, 128)
    want_codes, want_scales = quantize_activations(x)
    assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_is_the_integer_product(kernel_isa, shape, dtype):
    n, k = shape
    w = torch.randn(n, k)
    q, d = quantize_int8(w)
    codes, scales = pack_int8(q, d)
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        _check(cpu_kernels.ops().int8_linear(x, codes, scales, n, False), _reference(x, dequantize_int8(q, d)), dtype)


def _int4_weight(n: int, k: int, scales: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and offsets of a random weight: quantize_int4's (exact in fp16, packed as fp16), or with
    scales and offsets that fp16 cannot hold (packed as float32, as Q4_K's)."""
    q, s, z = quantize_int4(torch.randn(n, k))
    if scales == "float32":
        s, z = s * (1 + 2**-13), z + s * 2**-12
    return q, s, z


@pytest.mark.parametrize("scales", ["fp16", "float32"])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 32 == 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_is_the_integer_product(kernel_isa, shape, dtype, scales):
    n, k = shape
    q, s, z = _int4_weight(n, k, scales)
    codes, packed_scales, zeros = pack_int4(q, s, z)
    assert packed_scales.dtype == (torch.int16 if scales == "fp16" else torch.float32)
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        _check(cpu_kernels.ops().int4_linear(x, codes, packed_scales, zeros, n, False), _reference(x, dequantize_int4(q, s, z)), dtype)


def test_int8_extremes_do_not_overflow(kernel_isa):
    # Every weight code -127 and every activation code +-127: the largest int32 sums and int16 pairs there are.
    n, k = 32, 2048
    q, d = torch.full((n, k), -127, dtype=torch.int8), torch.ones(n, k // 32, dtype=torch.float16)
    codes, scales = pack_int8(q, d)
    x = torch.ones(4, k)
    x[1] = -1
    _check(cpu_kernels.ops().int8_linear(x, codes, scales, n, False), _reference(x, dequantize_int8(q, d)), torch.float32)
    q4 = torch.full((n, k), 15, dtype=torch.uint8)
    ones = torch.ones(n, k // 32)
    _check(cpu_kernels.ops().int4_linear(x, *pack_int4(q4, ones, ones), n, False), _reference(x, dequantize_int4(q4, ones, ones)), torch.float32)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 32 == 0] + [(50, 100)])
def test_the_wide_product_is_x_times_the_weight_in_bf16(kernel_isa, shape):
    n, k = shape
    w = torch.randn(n, k)
    q, d = quantize_int8(w)
    codes, scales = pack_int8(q, d)
    int4 = [(parts, pack_int4(*parts)) for parts in (_int4_weight(n, k // 32 * 32, kind) for kind in ("fp16", "float32"))]
    if kernel_isa != "amx":
        with pytest.raises(RuntimeError, match="wide"):
            cpu_kernels.ops().int8_linear(torch.randn(16, k).bfloat16(), codes, scales, n, True)
        return
    for rows in (16, 17, 32, 33, 70):
        x = torch.randn(rows, k).bfloat16()
        want = x.double() @ dequantize_int8(q, d).bfloat16().double().T
        _check(cpu_kernels.ops().int8_linear(x, codes, scales, n, True), want, torch.bfloat16)
        x4 = x[:, : k // 32 * 32].contiguous()
        for parts, packed in int4:
            want4 = x4.double() @ dequantize_int4(*parts).bfloat16().double().T
            _check(cpu_kernels.ops().int4_linear(x4, *packed, n, True), want4, torch.bfloat16)
