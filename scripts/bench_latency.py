"""Batch-1 latency: metrale against llama.cpp on one model, and both against the box's bandwidth bound.

    python scripts/bench_latency.py --gguf FILE [--model DIR | --preset bench-small] [--dtype bfloat16]
        [--prompt-len 128] [--new-tokens 128] [--reps 10] [--threads 2]
        [--llamacpp-python /work/venvs/llamacpp/bin/python] [--no-limits]

One request at a time, 128 random prompt ids, exactly --new-tokens greedy new tokens; per repetition a
fresh prompt, the same for both engines, the engines alternated (A B, B A, ...) after the CPUs go idle.
  metrale    metrale.LLM in this process (one generate() per run); its tokens are stamped as the engine
             commits them (_bench_common.run_offline)
  floor      the LLM's own runner stepping the same request with forward_only (no engine, no sampling)
  llamacpp   llama_cpp.Llama (llama-cpp-python) on the GGUF file, in a subprocess under
             --llamacpp-python (its own venv; never a dependency of metrale), n_threads = --threads;
             `generate` with top_k=1, stamped per token
Figures per engine: time to first token (prompt in, first token out) and decode ms/token (first to last
token ÷ tokens − 1); medians over repetitions, with the spread (min–max); ratios are medians of the
per-repetition ratios. The bandwidth bound comes from bench_limits.measure (the bytes a batch-1 step reads
at the mean context ÷ the streaming-read bandwidth); each engine's decode step is reported as a fraction of it.

The GGUF file must hold the same weights as --model: make it with llama.cpp's convert_hf_to_gguf.py
(`--outtype bf16`, see docs/performance.md). Output: a table on stderr, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The benchmark's helpers (numpy, psutil, metrale) are imported by main(): the llama.cpp child runs this
# file under a Python that has none of them.
bc = bench_limits = None

FORMAT = 1  # bump when a key of the JSON line changes meaning
WARMUP_SEED = 20_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the --preset's cached random Llama)")
    ap.add_argument("--preset", default="bench-small")
    ap.add_argument("--gguf", default=None, help="the same model as a GGUF file, for llama.cpp")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine (torch intra-op; llama.cpp n_threads)")
    ap.add_argument("--engines", default="metrale,floor,llamacpp")
    ap.add_argument("--llamacpp-python", default=None, help="a Python that can import llama_cpp")
    ap.add_argument("--no-limits", action="store_true", help="skip measuring the bandwidth bound")
    ap.add_argument("--llamacpp-child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---- llama.cpp: the child process (runs under --llamacpp-python; stdlib and llama_cpp only) ---------


def llamacpp_child(spec_json: str) -> int:
    """Load the GGUF, say ready, then run each JSON command from stdin: prompt ids in, per-token stamps out."""
    spec = json.loads(spec_json)
    from llama_cpp import Llama, __version__

    llm = Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_batch=spec["n_ctx"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], verbose=False)
    print(json.dumps({"ready": True, "version": __version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] != "run":
            break
        stamps = []
        start = time.perf_counter()
        for _ in llm.generate(cmd["prompt"], top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == cmd["new_tokens"]:
                break
        print(json.dumps({"start": start, "stamps": stamps}), flush=True)
    return 0


class LlamaCpp:
    """llama.cpp in a subprocess; one request per run."""

    name = "llamacpp"

    def __init__(self, python: str, gguf: str, threads: int, n_ctx: int) -> None:
        spec = json.dumps({"gguf": gguf, "threads": threads, "n_ctx": n_ctx})
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--llamacpp-child", spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            self.close()
            raise RuntimeError("llama.cpp child did not start")
        self.version = ready["version"]

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        """TTFT and decode ms/token of one request."""
        self.proc.stdin.write(json.dumps({"cmd": "run", "prompt": prompt, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        return _figures(out["start"], out["stamps"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class Metrale:
    """metrale.LLM in this process, one generate() per run, tokens stamped as committed."""

    name = "metrale"

    def __init__(self, model_dir, dtype: str) -> None:
        from metrale import LLM

        self.llm = LLM(str(model_dir), dtype=dtype, show_progress=False)

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        timeline = bc.run_offline(self.llm, [prompt], bc.greedy_params(new_tokens))
        (arrivals,) = timeline.arrivals.values()
        stamps = [t for t, n in arrivals for _ in range(n)]
        if len(stamps) != new_tokens:
            raise RuntimeError(f"metrale: {len(stamps)} tokens, expected {new_tokens}")
        return _figures(timeline.start, stamps)

    def close(self) -> None:
        self.llm.close()


class Floor:
    """The LLM's own runner stepping the request with forward_only (_bench_common.Floor)."""

    name = "floor"

    def __init__(self, metrale: Metrale) -> None:
        self.floor = bc.Floor(metrale.llm)

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        r = self.floor.run([prompt], new_tokens)
        return {"ttft_ms": sum(r.prefill_steps_s) * 1e3, "decode_ms": statistics.median(r.decode_steps_s) * 1e3}

    def close(self) -> None:
        """The runner is the LLM's."""


def _figures(start: float, stamps: list[float]) -> dict:
    """TTFT and decode ms/token from a request's start and its tokens' arrival times."""
    return {"ttft_ms": (stamps[0] - start) * 1e3, "decode_ms": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3}


def main(argv: list[str] | None = None) -> int:
    """Run the session and print the table and the JSON line."""
    global bc, bench_limits
    args = parse_args(argv)
    if args.llamacpp_child is not None:
        return llamacpp_child(args.llamacpp_child)
    import _bench_common as bc
    import bench_limits
    threads = bc.set_torch_threads(args.threads)
    model = args.model
    if model is None:
        from metrale.gpu_worker.tiny_model import FORMAT_VERSION, cached_model_dir

        model = cached_model_dir(f"bench/{args.preset}-llama-bfloat16-v{FORMAT_VERSION}", args.preset, "bfloat16")
    meter = bc.LoadMeter()
    names = [e for e in args.engines.split(",") if e]
    skipped = {}
    if "llamacpp" in names and not (args.llamacpp_python and args.gguf):
        skipped["llamacpp"] = "needs --llamacpp-python and --gguf"
        names.remove("llamacpp")
    limits = None
    if not args.no_limits:
        limits = bench_limits.measure(model, args.dtype, batches=(1,), context=args.prompt_len + args.new_tokens // 2)
    engines: dict = {}
    try:
        if "metrale" in names or "floor" in names:
            engines["metrale"] = Metrale(model, args.dtype)
        if "floor" in names:
            engines["floor"] = Floor(engines["metrale"])
        if "llamacpp" in names:
            engines["llamacpp"] = LlamaCpp(args.llamacpp_python, args.gguf, threads, args.prompt_len + args.new_tokens + 16)
        order = [n for n in names if n in engines]
        vocab_end = bc.plain_vocab_end(model)
        warm = bc.random_prompts(1, args.prompt_len, WARMUP_SEED, vocab_end)[0]
        for name in order:
            engines[name].run(warm, 8)
        runs: dict[str, list[dict]] = {n: [] for n in order}
        for rep in range(args.reps):
            prompt = bc.random_prompts(1, args.prompt_len, rep, vocab_end)[0]
            for name in order if rep % 2 == 0 else order[::-1]:
                bc.settle(0.3)
                runs[name].append(engines[name].run(prompt, args.new_tokens))
                meter.sample()
    finally:
        for engine in engines.values():
            engine.close()
    result = {n: _summary(r, limits) for n, r in runs.items()}
    ratios = {}
    for a, b in (("metrale", "llamacpp"), ("floor", "llamacpp"), ("metrale", "floor")):
        if a in runs and b in runs:
            for key in ("decode_ms", "ttft_ms"):
                pairs = [x[key] / y[key] for x, y in zip(runs[a], runs[b])]
                ratios[f"{a}_vs_{b}_{key}"] = round(statistics.median(pairs), 3)
    bc.note(f"{os.path.basename(str(model))} {args.dtype}, batch 1, {threads} threads, {args.reps} reps")
    if limits:
        bc.note(f"bandwidth {limits['bandwidth_gb_s']} GB/s, decode reads {limits['decode_bytes'] / 1e6:.1f} MB: "
                f"bound {limits['bandwidth_bound_ms']} ms/token")
    rows = [[n, s["decode_ms"], f"{s['decode_ms_min']:.2f}–{s['decode_ms_max']:.2f}", s["ttft_ms"], s.get("fraction_of_bandwidth_bound")]
            for n, s in result.items()]
    bc.note(bc.table(rows, ["engine", "decode ms/token", "spread", "TTFT ms", "of bound"]))
    bc.note("  ".join(f"{k} {v}" for k, v in ratios.items()))
    bc.emit({
        "bench": "latency", "format": FORMAT, "commit": bc.git_commit(), "model": os.path.basename(os.path.normpath(str(model))),
        "dtype": args.dtype, "threads": threads, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps,
        "llamacpp_version": getattr(engines.get("llamacpp"), "version", None), "skipped": skipped,
        "limits": limits, "engines": result, "ratios": ratios, "load": meter.report(),
    })
    return 0


def _summary(runs: list[dict], limits: dict | None) -> dict:
    """Medians and spread of one engine's runs, and its decode step as a fraction of the bandwidth bound."""
    decode = [r["decode_ms"] for r in runs]
    out = {
        "decode_ms": round(statistics.median(decode), 3),
        "decode_ms_min": round(min(decode), 3),
        "decode_ms_max": round(max(decode), 3),
        "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 2),
    }
    if limits:
        out["fraction_of_bandwidth_bound"] = bench_limits.fraction(limits["bandwidth_bound_ms"], out["decode_ms"])
    return out


if __name__ == "__main__":
    sys.exit(main())
