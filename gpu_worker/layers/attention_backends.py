"""Attention backends: how a layer's queries meet the paged KV cache on this device.

A backend writes the step's keys and values into the cache and attends a step's decode rows (one query
each, all together) and its prefill chunks (one by one). The runner picks the device's backend once
(`select_backend`); each layer keeps it when it `supports` the layer (its head size, soft-capping, ...)
and otherwise falls back to `TORCH`, which supports everything, so one unusual layer never costs the
others their fast path.

- `TorchAttention`: decode rows gathered from their blocks, padded, masked, one SDPA call; prefill chunks by
  SDPA. Logit soft-capping (Gemma 2) has no SDPA form, so those layers run the same arithmetic eagerly, as
  transformers' eager attention does.
- `NativeCpuAttention`: decode rows by the native paged kernel (layers/cpu_kernels.py: reads each key and
  value once from its block, online softmax; keys stored head-dim-major); prefill as the torch path.
- `TritonAttention` (layers/triton_attention.py): on CUDA when triton imports, decode rows and every prefill
  chunk by Triton kernels that read K/V in place through the block table (windows, soft-caps, GQA); a GPU
  without triton runs the torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.layers.attention_metadata import AttentionMetadata, DecodeRows, PrefillRow
from metrale.gpu_worker.layers.kv_cache import PagedKVCache


class TorchAttention:
    """The torch path: gather + SDPA (eager with soft-capping); supports every layer on every device."""

    name = "torch"
    native_decode = False  # reads DecodeRows.masks, not the native kernel's lengths
    transposed_keys = False  # keys stored [block, block_size, kv_heads, head_dim]
    varlen_prefill = False  # reads AttentionMetadata.prefills, one chunk at a time
    # Not capturable in a CUDA graph: its decode gathers into the cache's shared scratch (regrown by eager steps).
    graph_safe = False

    def supports(self, layer) -> bool:
        """Every layer."""
        return True

    def forward(self, layer, q, k, v, cache: PagedKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Write k, v into the cache, attend, return [T, heads * head_dim].

        q [T, heads, head_dim]; k, v [T, kv_heads, head_dim] (already rotated).
        """
        cache.write(layer.layer, meta.slot_mapping, k, v)
        num_tokens, heads, head_dim = q.shape
        if meta.decode is not None and not meta.prefills and meta.decode.token_idx is None:
            return self.decode(layer, q, cache, meta.decode).reshape(num_tokens, heads * head_dim)
        out = torch.empty(num_tokens, heads * head_dim, dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            idx = meta.decode.token_idx
            out[idx] = self.decode(layer, q[idx], cache, meta.decode).reshape(len(idx), -1)
        for row in meta.prefills:
            chunk = self.prefill(layer, q, k, v, cache, row)
            out[row.start : row.end] = chunk.reshape(row.end - row.start, -1)
        return out

    def decode(self, layer, q, cache: PagedKVCache, rows: DecodeRows) -> torch.Tensor:
        """One query per row against the row's cached keys: [Rd, heads, head_dim]."""
        k, v = cache.gather(layer.layer, rows.block_ids)  # [Rd, nb * block_size, kv_heads, head_dim]
        n = rows.num_keys
        q4, k4, v4 = q[:, :, None, :], k[:, :n].transpose(1, 2), v[:, :n].transpose(1, 2)
        mask = rows.masks[layer.window]
        if layer.softcap is not None:
            return _eager(q4, k4, v4, mask, layer.scale, layer.softcap)[:, :, 0, :]
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=layer.scale, enable_gqa=True)
        return out[:, :, 0, :]

    def prefill(self, layer, q, k, v, cache: PagedKVCache, row: PrefillRow) -> torch.Tensor:
        """A chunk's queries against its row's context and itself: [chunk, heads, head_dim]."""
        qr = q[row.start : row.end].transpose(0, 1)[None]  # [1, heads, chunk, head_dim]
        if row.block_ids is None:
            kr = k[row.start : row.end]
            vr = v[row.start : row.end]
        else:
            seq_len = row.context + (row.end - row.start)
            kr, vr = cache.gather(layer.layer, row.block_ids)
            kr, vr = kr[:seq_len], vr[:seq_len]
        kr, vr = kr.transpose(0, 1)[None], vr.transpose(0, 1)[None]
        mask = row.masks[layer.window]
        if layer.softcap is not None:
            if mask is None:
                n = row.end - row.start
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
            out = _eager(qr, kr, vr, mask, layer.scale, layer.softcap)
        else:
            out = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=mask, is_causal=mask is None, scale=layer.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)


class NativeCpuAttention(TorchAttention):
    """Decode rows by the native paged CPU kernel; everything else as the torch path."""

    name = "cpu-native"
    native_decode = True  # reads DecodeRows.seq_lens / first_keys
    transposed_keys = True  # keys stored head-dim-major (the kernel's vector loads)

    def supports(self, layer) -> bool:
        """Layers without logit soft-capping (the kernel's softmax has none)."""
        return layer.softcap is None

    def decode(self, layer, q, cache: PagedKVCache, rows: DecodeRows) -> torch.Tensor:
        """The native kernel over each row's blocks: [Rd, heads, head_dim]."""
        return cpu_kernels.paged_decode(
            q, cache.k_blocks[layer.layer], cache.v[layer.layer], rows.block_ids, rows.seq_lens,
            rows.first_keys[layer.window], layer.scale,
        )


TORCH = TorchAttention()
NATIVE_CPU = NativeCpuAttention()


def select_backend(device: torch.device, *, native: bool) -> TorchAttention:
    """The device's attention backend: the native kernels on a CPU that has them loaded, the Triton kernels on
    CUDA when triton imports and they pass their probe, else torch."""
    if device.type == "cpu" and native:
        return NATIVE_CPU
    if device.type == "cuda":
        try:
            from metrale.gpu_worker.layers import triton_attention
        except ImportError:
            return TORCH
        # Checked once per device on a small step against this path (triton_attention.works_on).
        return triton_attention.TRITON if triton_attention.works_on(device) else TORCH
    return TORCH


def _eager(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """transformers' eager attention with logit soft-capping: q [B, H, Lq, D], k, v [B, Hkv, Lk, D]; mask bool
    (True = visible) or additive float, broadcastable to [B, H, Lq, Lk], or None. Returns [B, H, Lq, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    w = torch.matmul(q, k.transpose(-1, -2)) * scale
    w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)
