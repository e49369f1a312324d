"""The machine's physical limits for a model's decode step: memory bandwidth and matmul throughput, measured.

    python scripts/bench_limits.py [--model DIR | --preset bench-small] [--dtype bfloat16] [--batches 1,8,32]
        [--context 192] [--buffer-mib 1024] [--reps 7] [--threads N]

Two bounds, so a benchmark can say how far an engine's decode step is from what the box allows:

- **Bandwidth bound (batch 1).** A decode step of one row reads every weight of every linear layer and the
  LM head once (the embedding only one row), plus the row's cached keys and values: `decode_bytes`, at
  `--context` tokens. The streaming-read bandwidth is measured on a buffer larger than the caches
  (`--buffer-mib`, a float32 sum over it: one load and one add per element, bound by the memory), and again on a
  buffer of `decode_bytes` (what a step really streams, some of which a large L3 may hold). The bound is
  decode_bytes ÷ bandwidth: no engine's batch-1 step can be shorter.
- **Matmul bound (each batch).** The model's own linear layers, loaded and packed the way the engine packs
  them (DenseLinearMethod), multiplied in model order by `batch` rows each: every product the step does, on
  its real weights, with nothing between them. At batch 32 this is what the step's matmuls alone cost.

Medians over --reps passes (after a warm-up pass). Output: a table on stderr, one JSON line on stdout
(`"bench": "limits"`); `measure(model_dir, dtype, ...)` returns the same dict for the other benchmarks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

FORMAT = 1  # bump when a key of the JSON line changes meaning


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the --preset's cached random Llama)")
    ap.add_argument("--preset", default="bench-small", help="tiny_model preset when --model is not given")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=192, help="tokens of KV a batch-1 step reads (128 + 128 new: 192 on average)")
    ap.add_argument("--buffer-mib", type=int, default=1024, help="the streaming-read buffer, larger than the caches")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    return ap.parse_args(argv)


def stream_read_gb_s(num_bytes: int, reps: int) -> float:
    """Median GB/s of a float32 sum over a buffer of num_bytes (first touched, then read reps times)."""
    import torch

    buf = torch.ones(max(16, num_bytes // 4), dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def linear_layers(model) -> list:
    """The model's linear layers and LM head, in the order a step runs them (module order: layers, then head)."""
    return [m for m in model.modules() if hasattr(m, "quant_method") and hasattr(m, "input_size_per_partition")] + [model.lm_head]


def matmul_ms(layers: list, hidden: int, batch: int, dtype, reps: int) -> float:
    """Median ms of one pass of batch-row products through every layer (each with its own input)."""
    import torch

    inputs = []
    for layer in layers:
        features = hidden if layer is layers[-1] else layer.input_size_per_partition
        inputs.append(torch.randn(batch, features).to(dtype))
    with torch.inference_mode():
        for layer, x in zip(layers, inputs):
            layer.quant_method.apply(layer, x)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer.quant_method.apply(layer, x)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(model_dir, dtype: str = "bfloat16", *, batches=(1, 8, 32), context: int = 192, buffer_mib: int = 1024, reps: int = 7) -> dict:
    """The limits for this model and dtype on this machine (the JSON line's body)."""
    import torch

    from metrale.gpu_worker.layers import cpu_kernels
    from metrale.gpu_worker.layers.attention_backends import select_backend
    from metrale.gpu_worker.loader import load_model
    from metrale.model_facts import resolve_model

    facts = resolve_model(model_dir, None)
    native = cpu_kernels.available()
    model = load_model(facts, dtype=dtype, device="cpu", native=native, attention=select_backend(torch.device("cpu"), native=native), show_progress=False)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    layers = linear_layers(model)
    hidden = model.shape.hidden_size
    weight_bytes = sum(layer.output_size_per_partition * layer.input_size_per_partition for layer in layers[:-1]) * itemsize
    head_bytes = model.lm_head.rows_per_rank * hidden * itemsize
    kv = model.kv_shape
    kv_bytes = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * context * itemsize
    decode_bytes = weight_bytes + head_bytes + kv_bytes
    flops = {b: 2 * b * (weight_bytes + head_bytes) // itemsize for b in batches}

    big = stream_read_gb_s(buffer_mib << 20, max(3, reps // 2))
    at_model = stream_read_gb_s(decode_bytes, reps)
    matmul = {b: matmul_ms(layers, hidden, b, model.dtype, reps) for b in batches}
    del model
    return {
        "model": os.path.basename(os.path.normpath(str(model_dir))),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "decode_bytes": decode_bytes,
        "weight_bytes": weight_bytes + head_bytes,
        "kv_bytes_at_context": kv_bytes,
        "context": context,
        "bandwidth_gb_s": round(big, 2),
        "bandwidth_buffer_mib": buffer_mib,
        "bandwidth_at_decode_bytes_gb_s": round(at_model, 2),
        "bandwidth_bound_ms": round(decode_bytes / big / 1e6, 3),
        "bandwidth_bound_at_decode_bytes_ms": round(decode_bytes / at_model / 1e6, 3),
        "matmul_bound_ms": {str(b): round(ms, 3) for b, ms in matmul.items()},
        "matmul_tflop_s": {str(b): round(flops[b] / (matmul[b] * 1e-3) / 1e12, 3) for b in batches},
        "matmul_gb_s": {str(b): round((weight_bytes + head_bytes) / (matmul[b] * 1e-3) / 1e9, 2) for b in batches},
    }


def fraction(bound_ms: float | None, step_ms: float | None) -> float | None:
    """How close a step is to its bound: bound ÷ step (1.0 = at the limit), None without both."""
    if not bound_ms or not step_ms:
        return None
    return round(bound_ms / step_ms, 3)


def main(argv: list[str] | None = None) -> int:
    """Measure and print the limits of one model."""
    args = parse_args(argv)
    threads = bc.set_torch_threads(args.threads)
    model = args.model
    if model is None:
        from metrale.gpu_worker.tiny_model import FORMAT_VERSION, cached_model_dir

        model = cached_model_dir(f"bench/{args.preset}-llama-bfloat16-v{FORMAT_VERSION}", args.preset, "bfloat16")
    meter = bc.LoadMeter()
    batches = tuple(int(b) for b in args.batches.split(","))
    limits = measure(model, args.dtype, batches=batches, context=args.context, buffer_mib=args.buffer_mib, reps=args.reps)
    rows = [[f"matmul, batch {b}", limits["matmul_bound_ms"][str(b)], limits["matmul_tflop_s"][str(b)], limits["matmul_gb_s"][str(b)]] for b in batches]
    bc.note(
        f"{limits['model']} {args.dtype}, {threads} threads: decode reads {limits['decode_bytes'] / 1e6:.1f} MB "
        f"(KV at {args.context} tokens: {limits['kv_bytes_at_context'] / 1e6:.1f} MB)\n"
        f"streaming read {limits['bandwidth_gb_s']:.1f} GB/s ({args.buffer_mib} MiB), "
        f"{limits['bandwidth_at_decode_bytes_gb_s']:.1f} GB/s (decode_bytes): batch-1 bound "
        f"{limits['bandwidth_bound_ms']:.2f} ms ({limits['bandwidth_bound_at_decode_bytes_ms']:.2f} ms)"
    )
    bc.note(bc.table(rows, ["", "ms", "TFLOP/s", "weights GB/s"]))
    bc.emit({"bench": "limits", "format": FORMAT, "commit": bc.git_commit(), **limits, "load": meter.report()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
