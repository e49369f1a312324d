"""The token embedding of a GGUF file read in place: the file's blocks as stored, rows dequantized when looked up.

A quantized embedding table (a Q8_0 or Q6_K token_embd) dequantized at load would be a float table larger than
the file's tensor (bfloat16: twice a Q8_0's bytes), of which a step reads a few rows. `GgufEmbedding` keeps the
table as a view of the file's map (gguf_weights.py yields it raw, tagged with its type) and dequantizes only the
rows it looks up, as llama.cpp's get_rows does: each row exactly as the whole table would have been (float32 by
the type's decoder, bit for bit gguf's dequantization, then rounded to the model's dtype), so the model's
outputs do not change.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from metrale.gpu_worker.layers import gguf_quant_types as qt
from metrale.gpu_worker.layers.gguf_linear import GGUF_ROWS, GGUF_TYPE, raw_columns, tagged
from metrale.gpu_worker.layers.linear_method import set_weight_attrs


class GgufEmbedding(nn.Module):
    """blocks[ids] dequantized, for a table of one GGUF type in a group of one (the embedding it replaces keeps
    the vocabulary, hidden size and dtype)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype):
        """An empty `weight` until the loader hands it the file's blocks."""
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.qtype: str | None = None
        self.weight = nn.Parameter(torch.empty(0, 0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(self.weight, output_dim=0, input_dim=None, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Take the file's raw table (tagged with its type) as the weight itself: no copy."""
        name = getattr(loaded, GGUF_TYPE, None)
        if name not in qt.TYPES:
            raise ValueError(f"a GGUF embedding takes its file's blocks of a known type (got {name or loaded.dtype})")
        if getattr(loaded, GGUF_ROWS, None) is not None:
            raise ValueError("a GGUF embedding takes its table's rows in order")
        if loaded.shape[0] != self.vocab_size or raw_columns(loaded) != self.hidden_size:
            raise ValueError(f"blocks for {loaded.shape[0]} x {raw_columns(loaded)}, expected {self.vocab_size} x {self.hidden_size}")
        param.data = loaded
        self.qtype = name

    def blocks(self) -> torch.Tensor:
        """The table's raw blocks, tagged with their type (what a tied head's GgufLinearMethod loads)."""
        return tagged(self.weight.data.numpy(), self.qtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] embeddings of ids [T], in the model's dtype."""
        rows = self.weight.data.index_select(0, ids.reshape(-1).to(torch.long))
        return rows_to_floats(rows, self.qtype).to(self.dtype).view(*ids.shape, self.hidden_size)


def rows_to_floats(rows: torch.Tensor, name: str) -> torch.Tensor:
    """Stored rows of blocks of type `name` (uint8 [n, bytes]) as float32 [n, cols]: Q8_0 in torch (d * q in
    float32, gguf's own product), every other type by its table row's decoder."""
    if name == "Q8_0":
        blocks = rows.view(rows.shape[0], -1, 34)
        d = blocks[:, :, :2].contiguous().view(torch.float16).float()
        return (blocks[:, :, 2:].contiguous().view(torch.int8).float() * d).reshape(rows.shape[0], -1)
    return qt.dequantize(qt.decode(name, np.ascontiguousarray(rows.numpy())))
