"""Multi-LoRA decode throughput: one batch on the base model alone against the same batch split over N adapters.

    python scripts/bench_lora.py [--model PATH] [--batch 32] [--adapters 4] [--rank 16] [--alpha 32]
        [--prompt-len 32] [--max-tokens 64] [--repeats 3] [--layout interleaved] [--threads 2] [--dtype auto]

One LLM(enable_lora=True, max_loras=max(4, adapters), max_lora_rank=rank) serves both arms, so only the
adapters differ:

  base   every row on the base model (lora_request None): the steps a LoRA-enabled engine runs when no
         request names an adapter
  mixed  the rows split over `adapters` adapters (--layout interleaved: row i on adapter i % N, the order
         requests from many tenants arrive in; blocks: contiguous runs of rows), every row adapted

The adapters are written here, not trained: PEFT folders (adapter_config.json + adapter_model.safetensors) of
rank `rank` on all seven projections (q, k, v, o, gate, up, down) of every decoder layer, with random A and B,
shapes from the model's config (metrale.model_facts.resolve_model: a Hugging Face folder's config.json or a
GGUF's metadata mapped to it, so any llama-family checkpoint, quantized ones included). A is uniform in
±1/sqrt(in) (PEFT's kaiming bound), B normal with a spread that makes the adapter's product about
DELTA_SCALE of its input's size: a real adapter's scale, not zeros, so a mistake that skipped the product
would show in the check below and not pass as a fast adapter. Default model: the tiny random Llama of
metrale.gpu_worker.tiny_model, built into a temporary folder with the adapters.

Each repetition draws fresh prompts (`batch` × `prompt-len` random token ids, no special tokens, a new set per
arm, so the prefix cache never helps), greedy, exactly `max-tokens` new tokens (ignore_eos), one generate()
call per arm; the arms alternate which goes first. Figures per arm:

  decode_tok_s  tokens committed in the steady-decode window (every row has its first token .. the first
                row has its last) ÷ the window's length: the decode throughput, and the target's figure
  tok_s         all generated tokens ÷ the wall time of the generate() call (prefill included)

Medians over the repetitions; each ratio (mixed/base) is the median of the ratios of the two runs of one
repetition, so a drift in the machine's load cancels. Target: mixed/base decode >= 0.8. Before the clock, a
warm-up runs both arms once on the same prompts (the timed runs' shapes) and counts the rows whose greedy
tokens the adapters changed (`adapter_rows_changed`: should be most rows; 0 means the adapters were not applied).

Output: progress on stderr, one JSON line on stdout. On a shared CPU the figures are noisy: `load` in the
JSON says how much of the machine other processes took while this ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

FORMAT = 1  # bump when a key of the JSON line changes meaning
TARGET_DECODE_RATIO = 0.8  # mixed/base decode_tok_s
DELTA_SCALE = 0.05  # an adapter's product ≈ this × its input's size (per element, root mean square)
WARMUP_SEED = 10_000
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a llama-family Hugging Face folder or .gguf (default: the tiny random Llama)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4, help="adapters the mixed arm's rows are split over")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0, help="PEFT's lora_alpha (scaling alpha / rank)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layout", choices=("interleaved", "blocks"), default="interleaved",
                    help="which rows each adapter gets: row i on i %% N, or contiguous runs")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="as LLM takes it (none: a GGUF's layers dense)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if min(args.batch, args.adapters, args.rank, args.prompt_len, args.repeats) < 1 or args.max_tokens < 2:
        ap.error("--batch, --adapters, --rank, --prompt-len and --repeats must be at least 1, --max-tokens at least 2")
    return args


# ---- the adapters --------------------------------------------------------------------------------


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features, from a llama-family config (a GGUF's mapped one too)."""
    from metrale.model_facts import decoder_config

    cfg = decoder_config(config)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }


def write_adapter(out: pathlib.Path, config: dict, rank: int, alpha: float, seed: int, base: str) -> pathlib.Path:
    """A PEFT LoRA folder at out: rank `rank` on every projection of every layer, random A and B (see the docstring)."""
    import numpy as np
    from safetensors.numpy import save_file

    from metrale.model_facts import decoder_config

    rng = np.random.default_rng(seed)
    layers = decoder_config(config)["num_hidden_layers"]
    scaling = alpha / rank
    # x @ A.T has elements of rms |x|_rms / sqrt(3) (A uniform in ±1/sqrt(in)); B's spread brings the product
    # (× scaling) to DELTA_SCALE × |x|_rms.
    b_std = DELTA_SCALE * math.sqrt(3) / (math.sqrt(rank) * scaling)
    tensors = {}
    for i in range(layers):
        for proj, (fan_in, fan_out) in projection_shapes(config).items():
            module = f"base_model.model.model.layers.{i}.{'self_attn' if proj in ATTENTION else 'mlp'}.{proj}"
            bound = 1.0 / math.sqrt(fan_in)
            tensors[f"{module}.lora_A.weight"] = rng.uniform(-bound, bound, size=(rank, fan_in)).astype(np.float32)
            tensors[f"{module}.lora_B.weight"] = rng.normal(0.0, b_std, size=(fan_out, rank)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(ATTENTION + MLP), "bias": "none",
        "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(peft_config, indent=2))
    return out


# ---- the runs ------------------------------------------------------------------------------------


class WithAdapters:
    """An LLM whose generate() gives each prompt its adapter: what bc.run_offline drives (its step clock goes
    onto the LLM's own engine, so both arms are timed by the same code)."""

    def __init__(self, llm, lora_requests: list | None):
        self.llm = llm
        self.lora_requests = lora_requests

    @property
    def engine(self):
        return self.llm.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.llm.engine = engine

    def generate(self, prompts, params):
        """The LLM's generate with this arm's adapters."""
        return self.llm.generate(prompts, params, lora_request=self.lora_requests)


def row_adapters(batch: int, names: list[str], layout: str) -> list:
    """Each row's LoRARequest in the mixed arm."""
    from metrale import LoRARequest

    n = len(names)
    if layout == "interleaved":
        return [LoRARequest(names[i % n]) for i in range(batch)]
    per = -(-batch // n)
    return [LoRARequest(names[min(i // per, n - 1)]) for i in range(batch)]


def run_arm(arm: WithAdapters, prompts: list[list[int]], max_tokens: int) -> dict:
    """One generate() of the arm over the prompts: its figures (ValueError if a row came up short)."""
    timeline = bc.run_offline(arm, prompts, bc.greedy_params(max_tokens))
    figures = timeline.figures()
    if figures["output_tokens"] != len(prompts) * max_tokens:
        raise ValueError(f"{figures['output_tokens']} tokens generated, expected {len(prompts) * max_tokens}")
    return {"decode_tok_s": figures["decode_tok_s"], "tok_s": figures["throughput_tok_s"], "wall_s": figures["wall_s"]}


def rows_changed(arms: dict[str, WithAdapters], prompts: list[list[int]], max_tokens: int) -> int:
    """Warm both arms on the same prompts (the timed runs' shapes); how many rows' greedy tokens the adapters changed."""
    params = bc.greedy_params(max_tokens)
    base = arms["base"].generate(prompts, params)
    mixed = arms["mixed"].generate(prompts, params)
    arms["base"].llm.reset_prefix_cache()
    return sum(a.token_ids != b.token_ids for a, b in zip(base, mixed))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def measure(args: argparse.Namespace, model: str, adapter_root: pathlib.Path) -> dict:
    """Write the adapters, load the LLM, run the alternated repetitions; the JSON line's figures."""
    from metrale import LLM
    from metrale.model_facts import resolve_model

    config = resolve_model(model).config
    names = [f"bench-{i}" for i in range(args.adapters)]
    paths = [write_adapter(adapter_root / name, config, args.rank, args.alpha, args.seed + i, model) for i, name in enumerate(names)]
    bc.note(f"[lora] {args.adapters} adapters of rank {args.rank} written to {adapter_root}; loading {model}")
    llm = LLM(model, dtype=args.dtype, enable_lora=True, lora_modules=[f"{n}={p}" for n, p in zip(names, paths)],
              max_loras=max(4, args.adapters), max_lora_rank=args.rank, show_progress=False,
              quantization=args.quantization)
    try:
        vocab_end = min(llm.tokenizer.vocab_size, llm.engine.info.vocab_size)
        arms = {"base": WithAdapters(llm, None), "mixed": WithAdapters(llm, row_adapters(args.batch, names, args.layout))}
        warm = bc.random_prompts(args.batch, args.prompt_len, WARMUP_SEED, vocab_end)
        changed = rows_changed(arms, warm, args.max_tokens)
        bc.note(f"[lora] warm-up: the adapters changed {changed}/{args.batch} rows' greedy tokens")
        runs: dict[str, list[dict]] = {"base": [], "mixed": []}
        for rep in range(args.repeats):
            order = ["base", "mixed"] if rep % 2 == 0 else ["mixed", "base"]
            for k, name in enumerate(order):
                prompts = bc.random_prompts(args.batch, args.prompt_len, args.seed + 100 * rep + k, vocab_end)
                runs[name].append(run_arm(arms[name], prompts, args.max_tokens))
            bc.note(f"[lora rep {rep + 1}/{args.repeats}] " + "  ".join(
                f"{n} decode {r[-1]['decode_tok_s']:,.1f} tok/s (all {r[-1]['tok_s']:,.1f})" for n, r in runs.items()))
        ratio = bc.paired_ratio(runs["mixed"], runs["base"], "decode_tok_s")
        return {
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "kernels": llm.engine.info.kernels,
                        "device": str(llm.runner.device) if llm.runner is not None else None},
            "base": bc.median_figures(runs["base"]),
            "mixed": bc.median_figures(runs["mixed"]),
            "mixed_vs_base_decode": ratio,
            "mixed_vs_base_tok_s": bc.paired_ratio(runs["mixed"], runs["base"], "tok_s"),
            "target": {"value": ratio, "target": TARGET_DECODE_RATIO, "met": ratio is not None and ratio >= TARGET_DECODE_RATIO},
            "adapter_rows_changed": changed,
            "runs": {name: [{k: v if v is None else round(v, 3) for k, v in r.items()} for r in rs] for name, rs in runs.items()},
        }
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print its JSON line (stdout)."""
    args = parse_args(argv)
    threads = bc.set_torch_threads(args.threads)
    meter = bc.LoadMeter()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="metrale-bench-lora-") as tmp:
        model = args.model
        if model is None:
            from metrale.gpu_worker.tiny_model import make_tiny_model

            model = str(make_tiny_model(pathlib.Path(tmp) / "model", "llama"))
        figures = measure(args, model, pathlib.Path(tmp) / "adapters")
    record = {
        "bench": "lora",
        "format": FORMAT,
        "commit": bc.git_commit(),
        "model": args.model or "tiny_model llama (test preset)",
        "config": {"batch": args.batch, "adapters": args.adapters, "rank": args.rank, "alpha": args.alpha,
                   "targets": list(ATTENTION + MLP), "layout": args.layout, "prompt_len": args.prompt_len,
                   "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": threads, "dtype": args.dtype},
        **figures,
        "load": meter.report(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    bc.emit(record)


if __name__ == "__main__":
    main()
