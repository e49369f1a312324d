"""Run one fixed schedule of steps on several models, as one rank of a tensor-parallel group (or alone).

`python tp_ranks.py SPEC_JSON JOB_JSON` joins the group SPEC describes, then for each (model folder, dtype) of
the job builds a ModelRunner holding this rank's shards and runs `run_schedule` on it; rank 0 writes every
run's tokens to the job's output file. The test runs the same schedule on a plain runner (a group of one) and
compares: one group start covers every family, where an LLM per family would start one each.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from conftest import Row, blocks_for, make_plan

NUM_NEW = 12
PROMPT_LENS = (3, 9, 17, 30)


def prompts_for(vocab: int) -> list[list[int]]:
    """The schedule's prompts: random ids past the special tokens."""
    rng = np.random.default_rng(5)
    return [rng.integers(16, vocab, size=n).tolist() for n in PROMPT_LENS]


def run_schedule(runner) -> list[list[int]]:
    """Prefill every prompt in one step, then decode NUM_NEW - 1 steps fed on the device; odd rows greedy,
    even rows seeded sampling. Returns each row's tokens."""
    prompts = prompts_for(runner.info.vocab_size)
    max_len = max(PROMPT_LENS) + NUM_NEW
    blocks = [blocks_for(i, max_len) for i in range(len(prompts))]

    def sampling(i: int) -> dict:
        return {} if i % 2 else {"temperature": 0.9, "top_p": 0.95, "seed": 900 + i}

    result = runner.execute(make_plan([Row(p, 0, b, **sampling(i)) for i, (p, b) in enumerate(zip(prompts, blocks))]))
    out = [[int(t)] for t in result.tokens]
    for k in range(1, NUM_NEW):
        rows = [Row([0], len(p) + k - 1, b, feed_from_row=i, **sampling(i)) for i, (p, b) in enumerate(zip(prompts, blocks))]
        result = runner.execute(make_plan(rows))
        for i, t in enumerate(result.tokens):
            out[i].append(int(t))
    return out


def main(spec_json: str, job_json: str) -> int:
    """Join the group, run the job's models, write rank 0's tokens."""
    import torch

    from metrale.gpu_worker.model_runner import ModelRunner
    from metrale.gpu_worker.tp_group import join_group
    from metrale.ipc.worker_group import decode

    torch.set_num_threads(1)
    spec = decode(spec_json)
    job = json.loads(job_json)
    joined = join_group(spec, torch.device("cpu"))
    try:
        runs = []
        for path, dtype in job["models"]:
            runner = ModelRunner(path, dtype=dtype, device="cpu", num_kv_blocks=256, show_progress=False, group=joined.group)
            runs.append(run_schedule(runner))
    finally:
        joined.close()
    if spec.rank == 0:
        with open(job["out"], "w") as f:
            json.dump({"runs": runs, "all_reduce": joined.all_reduce, "threads_after_close": _group_threads()}, f)
    return 0


def _group_threads() -> list[str]:
    """The names of this process's gloo and store threads: a closed group must have joined every one (one
    still running when the interpreter tears down aborts the process)."""
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
