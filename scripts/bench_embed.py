"""Embeddings throughput: metrale.LLM.embed against transformers' AutoModel forward, on one model, in one run.

    python scripts/bench_embed.py [--model PATH] [--preset test] [--dtype float32] [--prompts 64]
        [--min-len 16] [--max-len 128] [--hf-batch 32] [--repeats 3] [--threads 2] [--seed 0]

Without --model a random Llama is made by metrale.gpu_worker.tiny_model.make_tiny_model (the `test` preset unless
--preset says otherwise) into a temporary folder, removed at the end; --model takes a Hugging Face folder (a
sentence-transformers folder too). Each repetition draws a fresh set of --prompts prompts of random token ids (no
special tokens), each of a length drawn from [--min-len, --max-len], the same for both engines (fresh, so no prefix
cache helps metrale), and runs the two back to back, the order alternating from one repetition to the next:

  metrale       one LLM(...).embed call over every prompt (the engine batches them as it batches generation)
  transformers  AutoModel on the same folder, sdpa, batches of --hf-batch prompts sorted by length (as
                sentence-transformers' encode sorts them), right-padded with an attention mask; each prompt's
                final hidden states pooled as the model pools (model_facts: its sentence-transformers config;
                a plain decoder: its last token) and normalised when the model normalises

Throughput = prompts (and prompt tokens) / wall time of the call. Figures are medians over the repetitions; the
ratio is the median over repetitions of metrale's prompts/s over transformers' in the same repetition.
max_abs_diff is the largest difference between the two engines' vectors (the last repetition's): the same work
was done. --threads sets torch's intra-op threads for both (one process).

Output: a table on stderr, one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

FORMAT = 1  # bump when a key of the JSON line changes meaning
WARMUP_SEED = 10_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: a tiny random Llama, made here)")
    ap.add_argument("--preset", default="test", help="tiny_model preset when no --model (test, default, bench-tiny)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=64, help="prompts per repetition")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=32, help="transformers' batch size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both engines)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        ap.error("--min-len must be in [1, --max-len]")
    return args


def prompt_set(n: int, min_len: int, max_len: int, seed: int, vocab_end: int) -> list[list[int]]:
    """n prompts of random token ids (no special tokens), each of a length in [min_len, max_len]; the same for a
    given seed."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return [rng.integers(bc.FIRST_PLAIN_TOKEN, vocab_end, size=int(k)).tolist() for k in lengths]


# ---- the engines -------------------------------------------------------------------------------


class Metrale:
    """metrale.LLM; one embed() call per run."""

    name = "metrale"

    def __init__(self, path: pathlib.Path, dtype: str):
        from metrale import LLM

        self.llm = LLM(str(path), dtype=dtype, show_progress=False)
        info = self.llm.engine.info
        self.pooling, self.normalize = info.pooling, info.pooling_normalize

    def run(self, prompts: list[list[int]]) -> tuple[dict, np.ndarray]:
        """Throughput of one embed() over the prompts, and the vectors."""
        start = time.perf_counter()
        outs = self.llm.embed(prompts)
        wall = time.perf_counter() - start
        return _figures(prompts, wall), np.array([o.outputs.embedding for o in outs], dtype=np.float32)

    def close(self) -> None:
        self.llm.close()


class Transformers:
    """AutoModel on the same folder: sdpa, length-sorted right-padded batches, pooled as the model pools."""

    name = "transformers"

    def __init__(self, path: pathlib.Path, dtype: str, batch: int, pooling: str, normalize: bool):
        import torch
        import transformers
        from transformers import AutoModel

        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.version = transformers.__version__
        self.model = AutoModel.from_pretrained(str(path), dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
        self.batch, self.pooling, self.normalize = batch, pooling, normalize

    def run(self, prompts: list[list[int]]) -> tuple[dict, np.ndarray]:
        """Throughput of embedding every prompt in batches, and the vectors in the prompts' order."""
        start = time.perf_counter()
        vectors = self.embed(prompts)
        wall = time.perf_counter() - start
        return _figures(prompts, wall), vectors

    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """float32 [n, hidden]: each prompt's pooled final hidden states."""
        torch = self.torch
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[np.ndarray | None] = [None] * len(prompts)
        with torch.inference_mode():
            for at in range(0, len(order), self.batch):
                rows = order[at : at + self.batch]
                lengths = torch.tensor([len(prompts[i]) for i in rows])
                ids = torch.zeros((len(rows), int(lengths.max())), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, i in enumerate(rows):
                    ids[j, : lengths[j]] = torch.tensor(prompts[i])
                    mask[j, : lengths[j]] = 1
                states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
                pooled = self._pool(states, mask, lengths)
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                for j, i in enumerate(rows):
                    out[i] = pooled[j].numpy()
        return np.stack(out)

    def _pool(self, states, mask, lengths):
        """[B, hidden] from [B, L, hidden]: the last real token's, the mean over real tokens, or the first's."""
        if self.pooling == "mean":
            return (states * mask.unsqueeze(-1)).sum(1) / lengths.unsqueeze(-1)
        if self.pooling == "cls":
            return states[:, 0]
        return states[self.torch.arange(len(lengths)), lengths - 1]

    def close(self) -> None:
        """Nothing to release but memory."""


def _figures(prompts: list[list[int]], wall: float) -> dict:
    """Prompts and prompt tokens per second of one run."""
    return {"prompts_s": len(prompts) / wall, "tok_s": sum(len(p) for p in prompts) / wall, "wall_s": wall}


# ---- the session -------------------------------------------------------------------------------


def run(args: argparse.Namespace, path: pathlib.Path) -> dict:
    """Every repetition on fresh prompts, the engines' order alternating; medians, the paired ratio, the check."""
    vocab_end = bc.plain_vocab_end(path)
    bc.note(f"loading engines (model {path})")
    metrale = Metrale(path, args.dtype)
    engines = [metrale]
    try:
        engines.append(Transformers(path, args.dtype, args.hf_batch, metrale.pooling, metrale.normalize))
        warm = prompt_set(4, args.min_len, args.max_len, WARMUP_SEED, vocab_end)
        for engine in engines:
            engine.run(warm)
        runs: dict[str, list[dict]] = {e.name: [] for e in engines}
        vectors: dict[str, np.ndarray] = {}
        for rep in range(args.repeats):
            prompts = prompt_set(args.prompts, args.min_len, args.max_len, args.seed + rep, vocab_end)
            for engine in engines if rep % 2 == 0 else engines[::-1]:
                figures, vectors[engine.name] = engine.run(prompts)
                runs[engine.name].append(figures)
            bc.note(f"[rep {rep + 1}/{args.repeats}] " + "  ".join(
                f"{name} {r[-1]['prompts_s']:,.1f} prompts/s" for name, r in runs.items()))
        result = {name: {key: round(statistics.median(r[key] for r in rs), 3) for key in ("prompts_s", "tok_s", "wall_s")}
                  for name, rs in runs.items()}
        result["metrale_vs_transformers"] = round(statistics.median(
            m["prompts_s"] / t["prompts_s"] for m, t in zip(runs["metrale"], runs["transformers"])), 3)
        result["max_abs_diff"] = float(np.abs(vectors["metrale"] - vectors["transformers"]).max())
        result["hidden_size"] = int(vectors["metrale"].shape[1])
        result["pooling"] = metrale.pooling
        result["normalize"] = metrale.normalize
        result["transformers_version"] = engines[1].version
        return result
    finally:
        for engine in engines:
            engine.close()


def main(argv: list[str] | None = None) -> None:
    """Run the session and print the table (stderr) and the JSON line (stdout)."""
    args = parse_args(argv)
    threads = bc.set_torch_threads(args.threads)
    meter = bc.LoadMeter()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="metrale-bench-embed-") as tmp:
        if args.model is not None:
            path, model = pathlib.Path(args.model), args.model
        else:
            from metrale.gpu_worker.tiny_model import make_tiny_model

            path, model = make_tiny_model(pathlib.Path(tmp) / "model", "llama", preset=args.preset), f"tiny llama ({args.preset})"
        result = run(args, path)
    bc.note(bc.table([[name, result[name]["prompts_s"], result[name]["tok_s"], result[name]["wall_s"]]
                      for name in ("metrale", "transformers")], ["engine", "prompts/s", "tokens/s", "wall s"]))
    bc.note(f"metrale / transformers {result['metrale_vs_transformers']}, max |diff| {result['max_abs_diff']:.2e}")
    bc.emit({
        "bench": "embed",
        "format": FORMAT,
        "commit": bc.git_commit(),
        "config": {"model": model, "dtype": args.dtype, "prompts": args.prompts, "min_len": args.min_len,
                   "max_len": args.max_len, "hf_batch": args.hf_batch, "repeats": args.repeats, "threads": threads,
                   "seed": args.seed},
        "results": result,
        "load": meter.report(),
        "wall_s": round(time.perf_counter() - started, 1),
    })


if __name__ == "__main__":
    main()
