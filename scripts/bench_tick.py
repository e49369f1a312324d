"""The engine core's host CPU per tick, in-process on FakeDevice, with and without a long waiting queue.

An EngineCore (pipelined unless --no-pipeline) runs on a FakeDevice whose toy model is replaced by a
trivial one (every row picks the same token; nothing is read back through the block tables): the FakeDevice's
own model walks every row's whole context in Python, which would grow with the batch and with each row's
history and swamp the engine's work. What is left of the device (its launch and await bookkeeping) is timed
separately around each call and subtracted, so the figure is the engine's alone: schedule, build the plan,
validate, commit, outputs.

Each configuration is a fresh engine with `running` long-lived greedy decodes (max_num_seqs = running,
ignore_eos, prompts of `prompt-len` random tokens, never finishing inside the window) and `waiting` more
requests queued behind the full batch (max_waiting raised to hold them; none can be admitted). After the
prefills and `warmup` ticks, `ticks` ticks are timed with time.process_time() (this process's CPU, all
threads) around each EngineCore.step(); the device's share is subtracted tick by tick. The configurations
run in a fresh order each repetition (waiting counts alternated), and the figures are medians over
repetitions. Python's collector is set as the engine core process sets it once its engine is built
(core.tune_gc: that heap frozen, a larger young threshold); --default-gc keeps Python's defaults.

    python scripts/bench_tick.py [--running 8,64,256] [--waiting 0,4096] [--ticks 400] [--warmup 50]
                                 [--reps 3] [--prompt-len 16] [--no-pipeline] [--default-gc]

Prints one JSON line on stdout (the table goes to stderr): per running count and waiting count, the host's
CPU microseconds per tick (mean over the window, p50, p99), per running row, what was subtracted for the
device, and the tokens committed per tick (the running count when every tick settles a full decode step);
waiting_ratio[running] is the median over repetitions of the paired ratio of mean per-tick CPU at the
largest waiting count to that at 0 waiting. Target (issue 19): the per-tick cost does not grow with the
waiting queue, read here as every ratio within waiting_ratio_tolerance of 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import LoadMeter, emit, git_commit, note, table  # noqa: E402

WAITING_RATIO_TOLERANCE = 1.10  # noise on a shared 2-core box; a walk over 4,096 requests costs far more
BLOCK_SIZE = 16
VOCAB = 48
TOKEN = 7  # what the trivial model always picks (not the FakeDevice's EOS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", default="8,64,256", help="comma-separated running counts (max_num_seqs each)")
    ap.add_argument("--waiting", default="0,4096", help="comma-separated waiting counts (must include 0 for the ratio)")
    ap.add_argument("--ticks", type=int, default=400, help="timed ticks per configuration")
    ap.add_argument("--warmup", type=int, default=50, help="untimed ticks after the prefills")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--no-pipeline", action="store_true", help="time the synchronous loop instead of the lane")
    ap.add_argument("--default-gc", action="store_true",
                    help="keep Python's collector as it is (the engine core process tunes it: core.tune_gc)")
    return ap.parse_args(argv)


def trivial_device_class():
    """FakeDevice with a trivial model and a CPU clock around its launch and await (imported late: --help stays quick)."""
    from metrale.testing.fake_device import FakeDevice
    from metrale.ipc.plan import StepKind, StepResult

    class TrivialFakeDevice(FakeDevice):
        """Every sampling row picks TOKEN; launch and await_result add their CPU time to cpu_s."""

        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.cpu_s = 0.0
            self.launches = 0

        def _execute(self, n, plan):
            """The trivial model: the same token for every row (non-sampling rows get -1, as the toy model gives)."""
            return StepResult(tokens=np.where(plan.sample, TOKEN, -1).astype(np.int32), logprobs=None)

        def launch(self, plan, kind=StepKind.STEP, steps: int = 1):
            t = time.process_time()
            try:
                return super().launch(plan, kind, steps)
            finally:
                self.cpu_s += time.process_time() - t
                self.launches += 1

        def await_result(self, ticket):
            t = time.process_time()
            try:
                return super().await_result(ticket)
            finally:
                self.cpu_s += time.process_time() - t

    return TrivialFakeDevice


def build_engine(running: int, waiting: int, args: argparse.Namespace, seed: int):
    """A fresh engine with `running` decodes admitted (prefills done) and `waiting` queued behind them."""
    from metrale.engine_core.engine import EngineCore, EngineOptions
    from metrale.ipc.sampling import SamplingParams

    max_len = args.prompt_len + args.warmup + args.ticks + 64  # the prefill ticks and a margin
    blocks_per_row = -(-max_len // BLOCK_SIZE) + 1
    dev = trivial_device_class()(
        vocab_size=VOCAB, num_kv_blocks=running * blocks_per_row + 16, block_size=BLOCK_SIZE, max_model_len=4096,
    )
    eng = EngineCore(dev, EngineOptions(
        pipeline=not args.no_pipeline, max_num_seqs=running, max_num_batched_tokens=max(2048, running),
        max_waiting=waiting + running + 1, enable_prefix_caching=True,
    ))
    if not args.default_gc:  # as the engine core process does once its engine is built, before any request
        from metrale.engine_core.core import tune_gc
        gc.unfreeze()  # the last configuration's engine is garbage now
        tune_gc()
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(8, VOCAB, size=(running + waiting, args.prompt_len)).tolist()  # distinct: no prefix hits
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, params)  # the first `running` are admitted; the rest wait behind them
    return eng, dev


def measure_one(running: int, waiting: int, args: argparse.Namespace, seed: int) -> dict:
    """Per-tick host CPU of one configuration over the timed window."""
    eng, dev = build_engine(running, waiting, args, seed)
    sched = eng.scheduler
    ticks = 0
    while any(s.num_computed < s.num_prompt for s in sched.running) or len(sched.running) < running:
        eng.step()
        ticks += 1
        if ticks > 1000:
            raise RuntimeError(f"the {running} running requests never all reached decode")
    for _ in range(args.warmup):
        eng.step()
    if len(sched.running) != running or sched.num_waiting != waiting:
        raise RuntimeError(f"expected {running} running / {waiting} waiting, found {len(sched.running)} / {sched.num_waiting}")
    gc.collect()
    gc_before = sum(g["collections"] for g in gc.get_stats()[2:])
    launches0, tokens0 = dev.launches, eng.generated_tokens
    per_tick = np.empty(args.ticks)
    device = np.empty(args.ticks)
    clock = time.process_time
    for i in range(args.ticks):
        d0 = dev.cpu_s
        t0 = clock()
        eng.step()
        t1 = clock()
        device[i] = dev.cpu_s - d0
        per_tick[i] = (t1 - t0) - device[i]
    gen2 = sum(g["collections"] for g in gc.get_stats()[2:]) - gc_before
    if len(sched.running) != running or any(s.finished for s in sched.running):
        raise RuntimeError("a running request finished inside the window")
    us = per_tick * 1e6
    return {
        "host_us_per_tick": round(float(us.mean()), 2),
        "host_us_p50": round(float(np.percentile(us, 50)), 2),
        "host_us_p99": round(float(np.percentile(us, 99)), 2),
        "host_us_per_row": round(float(us.mean()) / running, 3),
        "device_us_per_tick": round(float(device.mean()) * 1e6, 2),
        "tokens_per_tick": round((eng.generated_tokens - tokens0) / args.ticks, 2),
        "launches_per_tick": round((dev.launches - launches0) / args.ticks, 3),
        "gc_gen2_collections": gen2,
    }


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print the table (stderr) and the JSON line (stdout)."""
    args = parse_args(argv)
    running_counts = [int(x) for x in args.running.split(",")]
    waiting_counts = [int(x) for x in args.waiting.split(",")]
    meter = LoadMeter()
    commit = git_commit()
    runs: dict[tuple[int, int], list[dict]] = {(r, w): [] for r in running_counts for w in waiting_counts}
    for rep in range(args.reps):
        for running in running_counts:
            order = waiting_counts if rep % 2 == 0 else waiting_counts[::-1]
            for waiting in order:
                fig = measure_one(running, waiting, args, seed=rep * 100_003 + running)
                runs[(running, waiting)].append(fig)
                note(f"rep {rep} running {running} waiting {waiting}: {fig['host_us_per_tick']:.1f} us/tick "
                     f"(p99 {fig['host_us_p99']:.1f}), {fig['tokens_per_tick']} tokens/tick")
        meter.sample()
    results: dict[str, dict] = {}
    ratios: dict[str, float | None] = {}
    big = max(waiting_counts)
    for running in running_counts:
        per_r = {}
        for waiting in waiting_counts:
            reps = runs[(running, waiting)]
            per_r[f"w{waiting}"] = {k: round(statistics.median(r[k] for r in reps), 3) for k in reps[0]}
        results[f"r{running}"] = per_r
        if 0 in waiting_counts and big > 0:
            pairs = [a["host_us_per_tick"] / b["host_us_per_tick"] for a, b in zip(runs[(running, big)], runs[(running, 0)])]
            ratios[f"r{running}"] = round(statistics.median(pairs), 3)
    rows = []
    for key, per_r in results.items():
        for wkey, f in per_r.items():
            rows.append([key[1:], wkey[1:], f["host_us_per_tick"], f["host_us_p50"], f["host_us_p99"], f["host_us_per_row"],
                         f["device_us_per_tick"], f["tokens_per_tick"], ratios.get(key) if wkey == f"w{big}" else None])
    note(table(rows, ["running", "waiting", "us/tick", "p50", "p99", "us/row", "device us (subtracted)", "tokens/tick",
                      f"w{big}/w0"]))
    emit({
        "bench": "tick",
        "commit": commit,
        "pipeline": not args.no_pipeline,
        "ticks": args.ticks,
        "warmup": args.warmup,
        "reps": args.reps,
        "prompt_len": args.prompt_len,
        "gc": "default" if args.default_gc else "engine core (tune_gc)",
        "results": results,
        "waiting_ratio": ratios,
        "waiting_ratio_tolerance": WAITING_RATIO_TOLERANCE,
        "target_met": (all(r is not None and r <= WAITING_RATIO_TOLERANCE for r in ratios.values()) if ratios else None),
        "machine": meter.report(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
