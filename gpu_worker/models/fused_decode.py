"""A decode step's decoder layers in one native call, for models whose every layer is the plain Llama form.

A decode step of a small batch is hundreds of small ops (ten per layer), and on a CPU each costs its
Python frame and its dispatch as well as its arithmetic: at batch 1 that overhead is a large share of the
step. `FusedDecode` hands the layers' weights once (after loading) to a native `DecodeStep`
(layers/cpu_decode_step.cpp), which then runs every layer of a step in one call: the same kernels, the
same oneDNN products on the same packed weights, in the same order, so the same bits as the module path.

A quantized projection (GGUF blocks, `--quantization int8/int4`) whose method is a row-stacking of native
products (`LinearMethod.native_products`) is handed over as those products, which the step calls through the
dispatcher as the method does: at batch 1 a quantized model's Python per op is as large a share as a dense one's.

It serves a step only when every row decodes one token (no prefill chunk) and the rotary is a plain table
lookup; any other step, and any model with a layer outside the form (q/k norms, a mixture of experts, soft
caps, a linear method with no native products, tensor parallelism, the torch attention path), runs the modules.
"""

from __future__ import annotations

import torch

from metrale.gpu_worker.layers import cpu_kernels
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
        step = cpu_kernels.classes().DecodeStep(weights, window_of, heads, kv_heads, head_dim, eps, scale)
        for index, which, (products, wide) in quantized:
            step.set_products(
                index, which, [p.op._schema.name for p in products], [len(p.args) for p in products],
                [t for p in products for t in p.args], [p.rows for p in products],
                [int(p.takes_wide) for p in products], bool(wide), WIDE_ROWS,
            )
        return cls(step, windows)

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


def _dense_weight(layer) -> torch.Tensor:
    """What DenseLinearMethod multiplies by: the oneDNN-packed weight, else the plain one; nothing for a
    quantized layer (the step calls its products)."""
    if type(layer.quant_method) is not DenseLinearMethod:
        return _NO_BIAS
    return layer.packed.packed if layer.packed is not None else layer.weight


def _bias(layer) -> torch.Tensor:
    """The layer's bias, or an empty tensor for none."""
    return _NO_BIAS if layer.bias is None else layer.bias
