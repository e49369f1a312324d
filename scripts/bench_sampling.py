"""The sampler's cost per step at the settings clients send: one JSON line.

For each vocabulary (32,000, 49,152, 151,936) and batch 32, milliseconds per sampler call on --threads threads
(default 2) for greedy, temperature 0.8, top-k 50 + top-p 0.9 + min-p 0.05, top-p 0.9 with repetition and
presence penalties over 600 tokens of history, and all of them at once; medians over repeats that alternate
the settings. The path is named: the native kernels' instruction-set class (cpu_kernels.isa(), METRALE_CPU_ISA
forces one) or torch.

    python scripts/bench_sampling.py [--threads 2] [--repeats 15] [--dtype float32|bfloat16] [--torch]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.sampler import Sampler
from metrale.ipc.plan import StepPlan

VOCABS = (32000, 49152, 151936)
BATCH = 32
HISTORY = 600  # tokens: a 500-token prompt and 100 generated
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "topk_topp_minp": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "topp_penalties": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2),
    "all": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2),
}


def plan_of(setting: dict, vocab: int, rng: np.random.Generator) -> StepPlan:
    """A decode plan of BATCH rows with these sampling parameters (and HISTORY tokens each when penalised)."""
    n = BATCH
    full = lambda key, default, dtype: np.full(n, setting.get(key, default), dtype=dtype)  # noqa: E731
    penalised = setting.get("repetition_penalty", 1.0) != 1.0 or setting.get("presence_penalty", 0.0) != 0.0
    hist = rng.integers(0, vocab, (n, HISTORY if penalised else 0)).astype(np.int32)
    return StepPlan(
        input_ids=np.zeros(n, np.int32), positions=np.full(n, 999, np.int32), slot_mapping=np.zeros(n, np.int64),
        query_start=np.arange(n + 1, dtype=np.int32), seq_lens=np.full(n, 1000, np.int32),
        block_tables=np.zeros((n, 1), np.int32), sample=np.ones(n, bool), feed_from_row=np.full(n, -1, np.int32),
        temperature=full("temperature", 0.0, np.float32), top_k=full("top_k", 0, np.int32),
        top_p=full("top_p", 1.0, np.float32), min_p=full("min_p", 0.0, np.float32),
        repetition_penalty=full("repetition_penalty", 1.0, np.float32),
        presence_penalty=full("presence_penalty", 0.0, np.float32), frequency_penalty=full("frequency_penalty", 0.0, np.float32),
        seeds=np.arange(n, dtype=np.int64), mask_kind=np.zeros(n, np.uint8), force_token=np.zeros(n, np.int32),
        ban_ids=np.full((n, 1), -1, np.int32), num_logprobs=np.full(n, -1, np.int32),
        hist_tokens=hist.reshape(-1), hist_start=(np.arange(n + 1) * hist.shape[1]).astype(np.int32),
        hist_prompt_len=np.full(n, 500 if penalised else 0, np.int32),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the logits' dtype")
    ap.add_argument("--torch", action="store_true", help="the torch path even where the native kernels load")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = not args.torch and cpu_kernels.available() and cpu_kernels.has("sample_rows")
    if not native:
        cpu_kernels._active["ops"] = None  # the sampler's torch path
    rng = np.random.default_rng(0)
    out = {"bench": "sampling", "path": cpu_kernels.isa() if native else "torch", "threads": args.threads,
           "batch": BATCH, "history": HISTORY, "dtype": args.dtype, "ms": {}}
    for vocab in VOCABS:
        sampler = Sampler(vocab, torch.device("cpu"))
        logits = (torch.randn(BATCH, vocab, generator=torch.Generator().manual_seed(vocab)) * 3).to(getattr(torch, args.dtype))
        rows = torch.arange(BATCH)
        plans = {name: plan_of(setting, vocab, rng) for name, setting in SETTINGS.items()}
        times: dict[str, list[float]] = {name: [] for name in plans}
        for name, plan in plans.items():  # warm-up: scratch, caches
            sampler(logits, plan, rows)
        for _ in range(args.repeats):
            for name, plan in plans.items():
                t = time.perf_counter()
                sampler(logits, plan, rows)
                times[name].append(time.perf_counter() - t)
        out["ms"][str(vocab)] = {name: round(1000 * float(np.median(ts)), 3) for name, ts in times.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
