"""metrale.LLM offline against its own forward-only floor and transformers' generate, on one model, in one run.

    python scripts/bench_offline.py [--preset bench-tiny] [--dtypes float32,bfloat16] [--batches 1,8,32]
        [--prompt-len 128] [--new-tokens 128] [--repeats 3] [--threads 2] [--no-transformers]
        [--mixed] [--mixed-requests 256] [--hf-batch 32]

For each dtype a random Llama of the preset is built once with metrale.gpu_worker.tiny_model into a cache
folder ($METRALE_CACHE_DIR or ~/.cache/metrale, then bench/), never into the repository. Per batch size,
`batch` prompts of `prompt-len` random token ids (no special tokens), greedy, exactly `new-tokens` new
tokens (ignore_eos). Each repetition draws a fresh prompt set (so no prefix cache helps), the same for
every engine, and runs the engines back to back in this order, so a drift in the machine's load hits
them alike:

  metrale       LLM.generate, pipelined decode lane (the default)
  sync          LLM(pipeline=False).generate: the synchronous loop
  floor         the metrale LLM's own ModelRunner, stepping the same batch in a bare loop with
                ModelRunner.forward_only (forward + logits, no sampling, no engine): the prompts in
                prefill steps of whole prompts within max_num_batched_tokens (as the engine schedules
                them), then new-tokens - 1 decode steps, KV blocks handed out as the engine's pool
                does; every plan is built before the clock starts
  transformers  AutoModelForCausalLM.generate on the same folder, sdpa, static batch, left-padded,
                greedy, min_new_tokens = max_new_tokens, always with 2 torch threads

Throughput = output tokens / wall time of the call (prefill included). Figures are medians over the
repetitions; each ratio is the median over repetitions of the ratio of two runs made in the same
repetition (engine/floor, engine/transformers, pipelined/synchronous). --threads sets torch's intra-op
threads for metrale and its floor (the LLM's engine core runs on the calling thread beside them).

--mixed adds the scheduler issue's workload once (256 requests, prompts 32-1024, outputs 32-512,
seeded): metrale gets all of them in one generate() call; transformers runs them in static left-padded
batches of --hf-batch in arrival order and is credited only with the tokens each request asked for.
Throughput, TTFT and inter-token latency percentiles for both (every request is submitted at time 0).
It takes several minutes per dtype on a 2-core machine (the wall time is printed and in the JSON).

Output: a table on stderr, one JSON line on stdout (stable keys; see docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

FORMAT = 1  # bump when a key of the JSON line changes meaning
TARGETS = {"engine_vs_floor": 0.95, "engine_vs_transformers": 1.5}  # at the largest batch
HF_THREADS = 2
WARMUP_SEED = 10_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-tiny", help="tiny_model preset to build (bench-tiny, bench-small)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads for metrale and its floor")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers (metrale and floor only)")
    ap.add_argument("--sampled", action="store_true",
                    help="also run metrale sampling (temperature 0.8, top_p 0.95, seeded) beside greedy")
    ap.add_argument("--mixed", action="store_true", help="also run the mixed workload (slow: minutes per dtype)")
    ap.add_argument("--mixed-requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=32, help="transformers' static batch on the mixed workload")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ---- the model ---------------------------------------------------------------------------------


def model_dir(preset: str, dtype: str) -> pathlib.Path:
    """The preset's random Llama in this dtype, built once into the cache folder (atomically)."""
    from metrale.gpu_worker.tiny_model import FORMAT_VERSION, cached_model_dir

    return cached_model_dir(f"bench/{preset}-llama-{dtype}-v{FORMAT_VERSION}", preset, dtype)


# ---- the engines -------------------------------------------------------------------------------


class Metrale:
    """metrale.LLM, pipelined or synchronous; one generate() call per run."""

    def __init__(self, path: pathlib.Path, dtype: str, pipeline: bool):
        from metrale import LLM

        self.name = "metrale" if pipeline else "sync"
        self.llm = LLM(str(path), dtype=dtype, pipeline=pipeline, show_progress=False)

    def params(self, new_tokens: int):
        """Greedy: the benchmark's default sampling."""
        return bc.greedy_params(new_tokens)

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """Throughput of one generate() over the batch."""
        params = self.params(new_tokens)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params)
        wall = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        if tokens != len(prompts) * new_tokens:
            raise RuntimeError(f"{self.name}: {tokens} tokens, expected {len(prompts) * new_tokens}")
        return {"tok_s": tokens / wall, "wall_s": wall}

    def close(self) -> None:
        self.llm.close()


class Sampled(Metrale):
    """The pipelined LLM (shared with "metrale") sampling as OpenAI clients ask: temperature 0.8, top_p 0.95,
    seeded per request (--sampled)."""

    def __init__(self, greedy: Metrale):
        self.name = "sampled"
        self.llm = greedy.llm

    def params(self, new_tokens: int):
        from metrale.ipc.sampling import SamplingParams

        return SamplingParams(max_tokens=new_tokens, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)

    def close(self) -> None:
        """The LLM is the greedy engine's: it closes it."""


class Floor:
    """The LLM's own model runner stepping the batch in a bare loop of forward_only calls (_bench_common.Floor)."""

    name = "floor"

    def __init__(self, llm):
        self.floor = bc.Floor(llm)

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """Prefill steps then decode steps; the decode step time is reported too."""
        r = self.floor.run(prompts, new_tokens)
        return {
            "tok_s": len(prompts) * new_tokens / r.wall_s,
            "wall_s": r.wall_s,
            "decode_step_ms": statistics.median(r.decode_steps_s) * 1e3 if r.decode_steps_s else None,
            "prefill_s": sum(r.prefill_steps_s),
        }

    def close(self) -> None:
        """Nothing to release: the runner is the LLM's."""


class Transformers:
    """transformers' generate on the same folder: sdpa, static left-padded batches, 2 threads."""

    name = "transformers"

    def __init__(self, path: pathlib.Path, dtype: str):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.version = transformers.__version__
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """Throughput of one generate() over the batch (equal prompt lengths: no padding)."""
        start = time.perf_counter()
        self.generate(prompts, [new_tokens] * len(prompts), len(prompts))
        wall = time.perf_counter() - start
        return {"tok_s": len(prompts) * new_tokens / wall, "wall_s": wall}

    def generate(self, prompts: list[list[int]], max_tokens: list[int], batch: int) -> bc.Timeline:
        """Static batches of `batch` in order, left-padded, each to its longest output; a token timeline
        crediting each request with the tokens it asked for (the rest of a padded batch's work is waste)."""
        torch = self.torch
        timeline = bc.Timeline(start=time.perf_counter())
        threads = torch.get_num_threads()
        torch.set_num_threads(HF_THREADS)
        try:
            for i in range(0, len(prompts), batch):
                chunk, outs = prompts[i : i + batch], max_tokens[i : i + batch]
                width = max(len(p) for p in chunk)
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for j, p in enumerate(chunk):
                    ids[j, width - len(p) :] = torch.tensor(p)
                    mask[j, width - len(p) :] = 1
                stamps = _StepStamps()
                n = max(outs)
                with torch.inference_mode():
                    self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, pad_token_id=0, streamer=stamps)
                for j, out in enumerate(outs):
                    rid = f"hf-{i + j}"
                    timeline.sent[rid] = timeline.start
                    for at in stamps.times[:out]:
                        timeline.arrived(rid, at, 1)
        finally:
            torch.set_num_threads(threads)
        return timeline

    def close(self) -> None:
        """Nothing to release but memory."""


class _StepStamps:
    """A generate() streamer that only notes when each step's tokens came out (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


# ---- the session -------------------------------------------------------------------------------


def run_dtype(args: argparse.Namespace, dtype: str, batches: list[int]) -> tuple[list[dict], dict | None]:
    """Every engine on every batch size for one dtype; the mixed workload when asked."""
    path = model_dir(args.preset, dtype)
    vocab_end = bc.plain_vocab_end(path)
    bc.note(f"[{dtype}] loading engines (model {path})")
    engines: dict[str, object] = {}
    try:
        engines["metrale"] = Metrale(path, dtype, pipeline=True)
        engines["sync"] = Metrale(path, dtype, pipeline=False)
        engines["floor"] = Floor(engines["metrale"].llm)
        if args.sampled:
            engines["sampled"] = Sampled(engines["metrale"])
        if not args.no_transformers:
            engines["transformers"] = Transformers(path, dtype)
        warm = bc.random_prompts(2, args.prompt_len, WARMUP_SEED, vocab_end)
        for engine in engines.values():
            engine.run(warm, 4)
        rows = [run_batch(args, dtype, b, engines, vocab_end) for b in batches]
        mixed = run_mixed(args, dtype, engines, vocab_end) if args.mixed else None
        return rows, mixed
    finally:
        for engine in engines.values():
            engine.close()


def run_batch(args: argparse.Namespace, dtype: str, batch: int, engines: dict, vocab_end: int) -> dict:
    """The repetitions at one batch size: every engine on the same fresh prompts, back to back."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        prompts = bc.random_prompts(batch, args.prompt_len, args.seed + 1000 * batch + rep, vocab_end)
        for name, engine in engines.items():
            runs[name].append(engine.run(prompts, args.new_tokens))
        bc.note(f"[{dtype} b{batch} rep {rep + 1}/{args.repeats}] " + "  ".join(f"{n} {r[-1]['tok_s']:,.0f}" for n, r in runs.items()))
    row = {"dtype": dtype, "batch": batch}
    for name, rs in runs.items():
        row[f"{name}_tok_s"] = round(statistics.median(r["tok_s"] for r in rs), 1)
    row["floor_decode_step_ms"] = round(statistics.median(r["decode_step_ms"] for r in runs["floor"]), 3)
    row["engine_vs_floor"] = _paired(runs["metrale"], runs["floor"])
    row["sync_vs_floor"] = _paired(runs["sync"], runs["floor"])
    row["pipelined_vs_sync"] = _paired(runs["metrale"], runs["sync"])
    row["engine_vs_transformers"] = _paired(runs["metrale"], runs["transformers"]) if "transformers" in runs else None
    row["sampled_vs_greedy"] = _paired(runs["sampled"], runs["metrale"]) if "sampled" in runs else None
    return row


def _paired(a: list[dict], b: list[dict]) -> float:
    """Median over repetitions of a/b throughput, each pair measured in the same repetition."""
    return round(statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(a, b)), 3)


def run_mixed(args: argparse.Namespace, dtype: str, engines: dict, vocab_end: int) -> dict:
    """The mixed workload once: metrale (one generate call) and transformers' static batches."""
    from metrale.ipc.sampling import SamplingParams

    prompts, outs = bc.mixed_workload(args.seed, vocab_end, n=args.mixed_requests)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    started = time.perf_counter()
    bc.note(f"[{dtype} mixed] {len(prompts)} requests, {sum(len(p) for p in prompts):,} prompt tokens, {sum(outs):,} output tokens")
    result = {"requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": sum(outs)}
    result["metrale"] = bc.run_offline(engines["metrale"].llm, prompts, params).figures()
    bc.note(f"[{dtype} mixed] metrale {result['metrale']['throughput_tok_s']:,.0f} tok/s")
    if "transformers" in engines:
        hf = engines["transformers"].generate(prompts, outs, args.hf_batch)
        result["transformers"] = hf.figures()
        result["transformers"]["static_batch"] = args.hf_batch
        result["engine_vs_transformers"] = round(
            result["metrale"]["throughput_tok_s"] / result["transformers"]["throughput_tok_s"], 3
        )
        bc.note(f"[{dtype} mixed] transformers {result['transformers']['throughput_tok_s']:,.0f} tok/s")
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    try:
        from metrale.gpu_worker.layers import cpu_kernels

        native = cpu_kernels.loaded()
    except ImportError:  # a checkout from before the native kernels
        native = False
    model = platform.processor()
    flags: set[str] = set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "isa": sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}),
        "torch": torch.__version__,
        "native_cpu_kernels": native,
    }


def summary_rows(results: list[dict]) -> list[list]:
    """The stderr table's rows."""
    return [
        [r["dtype"], r["batch"], r["metrale_tok_s"], r["sync_tok_s"], r["floor_tok_s"], r.get("transformers_tok_s"),
         r["engine_vs_floor"], r["engine_vs_transformers"], r["pipelined_vs_sync"], r["floor_decode_step_ms"]]
        for r in results
    ]


def targets(results: list[dict]) -> dict:
    """Each target at the largest batch of each dtype: the figure and whether it is met."""
    out = {}
    for dtype in sorted({r["dtype"] for r in results}):
        top = max((r for r in results if r["dtype"] == dtype), key=lambda r: r["batch"])
        for key, want in TARGETS.items():
            got = top.get(key)
            out[f"{dtype}_b{top['batch']}_{key}"] = {"value": got, "target": want, "met": got is not None and got >= want}
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the session and print the table (stderr) and the JSON line (stdout)."""
    args = parse_args(argv)
    threads = bc.set_torch_threads(args.threads)
    meter = bc.LoadMeter()
    started = time.perf_counter()
    results: list[dict] = []
    mixed: dict[str, dict] = {}
    batches = [int(b) for b in args.batches.split(",")]
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        rows, mix = run_dtype(args, dtype, batches)
        results += rows
        if mix is not None:
            mixed[dtype] = mix
    bc.note(bc.table(summary_rows(results), ["dtype", "batch", "metrale", "sync", "floor", "transformers",
                                             "eng/floor", "eng/hf", "pipe/sync", "floor step ms"]))
    for dtype, mix in mixed.items():
        rows = [[dtype, name, mix[name]["throughput_tok_s"], mix[name]["ttft_ms_p50"], mix[name]["ttft_ms_p99"],
                 mix[name]["itl_ms_p50"], mix[name]["itl_ms_p99"]] for name in ("metrale", "transformers") if name in mix]
        bc.note(bc.table(rows, ["dtype", "mixed", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]))
    record = {
        "bench": "offline",
        "format": FORMAT,
        "commit": bc.git_commit(),
        "machine": machine(),
        "config": {"preset": args.preset, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                   "repeats": args.repeats, "threads": threads, "transformers_threads": HF_THREADS,
                   "floor": "forward_only"},
        "results": results,
        "targets": targets(results),
        "mixed": mixed or None,
        "load": meter.report(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    bc.emit(record)


if __name__ == "__main__":
    main()
