"""Dispatch by speed: each quantized product runs on the kernel class measured fastest on this CPU, cached per CPU
model; a forced class or METRALE_KERNEL_DISPATCH=rank keeps every product on the process's class."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from metrale.gpu_worker.layers import cpu_kernels, kernel_choice
from metrale.gpu_worker.layers.quantization import Int8LinearMethod, pack_int8, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable")


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Dispatch by measurement into a fresh cache, with nothing chosen yet."""
    monkeypatch.setenv(kernel_choice.ENV, "measure")
    monkeypatch.delenv("METRALE_CPU_ISA", raising=False)
    monkeypatch.setenv("METRALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_choice, "_chosen", {})
    if cpu_kernels.isa() == "amx":
        pytest.skip("the amx class keeps its products (their wide path lives in that build)")
    return tmp_path


def _fixed_times(monkeypatch, times: dict[str, float]) -> list[str]:
    """Replace the measurement by fixed times; returns the ops measured."""
    measured = []

    def fake(op, clock=None):
        measured.append(op)
        return dict(times)

    monkeypatch.setattr(kernel_choice, "measure", fake)
    return measured


def test_the_fastest_class_is_taken_and_cached_per_cpu(measuring, monkeypatch, caplog):
    classes = kernel_choice.candidates()
    if len(classes) < 2:
        pytest.skip("one kernel class on this CPU: nothing to choose")
    slowest_first = {cls: 100.0 - i for i, cls in enumerate(reversed(classes))}  # the least class is fastest
    measured = _fixed_times(monkeypatch, slowest_first)
    with caplog.at_level(logging.INFO, logger=kernel_choice.__name__):
        assert kernel_choice.class_for("int8_linear") == classes[0]
    assert measured == ["int8_linear"]
    assert "int8_linear runs on " + classes[0] in caplog.text
    cached = json.loads(next((measuring / "dispatch").glob("*.json")).read_text())
    assert cached == {"int8_linear": classes[0]}
    # A new process (nothing chosen) reads the cache instead of measuring again.
    monkeypatch.setattr(kernel_choice, "_chosen", {})
    assert kernel_choice.class_for("int8_linear") == classes[0]
    assert measured == ["int8_linear"]
    if classes[0] != cpu_kernels.isa():
        assert f"int8_linear: {classes[0]}" in kernel_choice.describe()


def test_rank_or_a_forced_class_keeps_the_process_class(measuring, monkeypatch):
    measured = _fixed_times(monkeypatch, {"avx2": 1.0})
    monkeypatch.setenv(kernel_choice.ENV, "rank")
    assert kernel_choice.class_for("int8_linear") == cpu_kernels.isa()
    monkeypatch.setenv(kernel_choice.ENV, "measure")
    monkeypatch.setenv("METRALE_CPU_ISA", cpu_kernels.isa())
    assert kernel_choice.class_for("int4_linear") == cpu_kernels.isa()
    assert measured == []
    assert kernel_choice.describe() == cpu_kernels.isa()


def test_a_bad_dispatch_setting_is_named(monkeypatch):
    monkeypatch.setenv(kernel_choice.ENV, "fastest")
    with pytest.raises(ValueError, match="METRALE_KERNEL_DISPATCH"):
        kernel_choice.mode()


def test_the_measurement_times_every_candidate_that_has_the_op(measuring):
    times = kernel_choice.measure("int8_linear")
    have = [c for c in kernel_choice.candidates() if cpu_kernels.has("int8_linear", c)]
    assert sorted(times) == sorted(have)
    if len(have) > 1:
        assert all(t > 0 for t in times.values())


def test_a_layer_on_the_chosen_class_multiplies_as_the_process_class_does(measuring, monkeypatch):
    classes = [c for c in kernel_choice.candidates() if cpu_kernels.has("int8_linear", c)]
    other = next((c for c in classes if c != cpu_kernels.isa()), None)
    if other is None:
        pytest.skip("one kernel class on this CPU")
    _fixed_times(monkeypatch, {other: 1.0, cpu_kernels.isa(): 2.0})
    w = torch.randn(48, 96) * 0.1
    x = torch.randn(3, 96)

    def layer_output() -> torch.Tensor:
        layer = torch.nn.Module()
        method = Int8LinearMethod()
        layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        layer.act_dtype = torch.float32
        method.process_weights_after_loading(layer)
        return method.apply(layer, x), layer.int8_op

    on_other, op = layer_output()
    assert op is getattr(cpu_kernels.ops(other), "int8_linear").default
    codes, scales = pack_int8(*quantize_int8(w))
    own = cpu_kernels.ops().int8_linear(x, codes, scales, 48, False)
    torch.testing.assert_close(on_other, own, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["int8_linear", "int4_linear", "int5_linear", "kq8_linear"])
def test_every_quantized_product_has_a_probe_its_op_runs(op):
    """Each product the GGUF and quantized layers call is dispatched by speed: its probe builds a layer the op takes."""
    if not cpu_kernels.has(op):
        pytest.skip(f"{op} did not build here")
    args = kernel_choice._PROBES[op]()
    x = torch.randn(kernel_choice.ROWS, kernel_choice.IN).to(torch.bfloat16)
    y = getattr(cpu_kernels.ops(), op).default(x, *args)
    assert y.shape == (kernel_choice.ROWS, kernel_choice.OUT) and torch.isfinite(y.float()).all()
