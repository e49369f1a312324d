"""Dispatch by speed: each quantized product runs, per weight shape, on the kernel class measured fastest on this
CPU, and the fused decode step on the class measured fastest for it, cached per CPU model; a forced class or
METRALE_KERNEL_DISPATCH=rank keeps every part on the process's class."""

from __future__ import annotations

import json
import types
import logging

import pytest
import torch

from metrale.gpu_worker.layers import cpu_kernels, kernel_choice
from metrale.gpu_worker.layers.quantization import WIDE_ROWS, Int8LinearMethod, pack_int8, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable")


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Dispatch by measurement into a fresh cache, with nothing chosen yet."""
    monkeypatch.setenv(kernel_choice.ENV, "measure")
    monkeypatch.delenv("METRALE_CPU_ISA", raising=False)
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_choice, "_chosen", {})
    return tmp_path


def _other_class() -> str:
    """A candidate class that is not the process's (skips where there is none)."""
    other = next((c for c in kernel_choice.candidates() if c != cpu_kernels.isa()), None)
    if other is None:
        pytest.skip("one kernel class on this CPU: nothing to choose")
    return other


def _fixed_times(monkeypatch, fastest: str) -> list[str]:
    """Replace both measurements by fixed times where `fastest` wins; returns what was measured."""
    measured = []

    def times(classes):
        return {c: (1.0 if c == fastest else 2.0) for c in classes}

    def product(op, args, cols, classes=None, clock=None):
        measured.append(f"{op} {cols}")
        return times(classes)

    def calls(calls, per_round, clock=None):
        measured.append("step")
        return times(list(calls))

    monkeypatch.setattr(kernel_choice, "measure_product", product)
    monkeypatch.setattr(kernel_choice, "measure_calls", calls)
    return measured


def _int8_args(rows: int, cols: int) -> tuple:
    codes, scales = pack_int8(*quantize_int8(torch.randn(rows, cols) * 0.02))
    return codes, scales, rows, False


def test_the_fastest_class_is_taken_per_shape_and_cached_per_cpu(measuring, monkeypatch, caplog):
    other = _other_class()
    measured = _fixed_times(monkeypatch, other)
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        assert kernel_choice.product_class("int8_linear", _int8_args(48, 96), 48, 96) == other
        assert kernel_choice.product_class("int8_linear", _int8_args(48, 96), 48, 96) == other  # this process: asked once
    assert measured == ["int8_linear 96"]
    assert f"int8_linear 48x96 runs on {other}" in caplog.text
    cached = json.loads(next((measuring / "dispatch").glob("*.json")).read_text())
    assert cached == {"int8_linear 48x96": other}
    assert f"int8_linear 48x96: {other}" in kernel_choice.describe()
    # Another shape is measured on its own; a new process (nothing chosen) reads the cache instead of measuring.
    kernel_choice.product_class("int8_linear", _int8_args(32, 64), 32, 64)
    assert measured == ["int8_linear 96", "int8_linear 64"]
    monkeypatch.setattr(kernel_choice, "_chosen", {})
    assert kernel_choice.product_class("int8_linear", _int8_args(48, 96), 48, 96) == other
    assert measured == ["int8_linear 96", "int8_linear 64"]


def test_a_cached_answer_this_cpu_cannot_take_is_measured_again(measuring, monkeypatch):
    other = _other_class()
    measured = _fixed_times(monkeypatch, other)
    path = kernel_choice._cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"int8_linear 48x96": "no_such_class"}))
    assert kernel_choice.product_class("int8_linear", _int8_args(48, 96), 48, 96) == other
    assert measured == ["int8_linear 96"]
    assert json.loads(path.read_text()) == {"int8_linear 48x96": other}


def test_rank_or_a_forced_class_keeps_the_process_class(measuring, monkeypatch):
    measured = _fixed_times(monkeypatch, "avx2")
    monkeypatch.setenv(kernel_choice.ENV, "rank")
    assert kernel_choice.product_class("int8_linear", _int8_args(48, 96), 48, 96) == cpu_kernels.isa()
    assert kernel_choice.step_class("decode_step x", lambda c: (lambda: None)) == cpu_kernels.isa()
    monkeypatch.setenv(kernel_choice.ENV, "measure")
    monkeypatch.setenv("METRALE_CPU_ISA", cpu_kernels.isa())
    assert kernel_choice.product_class("int4_linear", (), 48, 96) == cpu_kernels.isa()
    assert kernel_choice.step_class("decode_step x", lambda c: (lambda: None)) == cpu_kernels.isa()
    assert measured == []
    assert kernel_choice.describe() == cpu_kernels.isa()


def test_a_bad_dispatch_setting_is_named(monkeypatch):
    monkeypatch.setenv(kernel_choice.ENV, "fastest")
    with pytest.raises(ValueError, match="METRALE_KERNEL_DISPATCH"):
        kernel_choice.mode()


def test_the_measurement_times_every_candidate_that_has_the_op(measuring):
    times = kernel_choice.measure_product("int8_linear", _int8_args(64, 256), 256)
    have = [c for c in kernel_choice.candidates() if cpu_kernels.has("int8_linear", c)]
    assert sorted(times) == sorted(have)
    assert all(t > 0 for t in times.values())


def _int8_layer(w: torch.Tensor, dtype: torch.dtype):
    layer = torch.nn.Module()
    method = Int8LinearMethod()
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.act_dtype = dtype
    method.process_weights_after_loading(layer)
    return method, layer


def test_a_layer_on_the_chosen_class_multiplies_as_the_process_class_does(measuring, monkeypatch):
    other = _other_class()
    _fixed_times(monkeypatch, other)
    w = torch.randn(48, 96) * 0.1
    x = torch.randn(3, 96)
    method, layer = _int8_layer(w, torch.float32)
    assert layer.native.op is getattr(cpu_kernels.ops(other), "int8_linear").default
    codes, scales = pack_int8(*quantize_int8(w))
    own = cpu_kernels.ops().int8_linear(x, codes, scales, 48, False)
    torch.testing.assert_close(method.apply(layer, x), own, rtol=1e-5, atol=1e-5)


def test_the_wide_product_stays_on_the_process_class(measuring, monkeypatch):
    """On a class with a wide product (amx), a layer whose few-row product moved keeps the process's op for many
    bf16 rows: the same result as the process's wide product, which no other class has."""
    other = _other_class()
    _fixed_times(monkeypatch, other)
    w = torch.randn(48, 96) * 0.1
    method, layer = _int8_layer(w, torch.bfloat16)
    if not layer.wide:
        assert layer.native.wide_op is None
        pytest.skip("this class has no wide product")
    assert layer.native.wide_op is getattr(cpu_kernels.ops(), "int8_linear").default
    x = torch.randn(WIDE_ROWS, 96).to(torch.bfloat16)
    codes, scales = pack_int8(*quantize_int8(w))
    own = cpu_kernels.ops().int8_linear(x, codes, scales, 48, True)
    assert torch.equal(method.apply(layer, x), own)


def test_the_fused_decode_step_runs_on_its_chosen_class(measuring, monkeypatch, tiny_model_dir, plans):
    """A model whose projections are all native products gets its step built from the class measured fastest
    (the measurement runs the real step on each candidate); the answer is cached beside the products'."""
    from metrale.gpu_worker.model_runner import ModelRunner

    other = _other_class()
    _fixed_times(monkeypatch, other)
    built = []
    classes = cpu_kernels.classes

    def recording(cls=None):
        built.append(cls)
        return classes(cls)

    monkeypatch.setattr(cpu_kernels, "classes", recording)
    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", dtype="bfloat16", quantization="int8", num_kv_blocks=256,
                         show_progress=False)
    assert runner.model.fused_decode is not None
    assert built[-1] == other  # the step kept: built from the chosen class (after one per candidate, to time)
    assert sorted(built[:-1]) == sorted(kernel_choice.candidates())
    cached = json.loads(next((measuring / "dispatch").glob("*.json")).read_text())
    step_keys = [k for k in cached if k.startswith("decode_step ")]
    assert len(step_keys) == 1 and cached[step_keys[0]] == other
    assert f"{step_keys[0]}: {other}" in kernel_choice.describe()
    # A decode step on the moved step answers as the modules (on the process's class) do, to bf16 rounding.
    prompt = [5, 6, 7, 8, 9]
    tokens = runner.execute(plans.make_plan([plans.Row(prompt, 0, plans.blocks_for(0, 64))])).tokens
    plan = plans.make_plan([plans.Row([int(tokens[0])], len(prompt), plans.blocks_for(0, 64))])
    fused = runner.forward_only(plan).clone()
    step, runner.model.fused_decode = runner.model.fused_decode, None
    modules = runner.forward_only(plan).clone()
    runner.model.fused_decode = step
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused.float(), modules.float(), rtol=0.05, atol=0.05)


def test_the_step_measurement_runs_each_candidates_step(measuring, tiny_model_dir):
    """Unfaked: each candidate class's step runs on the probe (finite, timed) and one is kept."""
    from metrale.gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", dtype="bfloat16", quantization="int8", num_kv_blocks=256,
                         show_progress=False)
    assert runner.model.fused_decode is not None
    files = list((measuring / "dispatch").glob("*.json"))  # none where there is one class: nothing measured
    cached = json.loads(files[0].read_text()) if files else {}
    assert any(k.startswith("decode_step ") for k in cached) == (len(kernel_choice.candidates()) > 1)
    assert set(cached.values()) <= set(kernel_choice.candidates())


def test_a_product_is_measured_on_copies_streamed_past_the_cache(monkeypatch):
    """Each round reads every copy of the weight once, the copies together just past stream_bytes(), and the next
    class goes on through the same copies: the weight comes from memory, as in a decode step, not from cache (a
    measurement that calls one weight again and again fails this)."""
    read = []
    op = types.SimpleNamespace(default=lambda x, codes, scales, rows, wide: read.append(codes.data_ptr()))
    monkeypatch.setattr(cpu_kernels, "ops", lambda cls=None: types.SimpleNamespace(int8_linear=op))
    monkeypatch.setattr(kernel_choice, "STREAM_MIN", 1 << 20)
    monkeypatch.setattr(kernel_choice, "STREAM_MAX", 1 << 20)
    rounds = {}

    def calls(calls, per_round, clock=None):
        for cls, call in calls.items():
            for _ in range(per_round):
                call()
            rounds[cls] = per_round
        return {cls: 1.0 for cls in calls}

    monkeypatch.setattr(kernel_choice, "measure_calls", calls)
    args = _int8_args(64, 256)
    size = args[0].nbytes + args[1].nbytes
    kernel_choice.measure_product("int8_linear", args, 256, ["first", "second"])
    copies = rounds["first"]
    assert copies * size >= 1 << 20 > (copies - 1) * size
    assert len(set(read[:copies])) == copies and read[copies:] == read[:copies]  # each once, in the same turn
