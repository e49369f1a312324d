"""Benchmark: a GGUF model's batch-1 decode with its parts moved between kernel classes, in one process.

Loads the file once on the process's class (the CPU's best, or METRALE_CPU_ISA's), then times greedy decode with
the fused decode step (cpu_decode_step.cpp: norms, rotary, KV write, attention, residuals) built from one class's
library, the layers' quantized products taken from one class, and the LM head's product from one class, for each
configuration named on the command line as step/products/head (e.g. amx/amx/amx, avx2/avx2/avx2,
amx/avx512_bf16/avx2). Configurations alternate round after round; figures are medians of ms/token. It answers
which part runs fastest on which class of this CPU (what kernel_choice.py measures at start-up). Only decode is
timed: off the process's class a layer takes no wide product, so its prefill is not representative. One JSON line.

    python scripts/bench_decode_classes.py --file out/gguf/smollm2.q4_k_m.gguf amx/amx/amx avx2/avx2/avx2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import emit, git_commit, note, random_prompts  # noqa: E402


def products_of(model):
    """Every GGUF layer of the model with native products: (layer, [runs]) (the head included)."""
    from metrale.gpu_worker.layers.quantization import NativeProduct

    out = []
    for module in model.modules():
        runs = getattr(module, "gguf_runs", None)
        if runs and all(isinstance(r.product, NativeProduct) for r in runs):
            out.append(module)
    return out


def on_class(product, cls: str):
    """The same product (same packed weight) through class cls's op."""
    from metrale.gpu_worker.layers import cpu_kernels
    from metrale.gpu_worker.layers.quantization import NativeProduct

    name = product.op._schema.name.split("::", 1)[1]
    return NativeProduct(getattr(cpu_kernels.ops(cls), name).default, product.args, product.rows, product.takes_wide)


def configure(model, step_cls: str, prod_cls: str, head_cls: str, originals: dict) -> None:
    """Point the layers' products at prod_cls (the head at head_cls) and rebuild the fused step from step_cls."""
    from metrale.gpu_worker.layers import cpu_kernels
    from metrale.gpu_worker.models.fused_decode import FusedDecode

    for layer in products_of(model):
        if id(layer) not in originals:
            originals[id(layer)] = ([r.product for r in layer.gguf_runs], layer.wide)
        products, wide = originals[id(layer)]
        cls = head_cls if layer is model.lm_head else prod_cls
        for run, product in zip(layer.gguf_runs, products):
            run.product = on_class(product, cls)
        layer.wide = wide and cls == "amx"
        if layer.gguf_single is not None or len(layer.gguf_runs) == 1 and not layer.wide:
            layer.gguf_single = layer.gguf_runs[0].product
    own = cpu_kernels.classes
    cpu_kernels.classes = lambda cls=None: own(step_cls)
    try:
        model.fused_decode = FusedDecode.build(model)
    finally:
        cpu_kernels.classes = own
    assert model.fused_decode is not None, "the model takes no fused decode step"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("configs", nargs="+", help="step/products/head kernel classes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from metrale import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.file, show_progress=False, enable_prefix_caching=False)
    model = llm.runner.model
    prompt = random_prompts(1, args.prompt_len, seed=0, vocab_end=40000)[0]
    configs = [tuple(c.split("/")) for c in args.configs]
    originals: dict = {}
    samples: dict[str, list[float]] = {c: [] for c in args.configs}
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    outputs = {}
    for rep in range(args.reps + 1):  # round 0 warms each configuration up
        for name, cfg in zip(args.configs, configs):
            configure(model, *cfg, originals)
            t0 = time.perf_counter()
            llm.generate([prompt], first)
            t1 = time.perf_counter()
            out = llm.generate([prompt], many)
            t2 = time.perf_counter()
            outputs.setdefault(name, out[0].token_ids)
            if rep:
                samples[name].append(((t2 - t1) - (t1 - t0)) / (args.new - 1) * 1e3)
        note(f"round {rep}/{args.reps} done")
    base = outputs[args.configs[0]]
    emit({"bench": "decode_classes", "file": os.path.basename(args.file), "commit": git_commit(), "threads": args.threads,
          "reps": args.reps, "new": args.new, "prompt_len": args.prompt_len,
          "ms_per_token": {n: round(statistics.median(s), 3) for n, s in samples.items()},
          "same_tokens_as_first": {n: o == base for n, o in outputs.items()}})


if __name__ == "__main__":
    sys.exit(main())
