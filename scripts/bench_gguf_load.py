"""Benchmark: how fast a GGUF file is ready, and what its weights hold in memory, metrale against llama.cpp.

Each round starts a fresh process per engine, alternated (llama.cpp through llama-cpp-python in its own venv,
--llamacpp-python), on each file with the same context (--ctx tokens of KV cache) and threads:

- llama.cpp: `Llama(path)` construction (its weights mmap'd, vocabulary, context), then the first token of a
  one-token prompt; the process's RSS growth over the construction.
- both: the process's CPU seconds over the load (`load_cpu_s`, every thread's): on a box shared with other work
  the wall seconds grow with its load, the CPU seconds much less.
- metrale, in process: the file's metadata read (gguf_metadata.open_gguf), then `LLM(path)` construction, split
  into the tokenizer, the weights (loader.load_model) and the rest (KV cache, engine), then the first token;
  the weights' resident bytes (gpu_worker/weight_memory.py: the model's own tensors plus the file's pages
  resident in its map) against the file's tensor bytes, and the process's RSS growth over construction.
- with --serve, `metrale serve --model FILE` from spawn to its "serving" line (processes, imports and all).

Figures are medians over --reps rounds; ratios are metrale over llama.cpp on the same file. One JSON line.

    python scripts/bench_gguf_load.py --model smollm2 --files q4_1 q4_k_m --llamacpp-python /work/peers/llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from _bench_common import ServeProcess, emit, git_commit, note
from bench_gguf import gguf_files

LLAMACPP_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
t1 = time.perf_counter()
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
path, threads, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
before = rss()
t2, c2 = time.perf_counter(), time.process_time()
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512, verbose=False)
t3, c3 = time.perf_counter(), time.process_time()
llm.eval([llm.token_bos()])
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t3 - t2, "load_cpu_s": c3 - c2, "first_token_s": t4 - t3, "rss_growth": rss() - before}))
"""

METRALE_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from metrale import LLM, SamplingParams
from metrale.gguf_metadata import open_gguf
from metrale.gpu_worker import model_runner
from metrale.frontend import tokenizer as tokenizer_module
from metrale.gpu_worker.weight_memory import weight_bytes
t1 = time.perf_counter()
path, threads, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
parts = {}
def timed(name, fn):
    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - start
    return wrapper
model_runner.load_model = timed("weights_s", model_runner.load_model)
tokenizer_module.Tokenizer.from_dir = classmethod(timed("tokenizer_s", tokenizer_module.Tokenizer.from_dir.__func__))
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
before = rss()
t2, c2 = time.perf_counter(), time.process_time()
open_gguf(path)
t3 = time.perf_counter()
llm = LLM(path, show_progress=False, max_model_len=ctx, num_kv_blocks=-(-ctx // 16), enable_prefix_caching=False)
t4, c4 = time.perf_counter(), time.process_time()
llm.generate([[llm.tokenizer.bos_token_id or 1]], SamplingParams(max_tokens=1, temperature=0))
t5 = time.perf_counter()
w = weight_bytes(llm.runner.model, path)
rest = (t4 - t3) - parts.get("weights_s", 0.0) - parts.get("tokenizer_s", 0.0)
print(json.dumps({"import_s": t1 - t0, "metadata_s": t3 - t2, "llm_s": t4 - t3, "load_s": t4 - t2, "load_cpu_s": c4 - c2, **parts, "rest_s": rest,
                  "first_token_s": t5 - t4, "rss_growth": rss() - before, "weights_own": w.own, "weights_mapped": w.mapped,
                  "file_tensors": w.file_tensors}))
"""


def run_script(python: str, script: str, path, threads: int, ctx: int) -> dict:
    """One fresh process's figures (its last stdout line)."""
    out = subprocess.run([python, "-c", script, str(path), str(threads), str(ctx)], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{python} failed on {path}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def serve_ready_s(path, threads: int, ctx: int) -> float:
    """Seconds from spawning `metrale serve` to its serving line."""
    start = time.perf_counter()
    server = ServeProcess(path, "--max-model-len", str(ctx), "--num-kv-blocks", str(-(-ctx // 16)),
                          env={"OMP_NUM_THREADS": str(threads)})
    ready = time.perf_counter() - start
    server.stop()
    return ready


def medians(runs: list[dict]) -> dict:
    """Each key's median over the runs (seconds rounded to ms, bytes to whole)."""
    return {k: round(statistics.median(r[k] for r in runs), 3 if k.endswith("_s") else None) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["bench-small", "bench-tiny", "smollm2"], default="smollm2")
    ap.add_argument("--files", nargs="+", default=["q4_1"], help="GGUF kinds, as bench_gguf.py names them")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048, help="tokens of KV cache in both engines")
    ap.add_argument("--serve", action="store_true", help="also time `metrale serve` to its serving line")
    ap.add_argument("--llamacpp-python", default=None, help="python of a venv with llama-cpp-python")
    args = ap.parse_args()

    files = gguf_files(args.model, args.files, args.llamacpp_python)
    runs: dict[str, list[dict]] = {}
    for rep in range(args.reps):
        for kind, path in files.items():
            if args.llamacpp_python:
                runs.setdefault(f"llama.cpp {kind}", []).append(run_script(args.llamacpp_python, LLAMACPP_SCRIPT, path, args.threads, args.ctx))
            runs.setdefault(f"metrale {kind}", []).append(run_script(sys.executable, METRALE_SCRIPT, path, args.threads, args.ctx))
            if args.serve:
                runs.setdefault(f"metrale serve {kind}", []).append({"ready_s": serve_ready_s(path, args.threads, args.ctx)})
        note(f"round {rep + 1}/{args.reps} done")
    figures = {name: medians(r) for name, r in runs.items()}
    ratios = {}
    for kind in files:
        ours, peer = figures[f"metrale {kind}"], figures.get(f"llama.cpp {kind}")
        ours["weights_resident_over_file"] = round((ours["weights_own"] + ours["weights_mapped"]) / ours["file_tensors"], 3)
        if peer:
            ratios[kind] = {
                "load": round(ours["load_s"] / peer["load_s"], 2),
                "load_cpu": round(ours["load_cpu_s"] / peer["load_cpu_s"], 2),
                "weights_only": round(ours["weights_s"] / peer["load_s"], 2),
                "load_and_first_token": round((ours["load_s"] + ours["first_token_s"]) / (peer["load_s"] + peer["first_token_s"]), 2),
            }
            if args.serve:
                ratios[kind]["serve_ready_over_llamacpp_import_and_load"] = round(
                    figures[f"metrale serve {kind}"]["ready_s"] / (peer["import_s"] + peer["load_s"]), 2)
    emit({"bench": "gguf_load", "model": args.model, "commit": git_commit(), "threads": args.threads, "reps": args.reps,
          "ctx": args.ctx, "figures": figures, "ratios": ratios})


if __name__ == "__main__":
    sys.exit(main())
