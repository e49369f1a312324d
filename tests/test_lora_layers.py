"""Multi-LoRA in the worker: adapter folders read and refused (lora_adapters.py), slots loaded, sharded and
selected per token (layers/lora.py), checked against transformers + peft in float32."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from metrale.gpu_worker.layers.lora import LoraSlots
from metrale.gpu_worker.layers.parallel import ParallelGroup
from metrale.gpu_worker.loader import load_model
from metrale.lora_adapters import LoraError, read_adapter
from metrale.gpu_worker.model_runner import ModelRunner
from metrale.model_facts import resolve_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MAX_LEN = 64
PROMPT_LENS = (5, 11, 17, 8)
NUM_DECODE = 4
LOGIT_ATOL = 1e-4
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (its slot in the runner's LoraSlots, PEFT's config); the slots are not the names' order on purpose.
ADAPTERS = {
    "qv-r4": (2, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "all-r8-rslora": (0, dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_TARGETS)),
    "mlp-r2": (1, dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj", "up_proj", "down_proj"])),
}


@pytest.fixture(scope="module")
def base_path(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama")


def _hf_model(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _make_adapter(base, out: pathlib.Path, seed: int, **config) -> pathlib.Path:
    """A PEFT adapter for the model at base with random A and B (init_lora_weights=False), saved to out."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(_hf_model(base), peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(base_path, tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: _make_adapter(base_path, root / name, 100 + i, **cfg) for i, (name, (_, cfg)) in enumerate(ADAPTERS.items())}


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(path, device="cpu", num_kv_blocks=160, show_progress=False, **kw)


def _with_slots(runner: ModelRunner, adapters: dict, max_lora_rank: int = 8) -> LoraSlots:
    slots = LoraSlots(runner.model, max_loras=4, max_lora_rank=max_lora_rank)
    for name, (slot, _) in ADAPTERS.items():
        slots.load(slot, adapters[name])
    return slots


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(16, vocab, size=n).tolist() for n in lens]


def _greedy(runner, slots, prompts, row_slots, plans, steps: int = NUM_DECODE):
    """Prefill the prompts as one step, then `steps` decode steps fed on the device, each row on its slot (-1:
    the base); (tokens [R, 1 + steps], logits [R, 1 + steps, V])."""
    blocks = [plans.blocks_for(i, MAX_LEN) for i in range(len(prompts))]
    row_slots = np.asarray(row_slots, dtype=np.int32)
    tokens, logits = [], []
    for k in range(steps + 1):
        if k == 0:
            plan = plans.make_plan([plans.Row(p, 0, blocks[i]) for i, p in enumerate(prompts)])
        else:
            plan = plans.make_plan([plans.Row([0], len(p) + k - 1, blocks[i], feed_from_row=i) for i, p in enumerate(prompts)])
        if slots is not None:
            slots.begin_step(np.repeat(row_slots, np.diff(plan.query_start)))
        tokens.append(runner.execute(plan).tokens.copy())
        logits.append(runner.read_logits())
        if slots is not None:
            slots.end_step()
    return np.stack(tokens, axis=1), np.stack(logits, axis=1)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], steps: int = NUM_DECODE):
    """Transformers' greedy tokens and last-position logits, recomputed from scratch each step."""
    ids, tokens, logits = list(prompt), [], []
    for _ in range(steps + 1):
        last = model(torch.tensor([ids])).logits[0, -1].float()
        tokens.append(int(last.argmax()))
        logits.append(last.numpy())
        ids.append(tokens[-1])
    return tokens, np.stack(logits)


def _close(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The worst gap, relative to LOGIT_ATOL for logits up to 16 (as test_model_parity scales it)."""
    scale = max(1.0, float(np.abs(theirs).max()) / 16)
    return float(np.abs(ours - theirs).max()) / (LOGIT_ATOL * scale)


# ---- the adapter folder ------------------------------------------------------------------------


def test_read_adapter_gives_rank_alpha_scaling_and_normalised_targets(adapters, base_path):
    spec = read_adapter(adapters["all-r8-rslora"])
    assert (spec.rank, spec.lora_alpha, spec.scaling) == (8, 16.0, 16 / 8**0.5)
    assert spec.target_modules == tuple(ALL_TARGETS)
    assert spec.base_model_name_or_path == str(base_path)
    plain = read_adapter(adapters["mlp-r2"])
    assert (plain.rank, plain.scaling) == (2, 2.0)
    assert plain.target_modules == ("k_proj", "o_proj", "up_proj", "down_proj")


def test_read_adapter_imports_no_torch(adapters):
    code = ("import sys; from metrale.lora_adapters import read_adapter; "
            f"read_adapter({str(adapters['qv-r4'])!r}); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _write_adapter(root: pathlib.Path, config: dict | None = None, tensors: dict[str, tuple] | None = None, r: int = 4) -> pathlib.Path:
    """A hand-made adapter folder: config fields over a plain r-4 q_proj adapter's, tensors by name and shape."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none",
           "use_dora": False, "modules_to_save": None, "base_model_name_or_path": "tiny"}
    (root / "adapter_config.json").write_text(json.dumps(cfg | (config or {})))
    if tensors is None:
        tensors = {"model.layers.0.self_attn.q_proj": ((r, 64), (64, r))}
    flat = {}
    for module, (a, b) in tensors.items():
        flat[f"base_model.model.{module}.lora_A.weight"] = torch.randn(a)
        if b is not None:
            flat[f"base_model.model.{module}.lora_B.weight"] = torch.randn(b)
    save_file(flat, str(root / "adapter_model.safetensors"))
    return root


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        ({"use_dora": True}, None, "use_dora=True is not supported"),
        ({"bias": "lora_only"}, None, "bias='lora_only' is not supported"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, None, "'embed_tokens' is an embedding or the LM head"),
        ({"target_modules": ["lm_head"]}, None, "'lm_head' is an embedding or the LM head"),
        ({"target_modules": ["w1", "q_proj"]}, None, "target 'w1' is not supported"),
        ({}, {"model.layers.0.mlp.experts.3.gate_proj": ((4, 64), (32, 4))}, "experts.3.gate_proj.*not supported"),
        ({}, {"model.layers.0.mamba.in_proj": ((4, 64), (64, 4))}, "mamba.in_proj.*not supported"),
        ({}, {"model.layers.0.self_attn.q_proj": ((4, 64), None)}, "has lora_A but not its other half"),
        ({}, {"model.layers.0.self_attn.q_proj": ((8, 64), (64, 8))}, "not rank 4"),
    ],
)
def test_read_adapter_refuses_what_the_slots_cannot_serve(tmp_path, config, tensors, message):
    with pytest.raises(LoraError, match=message):
        read_adapter(_write_adapter(tmp_path / "bad", config, tensors))


def test_read_adapter_names_a_missing_file(tmp_path):
    folder = _write_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="missing adapter_model.safetensors"):
        read_adapter(folder)
    with pytest.raises(LoraError, match="missing adapter_config.json"):
        read_adapter(tmp_path / "nowhere")


def test_a_dora_tensor_is_refused(tmp_path):
    folder = _write_adapter(tmp_path / "dora")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.randn(64)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="lora_magnitude_vector.*not a LoRA A or B weight"):
        read_adapter(folder)


# ---- loading into slots ------------------------------------------------------------------------


def test_a_rank_above_max_lora_rank_is_refused_and_leaves_the_slot_empty(base_path, adapters):
    slots = LoraSlots(_runner(base_path).model, max_loras=2, max_lora_rank=4)
    slots.load(0, adapters["qv-r4"])
    slots.load(1, adapters["qv-r4"])
    with pytest.raises(LoraError, match="rank 8 exceeds max_lora_rank 4"):
        slots.load(0, adapters["all-r8-rslora"])
    assert slots.adapters[0] is None and not any(lin.a[0].any() or lin.b[0].any() for lin in slots._linears)
    assert slots.adapters[1] is not None
    with pytest.raises(LoraError, match="slot 0 holds no adapter"):
        slots.begin_step(np.zeros(3, dtype=np.int32))


def test_a_module_the_model_lacks_is_refused_naming_it(base_path, tmp_path):
    slots = LoraSlots(_runner(base_path).model, max_loras=1, max_lora_rank=8)
    folder = _write_adapter(tmp_path / "deep", tensors={"model.layers.7.self_attn.q_proj": ((4, 64), (64, 4))})
    with pytest.raises(LoraError, match="'model.layers.7.self_attn.q_proj' is not a projection"):
        slots.load(0, folder)


def test_a_shape_that_is_not_the_base_models_is_refused_naming_the_module(base_path, tmp_path):
    slots = LoraSlots(_runner(base_path).model, max_loras=1, max_lora_rank=8)
    wide = _write_adapter(tmp_path / "wide", tensors={"model.layers.1.mlp.down_proj": ((4, 256), (64, 4))})
    with pytest.raises(LoraError, match="model.layers.1.mlp.down_proj: shape"):
        slots.load(0, wide)
    tall = _write_adapter(tmp_path / "tall", tensors={"model.layers.0.self_attn.k_proj": ((4, 64), (64, 4))})
    with pytest.raises(LoraError, match="model.layers.0.self_attn.k_proj: shape"):
        slots.load(0, tall)
    assert slots.adapters[0] is None and not any(lin.a.any() or lin.b.any() for lin in slots._linears)


def test_unload_zeroes_the_slot_and_leaves_the_others(base_path, adapters, plans):
    runner = _runner(base_path)
    slots = _with_slots(runner, adapters)
    prompts = _prompts(runner.info.vocab_size)[:1]
    _, before = _greedy(runner, slots, prompts, [1], plans, steps=0)
    slots.unload(0)
    assert all(not lin.a[0].any() and not lin.b[0].any() for lin in slots._linears)
    assert all(lin.a[1].any() for lin in slots._linears if lin.targeted[1])
    with pytest.raises(LoraError, match="slot 0 holds no adapter"):
        slots.begin_step(np.zeros(4, dtype=np.int32))
    _, after = _greedy(runner, slots, prompts, [1], plans, steps=0)
    assert np.array_equal(before, after)


# ---- the forward -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_matches_peft_unmerged_and_merged(name, base_path, adapters, plans):
    runner = _runner(base_path)
    slots = _with_slots(runner, adapters)
    slot = ADAPTERS[name][0]
    prompts = _prompts(runner.info.vocab_size)
    tokens, logits = _greedy(runner, slots, prompts, [slot] * len(prompts), plans)
    unmerged = peft.PeftModel.from_pretrained(_hf_model(base_path), adapters[name]).eval()
    merged = peft.PeftModel.from_pretrained(_hf_model(base_path), adapters[name]).merge_and_unload().eval()
    base = _hf_model(base_path)
    for i, prompt in enumerate(prompts):
        for model in (unmerged, merged):
            want_tokens, want_logits = _hf_greedy(model, prompt)
            assert tokens[i].tolist() == want_tokens, f"{name}: prompt {i} diverges"
            assert _close(logits[i], want_logits) < 1, f"{name}: prompt {i} logits differ by {np.abs(logits[i] - want_logits).max()}"
        _, base_logits = _hf_greedy(base, prompt, 0)
        assert np.abs(logits[i, 0] - base_logits[0]).max() > 0.1, "the adapter changes nothing: the test would not see it"
    # Another slot's adapter gives other logits: the slot chosen is the one that ran.
    other = (slot + 1) % len(ADAPTERS)
    _, wrong = _greedy(runner, slots, prompts, [other] * len(prompts), plans, steps=0)
    assert np.abs(wrong[:, 0] - logits[:, 0]).max() > 0.1


def test_a_batch_mixing_adapters_and_the_base_equals_each_row_alone(base_path, adapters, plans):
    """Five rows, one step: slot 0's rows are not one run (an index group), the others' are (slices)."""
    runner = _runner(base_path)
    slots = _with_slots(runner, adapters)
    prompts = _prompts(runner.info.vocab_size, lens=(7, 12, 5, 9, 14), seed=3)
    row_slots = [0, -1, 1, 0, 2]
    tokens, logits = _greedy(runner, slots, prompts, row_slots, plans, steps=2)
    for i, (prompt, slot) in enumerate(zip(prompts, row_slots)):
        alone_tokens, alone_logits = _greedy(runner, slots, [prompt], [slot], plans, steps=2)
        assert tokens[i].tolist() == alone_tokens[0].tolist()
        # The same sums over other row counts (another oneDNN kernel; a base row alone takes the fused step).
        assert _close(logits[i], alone_logits[0]) < 0.5, f"row {i} (slot {slot})"
    _, swapped = _greedy(runner, slots, prompts, [1, -1, 0, 0, 2], plans, steps=0)
    assert np.abs(swapped[0, 0] - logits[0, 0]).max() > 0.1 and np.abs(swapped[2, 0] - logits[2, 0]).max() > 0.1
    assert np.array_equal(swapped[1, 0], logits[1, 0])


class _FusedSpy:
    """Counts the fused decode step's runs."""

    def __init__(self, fused):
        self.fused, self.calls = fused, 0

    def serves(self, meta, rope):
        return self.fused.serves(meta, rope)

    def __call__(self, *args):
        self.calls += 1
        return self.fused(*args)


def test_decode_steps_with_lora_leave_the_fused_path_and_match_peft(base_path, adapters, plans):
    runner = _runner(base_path)
    slots = _with_slots(runner, adapters)
    fused = runner.model.fused_decode
    spy = None
    if fused is not None:
        spy = runner.model.fused_decode = _FusedSpy(fused)
    prompts = _prompts(runner.info.vocab_size, seed=4)
    row_slots = [0, 2, 1, 0]
    tokens, logits = _greedy(runner, slots, prompts, row_slots, plans)
    names = {slot: name for name, (slot, _) in ADAPTERS.items()}
    for i, (prompt, slot) in enumerate(zip(prompts, row_slots)):
        want_tokens, want_logits = _hf_greedy(peft.PeftModel.from_pretrained(_hf_model(base_path), adapters[names[slot]]).eval(), prompt)
        assert tokens[i].tolist() == want_tokens
        assert _close(logits[i], want_logits) < 1
    if spy is not None:
        assert spy.calls == 0
        _greedy(runner, slots, prompts, [-1] * 4, plans, steps=2)
        assert spy.calls == 2  # the base model's decode steps still take it


def test_without_lora_tokens_the_output_is_bitwise_the_runner_without_slots(base_path, adapters, plans):
    plain = _runner(base_path)
    runner = _runner(base_path)
    slots = _with_slots(runner, adapters)
    prompts = _prompts(runner.info.vocab_size, seed=5)
    want_tokens, want = _greedy(plain, None, prompts, [-1] * 4, plans)
    _greedy(runner, slots, prompts, [0, 1, 2, 0], plans, steps=1)  # an adapter step before leaves nothing behind
    tokens, got = _greedy(runner, slots, prompts, [-1] * 4, plans)
    assert np.array_equal(tokens, want_tokens) and np.array_equal(got, want)
    _, lora = _greedy(runner, slots, prompts, [0, -1, -1, -1], plans, steps=0)
    assert not np.array_equal(lora[0, 0], want[0, 0]) and np.array_equal(lora[1:, 0], want[1:, 0])


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_layer_adds_the_same_lora_product_as_a_dense_one(quantization, base_path, adapters):
    dense, quant = _runner(base_path).model, _runner(base_path, quantization=quantization).model
    x = {"h": torch.randn(6, 64), "attn": torch.randn(6, 64), "mlp": torch.randn(6, 128)}
    deltas = []
    for model in (dense, quant):
        slots = LoraSlots(model, max_loras=1, max_lora_rank=8)
        slots.load(0, adapters["all-r8-rslora"])
        layer = model.model.layers[1]
        found = []
        for proj, inp in ((layer.self_attn.qkv_proj, "h"), (layer.self_attn.o_proj, "attn"),
                          (layer.mlp.gate_up_proj, "h"), (layer.mlp.down_proj, "mlp")):
            with torch.inference_mode():
                base = proj(x[inp])
                slots.begin_step(np.zeros(6, dtype=np.int32))
                found.append(proj(x[inp]) - base)
                slots.end_step()
        deltas.append(found)
    for d, q in zip(*deltas):
        assert d.abs().max() > 0.1
        assert torch.allclose(d, q, atol=1e-4)


class _NoComm:
    """A rank's collectives that leave its partial sums alone: the test adds the ranks' parts itself."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim):
        raise AssertionError("no gather expected")

    def min_int(self, value):
        return value

    def release(self):
        pass


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks: each of the 2 KV heads held by 2 ranks
def test_tensor_parallel_shards_add_up_to_the_whole_layers(size, base_path, adapters):
    facts = resolve_model(base_path)
    ranks = []
    for rank in range(size):
        group = ParallelGroup(rank, size, comm=_NoComm())
        model = load_model(facts, group=group, show_progress=False)
        slots = LoraSlots(model, max_loras=2, max_lora_rank=8, group=group)
        slots.load(1, adapters["all-r8-rslora"])
        slots.begin_step(np.ones(5, dtype=np.int32))
        ranks.append(model.model.layers[1])
    whole_model = load_model(facts, show_progress=False)
    whole_slots = LoraSlots(whole_model, max_loras=2, max_lora_rank=8)
    whole_slots.load(1, adapters["all-r8-rslora"])
    whole = whole_model.model.layers[1]
    h, attn, mlp = torch.randn(5, 64), torch.randn(5, 64), torch.randn(5, 128)
    with torch.inference_mode():
        without = whole.self_attn.qkv_proj(h)
        whole_slots.begin_step(np.ones(5, dtype=np.int32))
        qkv = whole.self_attn.qkv_proj(h)
        assert (qkv - without).abs().max() > 0.1
        q, k, v = qkv.split([64, 32, 32], dim=1)
        for rank, layer in enumerate(ranks):
            proj = layer.self_attn.qkv_proj
            kv_rank = rank // proj.kv_replicas
            qn, kvn = 64 // size, proj.num_kv_heads * 16
            want = torch.cat([q[:, rank * qn : (rank + 1) * qn], k[:, kv_rank * kvn : (kv_rank + 1) * kvn],
                              v[:, kv_rank * kvn : (kv_rank + 1) * kvn]], dim=1)
            assert torch.allclose(proj(h), want, atol=1e-5), f"qkv of rank {rank}"
            gate, up = whole.mlp.gate_up_proj(h).split(128, dim=1)
            n = 128 // size
            want = torch.cat([gate[:, rank * n : (rank + 1) * n], up[:, rank * n : (rank + 1) * n]], dim=1)
            assert torch.allclose(layer.mlp.gate_up_proj(h), want, atol=1e-5), f"gate_up of rank {rank}"
        for name, x, width in (("o_proj", attn, 64), ("down_proj", mlp, 128)):
            n = width // size
            parts = [getattr(layer.self_attn if name == "o_proj" else layer.mlp, name)(x[:, r * n : (r + 1) * n])
                     for r, layer in enumerate(ranks)]
            full = getattr(whole.self_attn if name == "o_proj" else whole.mlp, name)(x)
            assert torch.allclose(sum(parts), full, atol=1e-5), name


# ---- other families ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind, targets", [
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),  # Phi-3's pre-fused projections
    ("olmo2", ALL_TARGETS),
    ("gemma2", ["q_proj", "v_proj", "down_proj"]),
])
def test_other_families_match_peft(kind, targets, hf_model_dir, tmp_path, plans):
    path = hf_model_dir(kind)
    folder = _make_adapter(path, tmp_path / kind, 7, r=4, lora_alpha=8, target_modules=targets)
    runner = _runner(path)
    slots = LoraSlots(runner.model, max_loras=2, max_lora_rank=4)
    slots.load(1, folder)
    prompts = _prompts(runner.info.vocab_size)[:2]
    tokens, logits = _greedy(runner, slots, prompts, [1, 1], plans, steps=2)
    reference = peft.PeftModel.from_pretrained(_hf_model(path), folder).eval()
    base = _hf_model(path)
    for i, prompt in enumerate(prompts):
        want_tokens, want_logits = _hf_greedy(reference, prompt, 2)
        assert tokens[i].tolist() == want_tokens
        assert _close(logits[i], want_logits) < 1, f"{kind}: prompt {i}"
        assert np.abs(logits[i, 0] - _hf_greedy(base, prompt, 0)[1][0]).max() > 0.1


def test_an_expert_layer_is_not_adapted_but_its_attention_is(hf_model_dir, tmp_path):
    model = _runner(hf_model_dir("qwen3_moe")).model
    slots = LoraSlots(model, max_loras=1, max_lora_rank=4)
    moe = _write_adapter(tmp_path / "moe", config={"target_modules": ["gate_proj"]},
                         tensors={"model.layers.0.mlp.gate_proj": ((4, 64), (128, 4))})
    with pytest.raises(LoraError, match="'model.layers.0.mlp.gate_proj' is not a projection this Qwen3MoeForCausalLM"):
        slots.load(0, moe)
    slots.load(0, _write_adapter(tmp_path / "attn", tensors={"model.layers.0.self_attn.q_proj": ((4, 64), (64, 4))}))
    assert slots.adapters[0] is not None

