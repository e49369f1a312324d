"""The Triton GGUF kernels (layers/triton_gguf.py) against the dense bf16 matmul they replace, on a CUDA GPU.

    python scripts/bench_gguf_cuda.py [--reps 25] [--types Q4_K,Q6_K,Q8_0] [--rows 1,8,32,512] [--warm] [--dry]

Per layer shape (N outputs x K inputs: 4096x4096, 14336x4096 and 4096x14336), type and M rows of bf16 x:
the dispatch's product (`triton_gguf.matmul`, TABLE's launch for M rows) against torch.matmul of the same
weight dense in bf16, each the median of --reps single calls timed with CUDA events, L2 flushed before each (a
model reads each layer once per step, never from L2). Alongside: every launch in ALTERNATIVES for that M (GEMV
tiles, chunks a loop, warps, K spans; tl.dot tiles and stages) and the dequantize-then-matmul path, so one
run says which launch each row of TABLE should name and where the dense path should start; and the largest
error of any path's answer against the dense one (relative to its largest value; over MAX_ERROR: listed as
"wrong", exit 1). The weights are each type's own decoding of random blocks (8 rows tiled to N), so the
layout is the real one. Output: one JSON line on stdout (per layer, type and M: the dispatch's ratio to
dense, the best path and its ratio, every path's ms); progress on stderr.

--warm only runs each path once, untimed, to compile what the bench runs into triton's cache (gpu_check.sh
runs it beside the tests, so the timed run starts warm); --dry runs the same code on a CPU under Triton's
interpreter with tiny shapes and 1 rep (a syntax and plumbing check: its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
DRY_SHAPES = ((48, 512),)
MAX_ERROR = 2e-2  # of the largest output: bf16 roundings of y and float32 sums in another order, not a wrong tile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default="1,8,32,512")
    ap.add_argument("--dry", action="store_true", help="a CPU under Triton's interpreter, tiny shapes, 1 rep")
    ap.add_argument("--warm", action="store_true", help="compile every kernel the bench runs, no timing")
    args = ap.parse_args()
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import numpy as np
    import torch

    from metrale.gpu_worker.layers import gguf_quant_types as qt
    from metrale.gpu_worker.layers import triton_gguf as tg

    if not args.dry and not torch.cuda.is_available():
        sys.exit("bench_gguf_cuda: no CUDA device (--dry checks the script on a CPU)")
    device = torch.device("cpu" if args.dry else "cuda")
    reps = 1 if args.dry else args.reps
    shapes = DRY_SHAPES if args.dry else SHAPES
    rows_list = [int(r) for r in args.rows.split(",")]
    flush = None if args.dry else torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def time_ms(fn) -> float:
        """Median ms of single calls, L2 flushed before each."""
        fn()
        if args.dry:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        fn()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    table = _alternatives()  # after triton's import mode is set

    def alternatives(m: int) -> dict[str, tg.Config]:
        """The launches timed beside TABLE's for m rows (split_k 0: PROGRAMS_PER_SM's count of spans)."""
        options = table.get(m) or table[min(table, key=lambda r: abs(r - m))]
        return {_label(c): c for c in (tg.config_for(m), *options) if c.kind != "dense"}

    rng = np.random.default_rng(0)
    results, broken = {}, {}  # broken: the dispatch's own launch failed or answered wrong
    t_start = time.perf_counter()
    for name in args.types.split(","):
        t = qt.TYPES[name]
        for n, k in shapes:
            raw = rng.integers(0, 256, size=(8, k // t.block, t.nbytes), dtype=np.uint8)
            sample = qt.decode(name, _with_small_scales(raw, name, rng).reshape(8, -1))
            blocks = qt.Blocks(
                codes=np.tile(sample.codes, (n // 8, 1)), sc=np.tile(sample.sc, (n // 8, 1)),
                mn=None if sample.mn is None else np.tile(sample.mn, (n // 8, 1)), d=np.tile(sample.d, (n // 8, 1)),
                dm=None if sample.dm is None else np.tile(sample.dm, (n // 8, 1)), sub=sample.sub, sup=sample.sup,
            )
            w = tg.pack_for_triton(blocks, device)
            weight_mb = sum(t.numel() * t.element_size() for t in (w.codes, w.sc, w.mn, w.d, w.dm) if t is not None) / 1e6
            dense = tg.dequantize(w, torch.bfloat16)
            for m in rows_list:
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                want = (x @ dense.T).float()
                paths = {
                    "dispatch": lambda: tg.matmul(x, w),
                    "dequantize_then_matmul": lambda: tg.matmul(x, w, dense=True),
                    **{label: partial(tg.matmul, x, w, c) for label, c in alternatives(m).items()},
                }
                errors, failed = {}, {}
                for label, fn in paths.items():  # one launch's failure (shared memory, say) costs only its row
                    try:
                        errors[label] = float((fn().float() - want).abs().max() / want.abs().max())
                    except Exception as exc:  # noqa: BLE001 - reported in the JSON line, the others still run
                        failed[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
                ok = [label for label, e in errors.items() if e <= MAX_ERROR]
                if args.warm or "dispatch" not in ok:
                    if "dispatch" not in ok:
                        broken[f"{name}_n{n}_k{k}_m{m}"] = failed.get("dispatch") or f"error {errors['dispatch']:.3g}"
                    continue
                dense_ms = time_ms(lambda: x @ dense.T)
                times = {label: time_ms(paths[label]) for label in ok}
                triton_ms = times.pop("dispatch")
                best = min(times, key=times.get) if times else "dispatch"
                best_ms = times.get(best, triton_ms)
                key = f"{name}_n{n}_k{k}_m{m}"
                results[key] = {
                    "config": _label(tg.config_for(m)), "weight_mb": round(weight_mb, 2),
                    "triton_ms": round(triton_ms, 4), "dense_bf16_ms": round(dense_ms, 4),
                    "ratio": round(triton_ms / dense_ms, 3), "best": best, "best_ms": round(best_ms, 4),
                    "best_ratio": round(best_ms / dense_ms, 3), "max_rel_err": float(f"{max(errors.values()):.3g}"),
                    "paths_ms": {label: round(v, 4) for label, v in times.items()},
                    "wrong_paths": {label: float(f"{e:.3g}") for label, e in errors.items() if e > MAX_ERROR},
                    "failed_paths": failed,
                }
                print(f"{key}: triton {triton_ms:.4f} ms, dense {dense_ms:.4f} ms, ratio {triton_ms / dense_ms:.2f}, "
                      f"best {best} {best_ms:.4f} ms, wrong {sorted(results[key]['wrong_paths'])}, failed "
                      f"{sorted(failed)}", file=sys.stderr)
            del dense, w
    if args.warm:
        print(json.dumps({"bench": "gguf_cuda", "warm": True, "seconds": round(time.perf_counter() - t_start, 1),
                          "broken": broken}))
        sys.exit(1 if broken else 0)
    ratios = [r["ratio"] for r in results.values()]
    wrong = sorted(k for k, r in results.items() if r["wrong_paths"] or r["failed_paths"])
    print(json.dumps({
        "bench": "gguf_cuda", "device": "cpu (interpreter, dry)" if args.dry else torch.cuda.get_device_name(),
        "table": {str(b): _label(c) for b, c in tg.TABLE}, "programs_per_sm": tg.PROGRAMS_PER_SM, "reps": reps,
        "seconds": round(time.perf_counter() - t_start, 1), "worst_ratio": max(ratios, default=None),
        "slower_than_dense": sorted(k for k, r in results.items() if r["ratio"] > 1.0),
        "broken": broken, "wrong": wrong, "results": results,
    }))
    if broken:
        sys.exit(f"bench_gguf_cuda: the dispatch's launch failed or is off the dense product by more than {MAX_ERROR}: "
                 f"{', '.join(broken)}")


def _label(c) -> str:
    """A launch's name in the JSON: kind, rows x outputs tile, chunks a loop, warps, stages, K spans (auto: 0)."""
    if c.kind == "dense":
        return "dense"
    return f"{c.kind}_{c.block_m}x{c.block_n}_c{c.chunks}_w{c.num_warps}_s{c.num_stages}_k{c.split_k}"


def _alternatives():
    """rows -> the launches timed beside TABLE's (the nearest row count's list for other counts)."""
    from metrale.gpu_worker.layers.triton_gguf import Config

    gemv = partial(Config, "gemv")
    dot = partial(Config, "dot")
    return {
        1: (gemv(1, 8, chunks=2), gemv(1, 32, chunks=1), gemv(1, 16, chunks=4), gemv(1, 16, chunks=2, split_k=1),
            gemv(1, 64, chunks=1, num_warps=8), gemv(1, 8, chunks=2, num_warps=2), gemv(1, 4, chunks=4, num_warps=1,
            split_k=1), gemv(1, 16, chunks=2, split_k=2), gemv(1, 16, chunks=2, split_k=8)),
        8: (gemv(8, 16), gemv(8, 32, num_warps=8), gemv(4, 16), dot(16, 64, num_stages=2), dot(16, 128, num_stages=3),
            dot(16, 32, num_stages=2)),
        32: (dot(32, 64, num_stages=3), dot(32, 128, num_warps=4, num_stages=2), dot(16, 64, num_stages=2),
             dot(64, 64, num_stages=2), dot(32, 32, num_stages=3)),
        512: (dot(64, 128, num_warps=8, num_stages=3), dot(128, 128, num_warps=8, num_stages=2),
              dot(128, 64, num_warps=4, num_stages=2)),
    }


_SCALE_AT = {"Q8_0": (0,), "Q5_0": (0,), "IQ4_NL": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_1": (0, 2),
             "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_XS": (0,)}


def _with_small_scales(raw, name, rng):
    """Random blocks with small positive fp16 scales where the type keeps them (finite, realistic sums)."""
    import numpy as np

    for at in _SCALE_AT[name]:
        scale = (rng.random(raw.shape[:2]) * 2e-3 + 1e-4).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw


if __name__ == "__main__":
    main()
