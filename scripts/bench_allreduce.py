"""The collectives of a two-rank CPU group: gloo vs the shared-memory all-reduce, per call, in the same run.

    python scripts/bench_allreduce.py [--ranks 2] [--iters 2000]

Each rank is a process with one torch thread, joined as a tensor-parallel worker joins (gpu_worker/tp_group.py).
Shapes are a decode step's: a row-parallel output of bench-small ([1, 1024] and [32, 1024]) and its vocab-parallel
logits gather ([1, 16000] per rank). Prints one JSON line: microseconds per call for each path and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = {"reduce_1x1024": (1, 1024), "reduce_32x1024": (32, 1024), "gather_1x16000": (1, 16000)}


def rank_main(spec_json: str, iters: int, out: str) -> None:
    """One rank: time every shape on both paths (rank 0 writes the figures)."""
    import torch

    from metrale.gpu_worker.layers.collectives import TorchCollectives
    from metrale.gpu_worker.tp_group import join_group
    from metrale.ipc.worker_group import decode

    torch.set_num_threads(1)
    spec = decode(spec_json)
    joined = join_group(spec, torch.device("cpu"))
    shm = joined.group.comm
    gloo = TorchCollectives(shm.pg, spec.size, torch.device("cpu"))
    figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, shape in SHAPES.items():
            x = torch.randn(shape).to(dtype)
            for label, comm in (("gloo", gloo), ("shm", shm)):
                op = (lambda c=comm: c.all_gather(x, -1)) if name.startswith("gather") else (lambda c=comm: c.all_reduce(x.zero_()))
                for _ in range(50):
                    op()
                joined.group.comm.shm.all_reduce(torch.zeros(1))  # line the ranks up before timing
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                figures[f"{label}_{name}_{str(dtype)[6:]}_us"] = round((time.perf_counter() - t0) / iters * 1e6, 2)
    if spec.rank == 0:
        for key in [k for k in figures if k.startswith("shm_")]:
            figures[key.replace("shm_", "gloo_over_shm_").replace("_us", "")] = round(figures[key.replace("shm_", "gloo_", 1)] / figures[key], 2)
        with open(out, "w") as f:
            json.dump(figures, f)
    joined.close()


def main() -> None:
    """Start the ranks and print rank 0's figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rank-main", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args.rank_main[0], int(args.rank_main[1]), args.rank_main[2])
        return
    from metrale.ipc import worker_group

    out = tempfile.mktemp(suffix=".json")
    specs = worker_group.group_specs(args.ranks, all_reduce="shm")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", worker_group.encode(s), str(args.iters), out], env=env)
             for s in specs]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")
    with open(out) as f:
        figures = json.load(f)
    os.unlink(out)
    print(json.dumps({"bench": "allreduce", "ranks": args.ranks, "load_avg_1m": os.getloadavg()[0], **figures}))


if __name__ == "__main__":
    main()
