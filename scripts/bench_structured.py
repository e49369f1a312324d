"""The per-token cost of structured outputs (a JSON schema) against unconstrained decoding, in one run.

    python scripts/bench_structured.py [--model DIR | --preset bench-tiny] [--batches 1,8] [--new-tokens 96]
        [--repeats 3] [--dtype bfloat16] [--threads 2]

Each request decodes exactly new-tokens tokens (ignore_eos, greedy) either unconstrained or under a JSON schema
whose strings are long enough never to close early (an object with a free-text string property of at least
new-tokens characters), so both runs make the same number of tokens and the difference is the grammar's cost:
the matcher's step and bitmask on the engine core, the bitmask in the plan, its application by the sampler, and
the lane's waiting for the commit of a grammar row. Runs alternate in each repetition; the cost is the median of
the paired ratio (structured time per token / unconstrained time per token) - 1. Target: <= 10 %.

The grammar is compiled once before the clock starts (a compile is per schema, not per token).

Output: a table on stderr, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

FORMAT = 1
TARGET = 0.10


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder (default: a random bench-tiny Llama)")
    ap.add_argument("--preset", default="bench-tiny")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def timed(llm, prompts, params) -> float:
    """Wall seconds per output token of one generate() call."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return (time.perf_counter() - t0) / sum(len(o.token_ids) for o in outs)


def main(argv=None) -> None:
    args = parse_args(argv)
    bc.set_torch_threads(args.threads)
    from metrale import LLM, SamplingParams
    from metrale.ipc.sampling import StructuredOutputs

    model = args.model or str(bc.build_model(os.path.join(tempfile.gettempdir(), "metrale-bench"), args.preset))
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4 * args.new_tokens}},
              "required": ["text"]}
    n = args.new_tokens
    free = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                 structured_outputs=StructuredOutputs(json=schema))
    llm = LLM(model, dtype=args.dtype, show_progress=False, max_num_seqs=16)
    vocab_end = bc.plain_vocab_end(model)
    results, rows = {}, []
    for batch in map(int, args.batches.split(",")):
        prompts = bc.random_prompts(batch, 64, seed=batch, vocab_end=vocab_end)
        timed(llm, prompts, free), timed(llm, prompts, constrained)  # warm-up; compiles the schema once
        pairs = [(timed(llm, prompts, free), timed(llm, prompts, constrained)) for _ in range(args.repeats)]
        cost = statistics.median(s / f for f, s in pairs) - 1
        results[f"b{batch}"] = {"free_ms_per_token": 1e3 * statistics.median(f for f, _ in pairs),
                                "structured_ms_per_token": 1e3 * statistics.median(s for _, s in pairs),
                                "cost": cost}
        rows.append([batch, results[f"b{batch}"]["free_ms_per_token"], results[f"b{batch}"]["structured_ms_per_token"], cost])
    bc.note(bc.table(rows, ["batch", "free ms/tok", "json ms/tok", "cost"]))
    bc.emit({"bench": "structured", "format": FORMAT, "commit": bc.git_commit(), "model": os.path.basename(model),
             "dtype": args.dtype, "new_tokens": n, "repeats": args.repeats, "results": results, "target": TARGET,
             "target_met": all(r["cost"] <= TARGET for r in results.values())})
    llm.close()


if __name__ == "__main__":
    main()
