"""A decode step's decoder layers in one native call, for models whose every layer is the plain Llama form.

A decode step of a small batch is hundreds of small ops (ten per layer), and on a CPU each costs its
Python frame and its dispatch as well as its arithmetic: at batch 1 that overhead is a large share of the
step. `FusedDecode` hands the layers' weights once (after loading) to a native `DecodeStep`
(layers/cpu_decode_step.cpp), which then runs every layer of a step in one call: the same kernels, the
same oneDNN products on the same packed weights, in the same order, so the same bits as the module path.

A quantized projection (GGUF blocks, `--quantization int8/int4`) whose method is a row-stacking of native
products (`LinearMethod.native_products`) is handed over as those products, which the step calls through the
dispatcher as the method does: at batch 1 a quantized model's Python per op is as large a share as a dense one's.
Where every projection is such a product, the step itself (norms, rotary, KV write, attention, residuals) is
built from the kernel class measured fastest for it on this CPU (layers/kernel_choice.py's `step_class`: the
model's own step timed on each candidate class over a private cache); otherwise from the process's class. A step
on another class than the modules rounds its bf16 work in that class's way: the same arithmetic, not always the
same bits as the module path (the tests run one class, where they are).

It serves a step only when every row decodes one token (no prefill chunk) and the rotary is a plain table
lookup; any other step, and any model with a layer outside the form (q/k norms, a mixture of experts, soft
caps, a linear method with no native products, tensor parallelism, the torch attention path), runs the modules.
"""

from __future__ import annotations

import torch

from metrale.gpu_worker.layers import cpu_kernels, kernel_choice
from metrale.gpu_worker.layers.attention_backends import NATIVE_CPU
from metrale.gpu_worker.layers.attention_metadata import AttentionMetadata
from metrale.gpu_worker.layers.kv_cache import PagedKVCache, SlotIndex
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod
from metrale.gpu_worker.layers.quantization import WIDE_ROWS
from metrale.gpu_worker.layers.rotary import StepRope

_NO_BIAS = torch.empty(0)


class FusedDecode:
    """The native decode step over a model's layers, and the test of whether it serves a step."""

    __slots__ = ("step", "windows", "_cache")

    def __init__(self, step, windows: list):
        """Wrap a built DecodeStep; windows: the distinct sliding windows, in the order it indexes them."""
        self.step = step
        self.windows = windows
        self._cache: PagedKVCache | None = None

    @classmethod
    def build(cls, model) -> FusedDecode | None:
        """The fused step for a loaded DecoderLM, or None where some layer (or the device) needs the modules."""
        from metrale.gpu_worker.models.decoder import GatedMLP, SelfAttention
        from metrale.gpu_worker.models.llama import LlamaDecoderLayer

        ctx = model.ctx
        if not ctx.native or ctx.device.type != "cpu" or ctx.group.size != 1 or model.embed_scale is not None:
            return None
        if len(model.rotaries) != 1 or model.rotaries[0].partial:
            return None
        weights: list[torch.Tensor] = []
        windows: list = []
        window_of: list[int] = []
        shapes = set()
        quantized: list[tuple[int, int, tuple]] = []  # (layer, projection, (products, wide))
        for index, layer in enumerate(model.model.layers):
            if type(layer).forward is not LlamaDecoderLayer.forward:
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn) is not SelfAttention or type(mlp) is not GatedMLP or attn.qk_norm is not None or attn.rope_index != 0:
                return None
            if attn.attn.backend is not NATIVE_CPU or attn.attn.softcap is not None or not mlp.act.native:
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(n.native for n in norms):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.bias is not None for lin in linears[2:]):
                return None
            for which, lin in enumerate(linears):
                if type(lin.quant_method) is DenseLinearMethod:
                    continue
                native = lin.quant_method.native_products(lin)
                if native is None:
                    return None
                quantized.append((index, which, native))
            qkv, o, gate_up, down = (_dense_weight(lin) for lin in linears)
            weights += [norms[0].scale, qkv, _bias(attn.qkv_proj), o, _bias(attn.o_proj), norms[1].scale, gate_up, down]
            window = attn.attn.window
            if window not in windows:
                windows.append(window)
            window_of.append(windows.index(window))
            shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, norms[0].eps, norms[1].eps, attn.attn.scale))
        if len(shapes) != 1:
            return None
        heads, kv_heads, head_dim, eps, post_eps, scale = shapes.pop()
        if eps != post_eps:
            return None

        def make(kernel_class: str):
            step = cpu_kernels.classes(kernel_class).DecodeStep(weights, window_of, heads, kv_heads, head_dim, eps, scale)
            for index, which, (products, wide) in quantized:
                step.set_products(
                    index, which, [p.op._schema.name for p in products], [len(p.args) for p in products],
                    [t for p in products for t in p.args], [p.rows for p in products],
                    [int(p.takes_wide) for p in products],
                    [p.wide_op._schema.name if p.wide_op is not None else "" for p in products], bool(wide), WIDE_ROWS,
                )
            return step

        kernel_class = cpu_kernels.isa()
        if len(quantized) == 4 * len(window_of):  # every projection a native product: the step's class is free
            hidden = weights[0].numel()
            intermediate = model.model.layers[0].mlp.down_proj.input_size_per_partition
            dtype = model.dtype
            key = f"decode_step {hidden}/{intermediate} heads {heads}/{kv_heads}x{head_dim} {str(dtype).removeprefix('torch.')}"
            probe: list[_Probe] = []  # made only where the choice is measured, not read from the cache

            def timed(kernel_class: str):
                if not probe:
                    probe.append(_Probe(len(window_of), len(windows), hidden, kv_heads, head_dim, dtype))
                return probe[0].call(make(kernel_class))

            kernel_class = kernel_choice.step_class(key, timed)
        return cls(make(kernel_class), windows)

    def serves(self, meta: AttentionMetadata, rope: StepRope) -> bool:
        """True for a step of one-token rows only (in order), with the rotary a table lookup."""
        decode = meta.decode
        return decode is not None and not meta.prefills and decode.token_idx is None and rope.table is not None

    def __call__(self, h: torch.Tensor, rope: StepRope, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Run every layer over h [R, hidden] (the residual stream, updated in place); the last layer's
        output, still to be added to h."""
        if cache is not self._cache:
            if not cache.transposed_keys:
                raise ValueError("the fused decode step reads keys stored head-dim-major")
            self.step.bind_cache(cache.k_blocks, cache.v)
            self._cache = cache
        decode = meta.decode
        slots = meta.slot_mapping.slots if isinstance(meta.slot_mapping, SlotIndex) else meta.slot_mapping
        first_keys = [decode.first_keys[w] for w in self.windows]
        return self.step.run(h, rope.table, rope.positions, slots, decode.block_ids, decode.seq_lens, first_keys)


class _Probe:
    """One decode row through a step, over a private KV cache of CONTEXT tokens: what kernel_choice times when
    it chooses the step's class (the keys and values are zeros, the row random: the work, not the answer)."""

    CONTEXT, BLOCK = 128, 16

    def __init__(self, layers: int, windows: int, hidden: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        blocks = self.CONTEXT // self.BLOCK
        self.k = [torch.zeros(blocks, kv_heads, head_dim, self.BLOCK, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(blocks, self.BLOCK, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.h0 = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
        self.h = self.h0.clone()
        self.table = torch.randn(self.CONTEXT, 2, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
        last = torch.tensor([self.CONTEXT - 1])
        self.args = (self.table, last, last.clone(), torch.arange(blocks).view(1, blocks), torch.tensor([self.CONTEXT]),
                     [torch.zeros(1, dtype=torch.int64) for _ in range(windows)])

    def call(self, step):
        """A zero-argument call of `step` (a DecodeStep) on this probe's row and cache."""
        step.bind_cache(self.k, self.v)

        def once():
            self.h.copy_(self.h0)  # the residual stream is updated in place: the same row every call
            return step.run(self.h, *self.args)

        return once


def _dense_weight(layer) -> torch.Tensor:
    """What DenseLinearMethod multiplies by: the oneDNN-packed weight, else the plain one; nothing for a
    quantized layer (the step calls its products)."""
    if type(layer.quant_method) is not DenseLinearMethod:
        return _NO_BIAS
    return layer.packed.packed if layer.packed is not None else layer.weight


def _bias(layer) -> torch.Tensor:
    """The layer's bias, or an empty tensor for none."""
    return _NO_BIAS if layer.bias is None else layer.bias
