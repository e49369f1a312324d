"""The GGUF tensor types that stay quantized: one row per type (llama.cpp's type traits, in small).

Every type's block decodes (`QuantType.decode`, numpy bit-unpacking of the stored bytes) to one common form,
`Blocks`: w = d * sc * c + dm * mn, with c an int8 code per input, sc and mn int8 multipliers per sub-block of
`sub` inputs (16 or 32), d and dm fp16 per block of the type (32 or 256 inputs). That is how llama.cpp's types
are built (Q6_K: c = q - 32, sc its int8 scales per 16, d its fp16 scale; Q5_K: c = q, sc and mn its 6-bit
scales and mins per 32, d and dm = -dmin), so the form is exact for each, and `dequantize` reproduces gguf's
own dequantization bit for bit (the tests check).

A row names the kernel (cpu_quant.cpp) that multiplies its blocks, and the layout it is repacked to once:

- "int8": int8 codes and one fp16 scale per 32 (Q8_0 as stored; IQ4_NL with c its table's value),
  `pack_int8`.
- "int4": 4-bit codes, a scale and an offset per 32 (Q4_0, Q4_1, Q4_K), `pack_int4`: half the bytes.
- "int5": 5-bit codes as the 4-bit layout plus a plane of fifth bits, an fp16 scale and offset per 32 (Q5_0,
  Q5_1; Q5_0's offsets, -16 times the scale, not stored), `pack_int5`: the file's bits a weight, not 8.
- "kq8": int8 codes with the integer sub-scales and mins and the fp16 block scales kept apart (Q5_K, Q6_K,
  Q3_K, Q2_K, IQ4_XS), `pack_kq8`: each block of 32 inputs is summed exactly in int32 per sub-block, scaled
  by its integer sub-scales, then by d and the activations' scale in float32 (llama.cpp's order).

A new type is a row here and, unless one of these kernels takes it, a kernel. Types without a row (F32, F16,
BF16, the IQ2/IQ3/IQ1 grids, TQ) load dense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from metrale.gguf_types import BLOCK_SIZES, TensorType
from metrale.gpu_worker.layers import gguf_repack
from metrale.gpu_worker.layers.quantization import PANEL, _per_panel, pack_int4, pack_int8

IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.int8)


@dataclass(slots=True)
class Blocks:
    """Rows of one type in the common form: w[r, i] = d * sc * c + dm * mn (see the module docstring)."""

    codes: np.ndarray  # int8 [rows, cols]
    sc: np.ndarray  # int8 [rows, cols / sub]
    mn: np.ndarray | None  # int8 [rows, cols / sub], or None: no offset
    d: np.ndarray  # float16 [rows, cols / sup]
    dm: np.ndarray | None  # float16 [rows, cols / sup]
    sub: int
    sup: int


@dataclass(frozen=True, slots=True)
class QuantType:
    """One GGUF type: its block (inputs, bytes), the kernel its rows run on, and its decoder (stored blocks
    uint8 [n, nbytes] -> codes [n, block], sc [n, block / sub], mn or None, d [n], dm [n] or None)."""

    name: str
    block: int
    nbytes: int
    kernel: str  # "int8" | "int4" | "kq8"
    sub: int
    decode: Callable[[np.ndarray], tuple]
    code_bias: int = 0  # int4: the stored code is c + code_bias (Q4_0's signed codes)
    halves: tuple[int, ...] = (0,)  # where the block's fp16 scales lie (their bytes' offsets)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[:, 0]


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes [n, k * width] as codes [n, 2 * k * width]: each run of `width` bytes gives its low nibbles, then
    its high ones (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _ones(n: int, k: int) -> np.ndarray:
    return np.ones((n, k), dtype=np.int8)


def _q8_0(b):
    return b[:, 2:].view(np.int8), _ones(len(b), 1), None, _f16(b[:, :2]), None


def _q4_0(b):
    return _nibbles(b[:, 2:], 16).astype(np.int8) - 8, _ones(len(b), 1), None, _f16(b[:, :2]), None


def _q4_1(b):
    return _nibbles(b[:, 4:], 16).astype(np.int8), _ones(len(b), 1), _ones(len(b), 1), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5(b, head: int):
    q = _nibbles(b[:, head + 4 :], 16) | (np.unpackbits(b[:, head : head + 4], axis=-1, bitorder="little") << 4)
    return q.astype(np.int8)


def _q5_0(b):
    return _q5(b, 2) - 16, _ones(len(b), 1), None, _f16(b[:, :2]), None


def _q5_1(b):
    return _q5(b, 4), _ones(len(b), 1), _ones(len(b), 1), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b):
    """Q4_K / Q5_K: the 6-bit scales and mins of the 8 sub-blocks, d and -dmin."""
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return sc.astype(np.int8), mn.astype(np.int8), _f16(b[:, :2]), -_f16(b[:, 2:4])


def _q4_k(b):
    sc, mn, d, dm = _k_scales(b)
    return _nibbles(b[:, 16:], 32).astype(np.int8), sc, mn, d, dm


def _q5_k(b):
    sc, mn, d, dm = _k_scales(b)
    n = len(b)
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
    q = _nibbles(b[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4)
    return q.astype(np.int8), sc, mn, d, dm


def _q6_k(b):
    n = len(b)
    ql = _nibbles(b[:, :128], 64)
    qh = (b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (ql | (qh.reshape(n, -1) << 4)).astype(np.int8) - 32
    return q, b[:, 192:208].view(np.int8), None, _f16(b[:, 208:210]), None


def _q3_k(b):
    n = len(b)
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    lo = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 3) << 4)).astype(np.int8) - 32
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, -1) & 3
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).reshape(n, -1) & 1
    q = ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)
    return q, sc, None, _f16(b[:, 108:110]), None


def _q2_k(b):
    n = len(b)
    scales, qs = b[:, :16], b[:, 16:80]
    q = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, -1) & 3
    sc, mn = (scales & 0x0F).astype(np.int8), (scales >> 4).astype(np.int8)
    return q.astype(np.int8), sc, mn, _f16(b[:, 80:82]), -_f16(b[:, 82:84])


def _iq4_nl(b):
    return IQ4_VALUES[_nibbles(b[:, 2:], 16)], _ones(len(b), 1), None, _f16(b[:, :2]), None


def _iq4_xs(b):
    n = len(b)
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)[:, 0:1] >> (2 * np.arange(8, dtype=np.uint16)).reshape(1, 8)
    low = (b[:, 4:8].reshape(n, -1, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    sc = (low | ((high.astype(np.uint8) & 3) << 4)).astype(np.int8) - 32
    return IQ4_VALUES[_nibbles(b[:, 8:], 16)], sc, None, _f16(b[:, :2]), None


def _row(name: str, *rest, **kw) -> QuantType:
    """A type's row, its block (inputs, bytes) as ggml's table has it (metrale/gguf_types.py)."""
    return QuantType(name, *BLOCK_SIZES[TensorType[name]], *rest, **kw)


TYPES: dict[str, QuantType] = {
    t.name: t
    for t in (
        _row("Q8_0", "int8", 32, _q8_0),
        _row("Q5_0", "int5", 32, _q5_0, code_bias=16),
        _row("IQ4_NL", "int8", 32, _iq4_nl),
        _row("Q4_0", "int4", 32, _q4_0, code_bias=8),
        _row("Q4_1", "int4", 32, _q4_1, halves=(0, 2)),
        _row("Q4_K", "int4", 32, _q4_k, halves=(0, 2)),
        _row("Q5_1", "int5", 32, _q5_1, halves=(0, 2)),
        _row("Q5_K", "kq8", 32, _q5_k, halves=(0, 2)),
        _row("Q6_K", "kq8", 16, _q6_k, halves=(208,)),
        _row("Q3_K", "kq8", 16, _q3_k, halves=(108,)),
        _row("Q2_K", "kq8", 16, _q2_k, halves=(80, 82)),
        _row("IQ4_XS", "kq8", 32, _iq4_xs),
    )
}


def finite(name: str, raw: np.ndarray) -> bool:
    """True when every fp16 scale of the stored blocks of type `name` is finite (a NaN or inf scale makes its
    whole block so)."""
    t = TYPES[name]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, t.nbytes)
    if t.nbytes % 2:
        return all(np.isfinite(np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)).all() for at in t.halves)
    words = blocks.view(np.uint16)  # (every type's block is whole 16-bit words, its scales on word boundaries)
    exponent = np.uint16(0x7C00)  # all ones: inf or NaN
    return not any((np.bitwise_and(words[:, at // 2], exponent) == exponent).any() for at in t.halves)


def decode(name: str, raw: np.ndarray) -> Blocks:
    """Rows of stored blocks (uint8 [rows, cols / block * nbytes]) of type `name` in the common form."""
    t = TYPES[name]
    rows = raw.shape[0]
    per_row = raw.shape[1] // t.nbytes
    if raw.shape[1] % t.nbytes:
        raise ValueError(f"{name}: rows of {raw.shape[1]} bytes are not whole blocks of {t.nbytes}")
    codes, sc, mn, d, dm = t.decode(np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * per_row, t.nbytes))

    def rowwise(a, dtype):
        return None if a is None else np.ascontiguousarray(np.asarray(a, dtype=dtype).reshape(rows, -1))

    return Blocks(
        codes=rowwise(codes, np.int8), sc=rowwise(sc, np.int8), mn=rowwise(mn, np.int8), d=rowwise(d, np.float16),
        dm=rowwise(dm, np.float16), sub=t.sub, sup=t.block,
    )


def dequantize(b: Blocks) -> torch.Tensor:
    """float32 [rows, cols]: (d * sc) * c + (dm * mn), gguf's dequantization in its own order of roundings."""
    rows, cols = b.codes.shape
    d = np.repeat(b.d.astype(np.float32), b.sup // b.sub, axis=1)
    w = (d * b.sc.astype(np.float32)).repeat(b.sub, axis=1) * b.codes.astype(np.float32)
    if b.mn is not None:
        dm = np.repeat(b.dm.astype(np.float32), b.sup // b.sub, axis=1)
        w = w + (dm * b.mn.astype(np.float32)).repeat(b.sub, axis=1)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(rows, cols))


def merged(parts: list[Blocks]) -> Blocks:
    """Parts stacked by rows in one form: the finer sub-block and block, offsets where any part has them
    (zero for the others)."""
    if len(parts) == 1:
        return parts[0]
    sub, sup = min(p.sub for p in parts), min(p.sup for p in parts)
    offset = any(p.mn is not None for p in parts)

    def fit(p: Blocks) -> Blocks:
        zeros = lambda a, dtype: np.zeros(a.shape, dtype=dtype)  # noqa: E731
        return Blocks(
            codes=p.codes, sc=np.repeat(p.sc, p.sub // sub, axis=1),
            mn=np.repeat(p.mn if p.mn is not None else zeros(p.sc, np.int8), p.sub // sub, axis=1) if offset else None,
            d=np.repeat(p.d, p.sup // sup, axis=1),
            dm=np.repeat(p.dm if p.dm is not None else zeros(p.d, np.float16), p.sup // sup, axis=1) if offset else None,
            sub=sub, sup=sup,
        )

    fitted = [fit(p) for p in parts]
    cat = lambda name: None if getattr(fitted[0], name) is None else np.concatenate([getattr(f, name) for f in fitted])  # noqa: E731
    return Blocks(codes=cat("codes"), sc=cat("sc"), mn=cat("mn"), d=cat("d"), dm=cat("dm"), sub=sub, sup=sup)


def as_int8(b: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8, scales fp16 per 32) of an "int8" type (sc all 1, no offset, a block of 32): pack_int8's input."""
    return torch.from_numpy(b.codes), torch.from_numpy(b.d)


def as_int4(b: Blocks, code_bias: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 uint8, scales, offsets float32 per 32) of an "int4" type: s = d * sc, z = dm * mn - bias * s."""
    s, z = _int4_scales(b, code_bias)
    codes = (b.codes.astype(np.int16) + code_bias).astype(np.uint8)
    return torch.from_numpy(codes), s, z


def _int4_scales(b: Blocks, code_bias: int) -> tuple[torch.Tensor, torch.Tensor]:
    """as_int4's (scales, offsets), float32 [rows, cols / 32]."""
    d = np.repeat(b.d.astype(np.float32), b.sup // 32, axis=1)
    s = d * b.sc.astype(np.float32)
    z = -np.float32(code_bias) * s
    if b.mn is not None:
        z = np.repeat(b.dm.astype(np.float32), b.sup // 32, axis=1) * b.mn.astype(np.float32) + z
    return torch.from_numpy(np.ascontiguousarray(s)), torch.from_numpy(np.ascontiguousarray(z))


def _stacked_codes(parts: list[tuple[str, Blocks]]) -> tuple[np.ndarray, int]:
    """(codes int8 [rows, cols], bias) of parts stacked by rows, codes + bias being each part's stored unsigned
    codes (one bias when the parts share it, else each part's added here and 0)."""
    biases = {TYPES[t].code_bias for t, _ in parts}
    if len(biases) == 1:
        codes = parts[0][1].codes if len(parts) == 1 else np.concatenate([b.codes for _, b in parts])
        return codes, biases.pop()
    return np.concatenate([b.codes + np.int8(TYPES[t].code_bias) for t, b in parts]), 0


def _fp16_exact(*values: torch.Tensor) -> bool:
    """True when every value is exactly an fp16 number."""
    return all(torch.equal(v.half().float(), v) for v in values)


def pack_int5(parts: list[tuple[str, Blocks]]) -> tuple[torch.Tensor, ...]:
    """cpu_quant_q5.cpp's layout of int5-typed parts stacked by rows: the low four bits as pack_int4's codes
    [panels, cols / 8, 16, 4], their fifth bits [panels, cols / 8, 16] (per 64-byte line of codes, 8 bytes of
    the low nibbles' bits then 8 of the high ones', little-endian), scales and offsets as fp16 bits (offsets
    empty where every part is Q5_0: -16 times the scale, which the kernel makes)."""
    implied = all(t == "Q5_0" for t, _ in parts)  # offsets -16 s, made by the kernel: not stored
    if gguf_repack.available():
        s, z = (torch.cat(t) for t in zip(*(_int4_scales(b, TYPES[t].code_bias) for t, b in parts)))
        if not _fp16_exact(s, *(() if implied else (z,))):
            raise ValueError("int5: scales and offsets must be exact in fp16")
        codes, bias = _stacked_codes(parts)
        panels = -(-codes.shape[0] // PANEL)
        halves = [_per_panel(v.half(), panels).view(torch.int16) for v in (s, z)]
        if implied:
            halves[1] = torch.empty(0, dtype=torch.int16)
        return gguf_repack.panel_int4(codes, bias), gguf_repack.panel_bits5(codes, bias), *halves
    q, s, z = (torch.cat(t) for t in zip(*(as_int4(b, TYPES[t].code_bias) for t, b in parts)))
    if not _fp16_exact(s, *(() if implied else (z,))):
        raise ValueError("int5: scales and offsets must be exact in fp16")
    if implied:
        z = torch.zeros_like(z)  # (exact in fp16, so pack_int4 keeps fp16 bits; dropped below)
    codes, scales, zeros = pack_int4(q & 15, s, z)
    if implied:
        zeros = torch.empty(0, dtype=torch.int16)
    rows, cols = q.shape
    panels = -(-rows // PANEL)
    high = np.zeros((panels * PANEL, cols), dtype=np.uint8)
    high[:rows] = (q >> 4).numpy()
    lines = high.reshape(panels, PANEL, cols // 8, 2, 4).transpose(0, 2, 3, 1, 4).reshape(panels, cols // 8, 2, 64)
    bits = np.packbits(lines, axis=-1, bitorder="little").reshape(panels, cols // 8, 16)
    return codes, torch.from_numpy(np.ascontiguousarray(bits)), scales, zeros


def pack_kq8(b: Blocks) -> tuple[torch.Tensor, ...]:
    """cpu_quant_k.cpp's layout: codes int8 [panels, cols / 4, 16, 4] (pack_int8's), sc and mn int8 [panels,
    cols / sub, 16], d and dm as fp16 bits (int16) [panels, cols / sup, 16]; mn and dm empty without offsets."""
    rows = b.codes.shape[0]
    panels = -(-rows // PANEL)
    if gguf_repack.available():
        codes = gguf_repack.panel_int8(b.codes)
    else:
        codes, _ = pack_int8(torch.from_numpy(b.codes), torch.from_numpy(b.d).repeat_interleave(b.sup // 32, dim=1))
    empty8, empty16 = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.int16)
    sc = _per_panel(torch.from_numpy(b.sc), panels)
    d = _per_panel(torch.from_numpy(b.d), panels).view(torch.int16)
    mn = _per_panel(torch.from_numpy(b.mn), panels) if b.mn is not None else empty8
    dm = _per_panel(torch.from_numpy(b.dm), panels).view(torch.int16) if b.dm is not None else empty16
    return codes, sc, mn, d, dm


def kernel_of(types: list[str]) -> str:
    """The one kernel that runs every part of these types (kq8 takes any mix), for rows stacked as one product."""
    kernels = {TYPES[t].kernel for t in types}
    return kernels.pop() if len(kernels) == 1 else "kq8"


def int4_pack(parts: list[tuple[str, Blocks]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_int4 of int4-typed parts stacked by rows (its codes in one pass by gguf_repack where it is built)."""
    if not gguf_repack.available():
        q, s, z = zip(*(as_int4(b, TYPES[t].code_bias) for t, b in parts))
        return pack_int4(torch.cat(q), torch.cat(s), torch.cat(z))
    s, z = (torch.cat(t) for t in zip(*(_int4_scales(b, TYPES[t].code_bias) for t, b in parts)))
    codes, bias = _stacked_codes(parts)
    packed = gguf_repack.panel_int4(codes, bias)
    panels = packed.shape[0]
    if _fp16_exact(s, z):  # pack_int4's rule: fp16 bits where every one is exact
        return packed, _per_panel(s.half(), panels).view(torch.int16), _per_panel(z.half(), panels).view(torch.int16)
    return packed, _per_panel(s, panels), _per_panel(z, panels)


def pack_int8_parts(parts: list[tuple[str, Blocks]]) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_int8 of int8-typed parts stacked by rows (its codes in one pass by gguf_repack where it is built)."""
    if not gguf_repack.available():
        return pack_int8(*(torch.cat(t) for t in zip(*(as_int8(b) for _, b in parts))))
    codes = parts[0][1].codes if len(parts) == 1 else np.concatenate([b.codes for _, b in parts])
    d = torch.from_numpy(parts[0][1].d if len(parts) == 1 else np.concatenate([b.d for _, b in parts]))
    packed = gguf_repack.panel_int8(codes)
    return packed, _per_panel(d, packed.shape[0]).view(torch.int16)
