"""The token embedding and the LM head, both split over the vocabulary in a parallel group.

Rank r holds vocabulary rows [r * n, (r + 1) * n) with n = ceil(vocab / size) (the last rank's tail padded
with zero rows). The embedding looks up the ids this rank holds and sums over the group; the LM head
multiplies by its rows (through its linear method, so a quantized head works like any linear layer) and
gathers every rank's logits. In a group of one both are the plain op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.gpu_worker.layers import huge_pages
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod, LinearMethod, set_weight_attrs
from metrale.gpu_worker.layers.parallel import SINGLE, ParallelGroup


class VocabParallelEmbedding(nn.Module):
    """weight[ids] for this rank's share of the vocabulary rows."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device, group: ParallelGroup = SINGLE):
        """Allocate this rank's rows (filled by the loader)."""
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // group.size)
        self.vocab_start = group.rank * self.rows_per_rank
        self.sharded = group.size > 1
        # Zero pages mapped on first touch: no pass over the table at construction (a GGUF's table read in place
        # replaces it untouched; a loader's copy faults in what it writes).
        table = huge_pages.zeros((self.rows_per_rank, hidden_size), dtype, device)
        self.weight = nn.Parameter(table, requires_grad=False)
        set_weight_attrs(self.weight, output_dim=0, input_dim=None, weight_loader=self.weight_loader)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] embeddings of ids [T]."""
        if not self.sharded:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's rows of the full [vocab, hidden] table (padding rows stay zero)."""
        load_vocab_rows(param, loaded, self.vocab_size, self.vocab_start)


class ParallelLMHead(nn.Module):
    """hidden [S, hidden] -> logits [S, vocab] through this rank's vocabulary rows, gathered over the group."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device,
        quant_method: LinearMethod | None = None, group: ParallelGroup = SINGLE,
    ):
        """Create the head's weight through its method (dense by default)."""
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // group.size)
        self.vocab_start = group.rank * self.rows_per_rank
        self.gather = group.size > 1
        self.shares_weight = False  # True once tied to the embedding (its table is then never released)
        self.bias = None
        self.quant_method = quant_method or DenseLinearMethod()
        self.quant_method.create_weights(
            self, hidden_size, [self.rows_per_rank], dtype=dtype, device=device, weight_loader=self.weight_loader
        )

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's table (tied checkpoints store only one of them); dense heads only."""
        if not isinstance(self.quant_method, DenseLinearMethod):
            raise ValueError("a tied LM head must be dense (it is the embedding table)")
        self.weight = embedding.weight
        self.shares_weight = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, vocab] logits in the model's dtype."""
        logits = self.quant_method.apply(self, hidden)
        if not self.gather:
            return logits
        return self.group.all_gather(logits, dim=-1)[:, : self.vocab_size]

    def process_weights_after_loading(self) -> None:
        """Let the method prepare what its product reads."""
        self.quant_method.process_weights_after_loading(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's rows of the full [vocab, ...] tensor."""
        load_vocab_rows(param, loaded, self.vocab_size, self.vocab_start)


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int, start: int) -> None:
    """Copy rows [start, start + param rows) of a [vocab, ...] tensor into param (rows past vocab stay as they are)."""
    dim = getattr(param, "output_dim", 0)
    if dim is None or loaded.dim() == 0:
        raise ValueError(f"a vocabulary table needs rows, got shape {tuple(loaded.shape)}")
    if loaded.shape[dim] != vocab_size or loaded.shape[dim + 1 :] != param.shape[dim + 1 :]:
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {vocab_size} rows of {tuple(param.shape[dim + 1 :])}")
    n = min(param.shape[dim], vocab_size - start)
    with torch.no_grad():
        param.data.narrow(dim, 0, n).copy_(loaded.narrow(dim, start, n))
