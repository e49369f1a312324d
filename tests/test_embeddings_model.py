"""Embeddings of a real (tiny, random) checkpoint equal sentence-transformers' and transformers' in fp32: last-token,
mean and first-token pooling, normalised or not, one by one and batched, across prefill chunks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


def sentence_transformers_folder(src, dst, mode: str, normalize: bool):
    """A copy of the checkpoint with sentence-transformers' module files (Transformer, Pooling, maybe Normalize)."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (dst / "2_Normalize").mkdir()
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": hidden, "pooling_mode": MODES[mode], "include_prompt": True}))
    (dst / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return dst


def hf_embedding(model, ids: list[int], mode: str, normalize: bool) -> np.ndarray:
    """transformers' last hidden states (after the final norm) pooled by hand."""
    with torch.no_grad():
        states = model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[mode]
    return (vector / vector.norm() if normalize else vector).numpy()


@pytest.mark.parametrize("mode,normalize", [("last", True), ("mean", True), ("cls", False), ("mean", False)])
def test_llm_embed_equals_transformers_pooled_states(tiny_model_dir, tmp_path, mode, normalize):
    """LLM.embed of prompts of 1 to 40 tokens (chunks of 16), batched and one by one, equals transformers' pooled
    final hidden states within 1e-5."""
    import transformers

    from metrale import LLM

    folder = sentence_transformers_folder(tiny_model_dir("llama"), tmp_path / "st", mode, normalize)
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (40, 1, 17, 5)]
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4) as llm:
        batched = llm.embed([{"prompt_token_ids": p} for p in prompts])
        alone = [llm.embed([{"prompt_token_ids": p}])[0] for p in prompts]
    for p, out, single in zip(prompts, batched, alone):
        want = hf_embedding(hf, p, mode, normalize)
        np.testing.assert_allclose(out.outputs.embedding, want, atol=1e-5)
        np.testing.assert_allclose(single.outputs.embedding, out.outputs.embedding, atol=1e-6)
        assert out.prompt_token_ids == p


def test_llm_embed_of_text_equals_sentence_transformers(tiny_model_dir, tmp_path):
    """The same texts through sentence-transformers' own encode (its tokenizer, pooling and Normalize)."""
    from sentence_transformers import SentenceTransformer

    from metrale import LLM

    folder = sentence_transformers_folder(tiny_model_dir("llama"), tmp_path / "st", "mean", True)
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "a"]
    model = SentenceTransformer(str(folder), device="cpu")
    want = [model.encode([t], convert_to_numpy=True)[0] for t in texts]
    with LLM(str(folder), dtype="float32") as llm:
        got = llm.embed(texts)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.outputs.embedding, w, atol=1e-5)


def test_generation_beside_embeddings_on_one_llm(tiny_model_dir):
    """One engine serves both: a greedy generation is the same before and after embeddings ran beside it."""
    from metrale import LLM, SamplingParams

    with LLM(str(tiny_model_dir("llama")), dtype="float32") as llm:
        before = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
        vectors = llm.embed([[5, 6, 7, 8], [9]])
        after = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
    assert before == after and len(vectors[0].outputs.embedding) == llm.engine.info.hidden_size
