"""The engine core's plan builder alone: CPU µs per StepBuilder.build of one step, in-process.

A step of `--rows` decode rows (prompts of 32–512 random ids, one row in `--penalised` with penalties, whose token
histories every plan carries) plus `--prefills` prefill chunks of `--chunk` tokens, built again and again from the
same sequences (the build reads them, changes nothing). CPU time (time.process_time) of `--builds` builds per
repetition; the figure is the median over repetitions. What bench_tick.py measures as part of a whole tick (and
only for decode steps), here alone and with prefill chunks in the step, as a served tick under arrivals has.

    python scripts/bench_step_builder.py [--rows 1024] [--prefills 4] [--chunk 256] [--penalised 0.25]
                                         [--builds 200] [--reps 7]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import emit, git_commit  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--prefills", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--penalised", type=float, default=0.25)
    ap.add_argument("--builds", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)

    from metrale.engine_core.kv_blocks import KvBlockPool
    from metrale.engine_core.pipeline import NO_MASK
    from metrale.engine_core.sequence import Sequence
    from metrale.engine_core.step_builder import StepBuilder
    from metrale.ipc.sampling import SamplingParams

    rng = random.Random(0)
    n_rows = args.rows + args.prefills
    pool = KvBlockPool(num_blocks=n_rows * 40, block_size=16)
    seqs = []
    for i in range(n_rows):
        prefill = i >= args.rows
        n = rng.randint(32, 512) + (args.chunk if prefill else 0)
        params = SamplingParams(temperature=0.0, repetition_penalty=1.1 if rng.random() < args.penalised else 1.0)
        seq = Sequence.of(f"r{i}", params, i, [rng.randrange(3, 5000) for _ in range(n)], n, i)
        seq.num_computed = n - args.chunk if prefill else n - 1
        assert pool.allocate(seq, seq.num_tokens), "the pool is too small"
        seqs.append(seq)
    builder = StepBuilder(pool, max_tokens=args.rows + args.prefills * args.chunk, max_rows=n_rows,
                          max_model_len=4096)
    num_new = [1] * args.rows + [args.chunk] * args.prefills
    masks = [NO_MASK] * n_rows
    for _ in range(20):
        builder.build(seqs, num_new, masks)
    per_build = []
    for _ in range(args.reps):
        start = time.process_time()
        for _ in range(args.builds):
            builder.build(seqs, num_new, masks)
        per_build.append((time.process_time() - start) / args.builds * 1e6)
    emit({"bench": "step_builder", "commit": git_commit(), "rows": args.rows, "prefills": args.prefills,
          "chunk": args.chunk, "penalised": args.penalised, "build_cpu_us": round(statistics.median(per_build), 1),
          "build_cpu_us_min": round(min(per_build), 1), "load_average": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
