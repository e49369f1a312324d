"""llama.cpp reads the GGUF files gguf_export writes for every family as metrale does: greedy tokens side by side.

Each family's tiny random folder (tests/hf_models.py, gpu_worker/tiny_model.py) is written as a float32 GGUF and
decoded greedily by metrale; then llama.cpp (llama-cpp-python, in its own virtual environment) decodes the same
prompts from the same file. Tokens part only at near-ties (the two sum float32 in other orders).

    python scripts/check_gguf_architectures.py --peer-python /work/peers/llama-venv/bin/python [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 128}
# case -> (folder maker, kind, config overrides). Gemma 3 with llama.cpp's fixed pattern (five sliding layers in six).
CASES = {
    "llama3-rope": ("tiny", "llama", {"head_dim": 32, "rope_scaling": _LLAMA3}),
    "mistral": ("tiny", "mistral", {}),
    "qwen2": ("tiny", "qwen2", {}),
    "qwen3": ("tiny", "qwen3", {}),
    "mixtral": ("hf", "mixtral", {}),
    "qwen3_moe": ("hf", "qwen3_moe", {}),
    "gemma2": ("hf", "gemma2", {}),
    "gemma3": ("hf", "gemma3", {"num_hidden_layers": 8, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]
                                + ["sliding_attention"] * 2}),
    "phi3": ("hf", "phi3", {}),
    "olmo2": ("hf", "olmo2", {}),
}
_PEER = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

cases = json.load(open(sys.argv[1]))
for key, c in cases.items():
    llm = Llama(c["gguf"], n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    c["llama_cpp"] = []
    for prompt, want in zip(c["prompts"], c["metrale"]):
        llm.reset()
        llm.eval(prompt)
        got = []
        for _ in want:
            got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([got[-1]])
        c["llama_cpp"].append(got)
json.dump(cases, open(sys.argv[1], "w"))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", required=True, help="a Python with llama-cpp-python installed")
    parser.add_argument("--out", default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="gguf-archs-"))
    cases = _metrale_cases(out, args.new_tokens)
    results = out / "cases.json"
    results.write_text(json.dumps(cases))
    subprocess.run([args.peer_python, "-c", _PEER, str(results)], check=True)
    for key, c in json.loads(results.read_text()).items():
        agree = sum(a == b for ours, theirs in zip(c["metrale"], c["llama_cpp"]) for a, b in zip(ours, theirs))
        total = sum(len(t) for t in c["metrale"])
        first = [next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), None) for o, t in zip(c["metrale"], c["llama_cpp"])]
        print(f"{key:12s} {agree}/{total} tokens as llama.cpp; first difference per prompt: {first}")


def _metrale_cases(out: pathlib.Path, new_tokens: int) -> dict:
    """Write each case's folder and GGUF under out; metrale's greedy tokens for three prompts of each."""
    sys.path.insert(0, str(_ROOT / "tests"))
    import numpy as np
    from hf_models import make_hf_model

    from metrale import LLM, SamplingParams
    from metrale.gpu_worker.gguf_export import write_gguf
    from metrale.gpu_worker.tiny_model import make_tiny_model

    rng = np.random.default_rng(7)
    cases = {}
    for key, (maker, kind, kw) in CASES.items():
        folder = (make_hf_model if maker == "hf" else make_tiny_model)(out / key / "folder", kind, **kw)
        gguf = write_gguf(folder, out / key / f"{key}.gguf")
        prompts = [[1, *rng.integers(16, 2000, size=n).tolist()] for n in (5, 15, 30)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        outs = LLM(str(gguf), dtype="float32", show_progress=False).generate(prompts, params)
        cases[key] = {"gguf": str(gguf), "prompts": prompts, "metrale": [o.token_ids for o in outs]}
    return cases


if __name__ == "__main__":
    main()
