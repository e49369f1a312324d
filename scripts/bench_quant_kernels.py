"""Microbenchmark: the quantized linear layers against the dense bf16 one, on one model's layer shapes.

Each format runs through its LinearMethod exactly as the engine does (DenseLinearMethod in bfloat16: the
native GEMV for a few rows, oneDNN beyond; Int8LinearMethod and Int4LinearMethod: cpu_quant.cpp's kernels),
on bfloat16 activations, over every layer's own weights in model order (q/k/v, o, gate/up, down per layer,
then the LM head), so each product finds the caches as a decode step leaves them. The process's kernel class
is the CPU's best or METRALE_CPU_ISA's (which also caps torch's own kernels). Formats alternate, round after
round; each figure is the median ms of one product of that shape. At each row count: ms per shape and format,
each format's speed-up over bf16 (bf16 ms / its ms; per shape and for the whole step), and for the step the
weight bytes read per second against the box's streaming-read bandwidth (bench_limits' measure). With
--library, torch's own int8 / 4-bit kernels on the same shapes too. --gguf TYPES adds GGUF types kept
quantized (GgufLinearMethod over random blocks of each type, as a file's layer runs them; a shape whose inputs
are not whole blocks of the type is left out, as llama.cpp's quantizer leaves it to another type), and --narrow
each of them again with the wide (many-row) product turned off: the path such a layer took before it had one.
One JSON line.

    python scripts/bench_quant_kernels.py --shape bench-small --rows 1 4 32 --rounds 5
    python scripts/bench_quant_kernels.py --shape smollm2 --rows 1 4 32 128 --gguf Q5_0 Q8_0 Q4_K Q6_K --narrow
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_limits import stream_read_gb_s  # noqa: E402

import numpy as np  # noqa: E402

from metrale.gpu_worker.layers import cpu_kernels  # noqa: E402
from metrale.gpu_worker.layers import gguf_quant_types as qt  # noqa: E402
from metrale.gpu_worker.layers.gguf_linear import GgufLinearMethod, tagged  # noqa: E402
from metrale.gpu_worker.layers.linear import ColumnParallelLinear  # noqa: E402
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod  # noqa: E402
from metrale.gpu_worker.layers.quantization import Int4LinearMethod, Int8LinearMethod  # noqa: E402

SHAPES = {  # (hidden, q rows + 2 kv rows, intermediate, vocab, layers)
    "bench-small": (1024, 1024 + 2 * 1024, 2816, 32000, 16),
    "smollm2": (576, 576 + 2 * 192, 1536, 49152, 30),
}
NAMES = ("qkv", "o", "gate_up", "down", "lm_head")


def model_shapes(shape: str, layers: int | None) -> tuple[list[tuple[str, int, int]], int]:
    """[(name, out, in)] of one layer's projections and the head, and the layer count."""
    hidden, qkv, inter, vocab, n_layers = SHAPES[shape]
    dims = [("qkv", qkv, hidden), ("o", hidden, hidden), ("gate_up", 2 * inter, hidden), ("down", hidden, inter),
            ("lm_head", vocab, hidden)]
    return dims, layers or n_layers


def make_layer(method, w: torch.Tensor) -> nn.Module:
    """A module holding w through `method`, processed as the loader would."""
    layer = nn.Module()
    method.create_weights(layer, w.shape[1], [w.shape[0]], dtype=torch.bfloat16, device=torch.device("cpu"), weight_loader=None)
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    return layer


def gguf_layer(name: str, out: int, inp: int, seed: int, wide: bool) -> nn.Module | None:
    """A layer of random `name` blocks (small positive fp16 scales) as a GGUF file's layer holds them; None where
    inp is not whole blocks of the type. wide=False: the many-row product turned off."""
    t = qt.TYPES[name]
    if inp % t.block:
        return None
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out, inp // t.block, t.nbytes), dtype=np.uint8)
    for at in t.halves:
        raw[:, :, at : at + 2] = (rng.random((out, inp // t.block)) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(out, -1, 2)
    layer = ColumnParallelLinear(inp, out, dtype=torch.bfloat16, device=torch.device("cpu"), quant_method=GgufLinearMethod())
    layer.weight.weight_loader(layer.weight, tagged(raw.reshape(out, -1), name))
    layer.process_weights_after_loading()
    layer.wide = layer.wide and wide
    return layer


def weight_bytes(fmt: str, out: int, inp: int) -> int:
    """Bytes of weight one product reads (int8: Q8_0 blocks; 4-bit: codes and fp16 scale and offset)."""
    blocks = -(-inp // 32)
    return {"bf16": 2 * out * inp, "int8": out * blocks * 34, "int4": out * blocks * 20}.get(fmt, out * inp)


def library_kernels(w: torch.Tensor) -> dict:
    """torch's own products for comparison: int8 per row (_weight_int8pack_mm), 4-bit groups of 32
    (_weight_int4pack_mm_for_cpu)."""
    n, k = w.shape
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    s = scale.bfloat16()
    g = w.view(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    step = ((hi - lo) / 15).clamp(min=1e-8)
    q4 = torch.round((g - lo[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 8)
    sz = torch.stack([step, lo + 8 * step], -1).transpose(0, 1).contiguous().bfloat16()
    return {"torch_int8pack": lambda x: torch._weight_int8pack_mm(x, q, s),
            "torch_int4pack": lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench-small")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="layers of weights to cycle through (default: the model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--library", action="store_true", help="torch's own quantized kernels too")
    ap.add_argument("--gguf", nargs="*", default=[], help="GGUF types kept quantized (Q5_0, Q8_0, Q4_K, Q6_K, ...)")
    ap.add_argument("--narrow", action="store_true", help="each --gguf type also with its wide product off")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernels.available()  # load the kernels first: the dense method's GEMV needs them loaded
    dims, layers = model_shapes(args.shape, args.layers)
    gen = torch.Generator().manual_seed(0)
    formats = {"bf16": DenseLinearMethod, "int8": Int8LinearMethod, "int4": Int4LinearMethod}
    fns: dict[str, list[tuple[str, object]]] = {f: [] for f in formats}
    if args.library:
        fns.update(torch_int8pack=[], torch_int4pack=[])
    ggufs = [(t, True) for t in args.gguf] + ([(t, False) for t in args.gguf] if args.narrow else [])
    for t, wide in ggufs:
        fns[t if wide else f"{t}:narrow"] = []
    with torch.inference_mode():
        for i in range(layers + 1):
            for name, out, inp in dims:
                if (name == "lm_head") != (i == layers):
                    continue
                w = torch.randn(out, inp, generator=gen) / inp**0.5
                for fmt, method in formats.items():
                    m, layer = method(), None
                    layer = make_layer(m, w.bfloat16().float() if fmt == "bf16" else w)
                    fns[fmt].append((name, lambda x, m=m, layer=layer: m.apply(layer, x)))
                if args.library:
                    for fmt, f in library_kernels(w).items():
                        fns[fmt].append((name, f))
                for t, wide in ggufs:
                    layer = gguf_layer(t, out, inp, i, wide)
                    if layer is not None:
                        fns[t if wide else f"{t}:narrow"].append((name, layer))
        bandwidth = stream_read_gb_s(1 << 30, 5)
        out: dict = {"bench": "quant_kernels", "isa": cpu_kernels.isa(), "shape": args.shape, "threads": args.threads,
                     "layers": layers, "rounds": args.rounds, "stream_read_gb_s": round(bandwidth, 2), "ms": {},
                     "speedup_vs_bf16": {}, "step_ms": {}, "step_bandwidth_fraction": {}}
        hidden = {"qkv": dims[0][2], "o": dims[1][2], "gate_up": dims[2][2], "down": dims[3][2], "lm_head": dims[4][2]}
        for rows in args.rows:
            xs = {name: torch.randn(rows, hidden[name], generator=gen).bfloat16() for name in NAMES}
            samples = {f: {n: [] for n in NAMES} for f in fns}
            for r in range(args.rounds + 1):  # the first round warms up
                for fmt, calls in fns.items():
                    per = {n: 0.0 for n in NAMES}
                    for name, f in calls:
                        t0 = time.perf_counter()
                        f(xs[name])
                        per[name] += time.perf_counter() - t0
                    if r:
                        for n in NAMES:
                            samples[fmt][n].append(per[n] / (layers if n != "lm_head" else 1))
            has = {f: {n for n, _ in calls} for f, calls in fns.items()}
            ms = {f: {n: statistics.median(v) * 1e3 for n, v in s.items() if n in has[f]} for f, s in samples.items()}
            count = {n: layers if n != "lm_head" else 1 for n in NAMES}
            step = {f: sum(ms[f][n] * count[n] for n in NAMES) for f in fns if len(ms[f]) == len(NAMES)}
            key = f"rows={rows}"
            out["ms"][key] = {f: {n: round(v, 4) for n, v in per.items()} for f, per in ms.items()}
            out["speedup_vs_bf16"][key] = {
                f: {**{n: round(ms["bf16"][n] / ms[f][n], 3) for n in ms[f]}, **({"step": round(step["bf16"] / step[f], 3)} if f in step else {})}
                for f in fns
            }
            out["step_ms"][key] = {f: round(v, 3) for f, v in step.items()}
            if rows == 1:
                for f in formats:
                    read = sum(weight_bytes(f, o, i) * count[n] for n, o, i in dims)
                    out["step_bandwidth_fraction"][f] = round(read / (step[f] / 1e3) / 1e9 / bandwidth, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
