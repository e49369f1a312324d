"""Prompt-lookup speculative decoding against plain decoding, on a prompt-copying workload, in one run.

    python scripts/bench_speculative.py --model DIR [--batches 1,8] [--k 4] [--new-tokens 128] [--repeats 3]
        [--dtype bfloat16] [--threads 2]

The workload copies from its prompt, as code edits and quoting summaries do: each request gives the model a
Python file (from the standard library, cut to about 400 tokens) and asks it, through the model's chat template,
to repeat it with one change (rename a function) or to summarise it quoting its lines. Greedy, new-tokens at most
(EOS may end a request earlier). In fp32 speculation changes no token, and the script asserts it; in bf16 a verify
step's products round by their row count, so a request's greedy tokens may part at a near tie: the JSON says which
share of requests stayed identical.

Per batch size, metrale.LLM with `speculative="ngram"` and without it run the same prompts back to back in each
repetition (so a drift in the machine's load hits both alike): throughput = output tokens / wall time of the
generate() call (prefill included). The speedup is the median over repetitions of the paired ratio; the
acceptance rate is accepted / drafted draft tokens. Target: >= 1.5x at batch 1.

Output: a table on stderr, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

FORMAT = 1
TARGET_B1 = 1.5
SOURCES = ("textwrap", "string", "functools", "json", "os")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model folder (an instruct model, e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="the LLM's speculative_disable_by_batch_size (steps of this many rows decode plainly)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def prompts(llm, n: int) -> list[str]:
    """n copying prompts: an edit of a source file or a summary quoting it, through the chat template."""
    from metrale.frontend.chat import ChatTemplate

    template = ChatTemplate.load(llm.model_dir, llm.tokenizer)
    out = []
    for i in range(n):
        module = __import__(SOURCES[i % len(SOURCES)])
        source = inspect.getsource(module)
        ids = llm.tokenizer.encode(source, add_special_tokens=False)
        start = (i * 97) % max(1, len(ids) - 400)
        code = llm.tokenizer.decode(ids[start : start + 400])
        task = ("Repeat this Python code exactly, but rename the first function to `renamed`:\n\n" if i % 2 == 0
                else "Summarise this Python code, quoting each important line verbatim:\n\n")
        messages = [{"role": "user", "content": task + code}]
        out.append(template.render(messages, add_generation_prompt=True) if template else task + code)
    return out


def run(llm, texts, params) -> dict:
    """One generate() call: output tokens, wall time, draft statistics."""
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(texts, params)
    wall = time.perf_counter() - t0
    after = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall, "ids": [o.token_ids for o in outs],
            "drafted": after.spec_draft_tokens - before.spec_draft_tokens,
            "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens}


def _identical(pairs) -> float:
    """The share of requests whose speculative tokens equal the plain run's, over every repetition."""
    same = [x == y for a, b in pairs for x, y in zip(a["ids"], b["ids"])]
    return sum(same) / len(same)


def _first_difference(pairs) -> float | None:
    """The mean token position where a differing request's outputs part (None when none differ)."""
    at = [next(i for i, (p, q) in enumerate(zip(x + [-1], y + [-2])) if p != q)
          for a, b in pairs for x, y in zip(a["ids"], b["ids"]) if x != y]
    return statistics.mean(at) if at else None


def main(argv=None) -> None:
    args = parse_args(argv)
    bc.set_torch_threads(args.threads)
    from metrale import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    kw = dict(dtype=args.dtype, show_progress=False, max_num_seqs=max(8, *map(int, args.batches.split(","))))
    plain = LLM(args.model, **kw)
    spec = LLM(args.model, speculative="ngram", num_speculative_tokens=args.k,
               speculative_disable_by_batch_size=args.disable_by_batch_size, **kw)
    results = {}
    rows = []
    for batch in map(int, args.batches.split(",")):
        texts = prompts(plain, batch)
        run(plain, texts, params), run(spec, texts, params)  # warm-up (and the prefix cache, alike for both)
        pairs = []
        for _ in range(args.repeats):
            a, b = run(plain, texts, params), run(spec, texts, params)
            if args.dtype == "float32":  # exact in fp32; bf16 products round by their row count (see below)
                assert a["ids"] == b["ids"], "speculative decoding changed the tokens"
            pairs.append((a, b))
        speedup = statistics.median(b["throughput_tok_s"] / a["throughput_tok_s"] for a, b in pairs)
        drafted = sum(b["drafted"] for _, b in pairs)
        accepted = sum(b["accepted"] for _, b in pairs)
        results[f"b{batch}"] = {
            "plain_tok_s": statistics.median(a["throughput_tok_s"] for a, _ in pairs),
            "speculative_tok_s": statistics.median(b["throughput_tok_s"] for _, b in pairs),
            "speedup": speedup,
            "acceptance_rate": accepted / drafted if drafted else None,
            "output_tokens": pairs[0][0]["tokens"],
            # A verify step's k + 1 rows per request take another matmul kernel than a one-row decode (in bf16 the
            # sum's order, so its rounding, follows the row count), so greedy may part at a near tie: the share of
            # requests whose tokens equal plain decoding's, and the mean position where the others part.
            "identical_requests": _identical(pairs),
            "first_difference_mean": _first_difference(pairs),
        }
        r = results[f"b{batch}"]
        rows.append([batch, r["plain_tok_s"], r["speculative_tok_s"], r["speedup"], r["acceptance_rate"],
                     r["identical_requests"]])
    bc.note(bc.table(rows, ["batch", "plain tok/s", "ngram tok/s", "speedup", "acceptance", "identical"]))
    b1 = results.get("b1", {}).get("speedup")
    bc.emit({"bench": "speculative", "format": FORMAT, "commit": bc.git_commit(), "model": os.path.basename(args.model),
             "dtype": args.dtype, "k": args.k, "disable_by_batch_size": args.disable_by_batch_size,
             "new_tokens": args.new_tokens, "repeats": args.repeats,
             "results": results, "target_b1": TARGET_B1, "target_met": b1 is not None and b1 >= TARGET_B1})
    plain.close()
    spec.close()


if __name__ == "__main__":
    main()
