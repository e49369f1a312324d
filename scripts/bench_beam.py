"""Beam search throughput: the engine's beam groups (this checkout) against an earlier commit's LLM.beam_search.

    python scripts/bench_beam.py [--baseline-commit ecb7c49] [--preset default] [--prompts 8] [--width 4]
        [--max-tokens 64] [--prompt-len 48] [--reps 3]

A random Llama of the preset (metrale.gpu_worker.tiny_model) is built once into a temporary folder. The baseline is
the commit's tree (`git archive`), laid out as the installed package is (metrale/, metrale/ipc, ...) in a temporary
folder and put first on PYTHONPATH of its runs; the other side is this checkout. Each side runs in a fresh process
per repetition, sides alternated (baseline first), so a drift in the machine's load hits both alike: the process
builds metrale.LLM, warms up with one search of other prompts, then times LLM.beam_search of `prompts` seeded random
prompts of prompt-len tokens, BeamSearchParams(width, max-tokens, ignore_eos=True) (every hypothesis max-tokens
long). Both sides must return the same hypotheses (checked: a digest of every hypothesis' ids).

Throughput = prompts x width x max_tokens hypothesis tokens / wall time of the call. Figures are medians; speedup is
the median over repetitions of the ratio within a repetition. One torch thread (OMP_NUM_THREADS=1) each side.

Output: one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
# The installed package's layout (pyproject's package-dir): package folder -> repository folder.
LAYOUT = {"ipc": "ipc", "engine_core": "engine_core", "frontend": "frontend", "gpu_worker": "gpu_worker"}


def child(args: argparse.Namespace) -> None:
    """One timed run in this process: print {"wall_s", "digest"}."""
    import random
    import time

    import torch

    torch.set_num_threads(1)
    from metrale import LLM, BeamSearchParams

    llm = LLM(args.model, show_progress=False)
    rng = random.Random(args.seed)
    vocab = llm.engine.info.vocab_size

    def prompts(n):
        return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(n)]

    params = BeamSearchParams(args.width, args.max_tokens, ignore_eos=True)
    llm.beam_search(prompts(2), BeamSearchParams(args.width, 8, ignore_eos=True))  # warm up
    batch = prompts(args.prompts)
    start = time.perf_counter()
    out = llm.beam_search(batch, params)
    wall = time.perf_counter() - start
    digest = hashlib.sha256(json.dumps([[s.output_ids for s in o.sequences] for o in out]).encode()).hexdigest()
    llm.close()
    print(json.dumps({"wall_s": wall, "digest": digest[:16], "metrale": sys.modules["metrale"].__file__}))


def baseline_tree(commit: str, into: pathlib.Path) -> pathlib.Path:
    """The commit's tree laid out as the installed package; returns the folder to put on PYTHONPATH."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = into / "path" / "metrale"
    pkg.mkdir(parents=True)
    for f in (src / "metrale").iterdir():
        (pkg / f.name).symlink_to(f)
    for name, folder in LAYOUT.items():
        (pkg / name).symlink_to(src / folder)
    return into / "path"


def run_side(args: argparse.Namespace, model: str, pythonpath: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, __file__, "--child", "--model", model, "--seed", str(args.seed), "--prompts",
           str(args.prompts), "--width", str(args.width), "--max-tokens", str(args.max_tokens), "--prompt-len",
           str(args.prompt_len)]
    out = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-commit", default="ecb7c49")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from metrale.gpu_worker.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model = str(make_tiny_model(tmp / "model", "llama", preset=args.preset))
        base_path = str(baseline_tree(args.baseline_commit, tmp / "baseline"))
        runs: dict[str, list[dict]] = {"baseline": [], "engine": []}
        for _ in range(args.reps):
            runs["baseline"].append(run_side(args, model, base_path))
            runs["engine"].append(run_side(args, model, None))
    assert all(r["metrale"].startswith(base_path) for r in runs["baseline"]), "the baseline ran this checkout"
    digests = {r["digest"] for side in runs.values() for r in side}
    tokens = args.prompts * args.width * args.max_tokens
    walls = {side: [r["wall_s"] for r in rs] for side, rs in runs.items()}
    print(json.dumps({
        "bench": "beam", "baseline_commit": args.baseline_commit,
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "preset": args.preset, "prompts": args.prompts, "width": args.width, "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len, "reps": args.reps,
        "same_hypotheses": len(digests) == 1,
        "baseline_tok_s": round(tokens / statistics.median(walls["baseline"]), 1),
        "engine_tok_s": round(tokens / statistics.median(walls["engine"]), 1),
        "baseline_wall_s": [round(w, 3) for w in walls["baseline"]],
        "engine_wall_s": [round(w, 3) for w in walls["engine"]],
        "speedup": round(statistics.median(b / e for b, e in zip(walls["baseline"], walls["engine"])), 2),
    }))


if __name__ == "__main__":
    main()
