"""Microbenchmark: the CPU matmul kernels a quantized linear layer could run on, over one model's layer shapes.

For each kernel, the time of one decoder layer's projections (q/k/v, o, gate/up, down) plus the LM head's share
per layer, at batch M rows, in bf16 activations: dense bf16 through oneDNN's packed weight (metrale's dense
path), int8 per-channel (torch._weight_int8pack_mm), grouped 4-bit (torch._weight_int4pack_mm_for_cpu, group
32/64/128), and torchao's Int8WeightOnly on nn.Linear when torchao is installed (its CPU 4-bit path is
torch's own kernel above). The box is
noisy: kernels run alternately, round after round, and each figure is the median. One JSON line.

    python scripts/bench_quant_kernels.py --shape bench-small --rows 1 32 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers.linear_method import pack_weight

SHAPES = {  # (hidden, q rows + 2 kv rows, intermediate, vocab, layers)
    "bench-small": (1024, 1024 + 2 * 512, 2816, 32000, 16),
    "smollm2": (576, 576 + 2 * 192, 1536, 49152, 30),
}


def layer_weights(shape: str) -> list[torch.Tensor]:
    """[out, in] float32 weights of one layer's projections, and the LM head's rows divided over the layers."""
    hidden, qkv, inter, vocab, layers = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    dims = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter), (vocab // layers, hidden)]
    return [torch.randn(n, k, generator=gen) / k**0.5 for n, k in dims]


def dense_bf16(w: torch.Tensor):
    packed = pack_weight(w.bfloat16())
    return lambda x: packed(x)


def int8_channel(w: torch.Tensor):
    scale = w.abs().amax(1) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    s = scale.bfloat16()
    return lambda x: torch._weight_int8pack_mm(x, q, s)


def int4_group(group: int):
    def make(w: torch.Tensor):
        n, k = w.shape
        g = w.view(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        zero = lo + 8 * scale  # torch's int4 convention: w = (q - 8) * scale + zero
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
        return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group, sz)

    return make


def torchao_linear(kind: str):
    def make(w: torch.Tensor):
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        quantize_(lin, Int8WeightOnlyConfig())
        return lambda x: lin(x)

    return make


def timed(fns, xs: list[torch.Tensor], reps: int) -> float:
    """Seconds of running every projection once on its input (one layer), averaged over reps."""
    t0 = time.perf_counter()
    for _ in range(reps):
        for f, x in zip(fns, xs):
            f(x)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench-small")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weights = layer_weights(args.shape)
    kernels = {"dense_bf16": dense_bf16, "int8_channel": int8_channel,
               "int4_g32": int4_group(32), "int4_g64": int4_group(64), "int4_g128": int4_group(128)}
    try:
        import torchao  # noqa: F401

        kernels["torchao_int8"] = torchao_linear("int8")  # its CPU int4 is torch's own kernel (int4_g*)
    except ImportError:
        pass
    built = {}
    for name, make in kernels.items():
        try:
            built[name] = [make(w) for w in weights]
        except Exception as e:  # a kernel this build lacks: say so, measure the rest
            print(json.dumps({"skipped": name, "why": repr(e)[:200]}))
    out: dict = {"shape": args.shape, "threads": args.threads, "rounds": args.rounds, "ms_per_layer": {}}
    with torch.inference_mode():
        for m in args.rows:
            xs = [torch.randn(m, w.shape[1], dtype=torch.bfloat16) for w in weights]
            for fns in built.values():
                timed(fns, xs, 2)  # warm up
            samples: dict[str, list[float]] = {n: [] for n in built}
            for _ in range(args.rounds):
                for name, fns in built.items():
                    samples[name].append(timed(fns, xs, args.reps))
            med = {n: statistics.median(v) * 1e3 for n, v in samples.items()}
            out["ms_per_layer"][f"M={m}"] = {n: round(v, 4) for n, v in med.items()}
            out.setdefault("vs_dense_bf16", {})[f"M={m}"] = {n: round(med["dense_bf16"] / v, 3) for n, v in med.items()}
    # Numerics on one weight: the relative error of each kernel's product against float32.
    w, x = weights[2], torch.randn(4, weights[2].shape[1])
    want = x @ w.T
    out["rel_error"] = {
        n: round(float((make(w)(x.bfloat16()).float() - want).norm() / want.norm()), 5) for n, make in kernels.items() if n in built
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
