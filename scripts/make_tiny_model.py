"""Write a tiny random Llama-family model (Hugging Face layout, local tokenizer) into a folder.

    python scripts/make_tiny_model.py --arch qwen3 --out /tmp/tiny-qwen3 --preset test

The weights are random: the model's text is noise. It exists for tests, demos and benchmarks.
"""

from __future__ import annotations

import argparse
import sys

from metrale.gpu_worker.tiny_model import ARCHITECTURES, PRESETS, make_tiny_model


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, write the model, print its folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--preset", choices=list(PRESETS), default="test")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    args = parser.parse_args(argv)
    path = make_tiny_model(
        args.out,
        args.arch,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        tie_word_embeddings=args.tie_word_embeddings,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
