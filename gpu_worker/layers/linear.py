"""Linear layers with a quantization method and a parallel group (vLLM's shapes, group of one today).

- `ReplicatedLinear`: the whole weight on every rank (a MoE router).
- `ColumnParallelLinear`: output rows split over the group; `MergedColumnParallelLinear` stacks several
  checkpoint weights along the output (gate/up), `QKVParallelLinear` the q, k and v projections, so each
  is one matmul however the checkpoint stores them.
- `RowParallelLinear`: input features split over the group, the partial products summed (all-reduce).

Each layer's `weight_loader(param, loaded_weight, shard_id=None)` is attached to every parameter its
method creates (layers/linear_method.py): a split checkpoint loads part by part (`shard_id` 0/1 for
gate/up, "q"/"k"/"v"), a pre-fused one (Phi-3's qkv_proj and gate_up_proj) in one call with shard_id None,
and either way the loader keeps only this rank's rows (column) or columns (row). With a group of one the
forward is the method's product and nothing else. Where LoRA slots are attached (layers/lora.py sets `lora`), the
step's adapter products are added to it (a row-parallel layer adds its partial one, before the all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from metrale.gpu_worker.layers.linear_method import DenseLinearMethod, LinearMethod, set_weight_attrs
from metrale.gpu_worker.layers.parallel import SINGLE, ParallelGroup

if TYPE_CHECKING:
    from metrale.gpu_worker.layers.lora import LoraLinear


class LinearBase(nn.Module):
    """Shared setup: the method's weights, an optional bias, the group."""

    def __init__(
        self,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant_method: LinearMethod | None,
        group: ParallelGroup,
    ):
        """Create the weights through the method and the bias (zeros: a checkpoint may omit it per part)."""
        super().__init__()
        self.group = group
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method = quant_method or DenseLinearMethod()
        self.lora: LoraLinear | None = None  # set by LoraSlots: adds the step's adapter products to the output
        self.quant_method.create_weights(
            self, input_size_per_partition, self.output_partition_sizes,
            dtype=dtype, device=device, weight_loader=self.weight_loader,
        )
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=dtype, device=device), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0, input_dim=None, weight_loader=self.weight_loader)

    def _tag_shards(self, shard_ids: list) -> None:
        """Record on each row-stacked parameter the shards a complete checkpoint loads into it."""
        for param in self.parameters(recurse=False):
            if getattr(param, "output_dim", None) is not None:
                param.shard_ids = list(shard_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] (this rank's rows)."""
        out = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add(x, out)
        return out

    def process_weights_after_loading(self) -> None:
        """Let the method prepare what its products read."""
        self.quant_method.process_weights_after_loading(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy a checkpoint tensor into param (a replicated layer: whole)."""
        _copy(param.data, loaded)


class ReplicatedLinear(LinearBase):
    """y = x @ W.T (+ b) with the whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, dtype, device, quant_method=None, group=SINGLE):
        """A plain linear layer (the group only decides nothing here)."""
        super().__init__(input_size, [output_size], bias=bias, dtype=dtype, device=device, quant_method=quant_method, group=group)


class ColumnParallelLinear(LinearBase):
    """y = x @ W.T (+ b) for this rank's share of W's rows (the output features)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, dtype, device, quant_method=None, group=SINGLE):
        """A column-parallel layer of output_size rows over the whole group."""
        super().__init__(
            input_size, [group.split(output_size, "output size")], bias=bias, dtype=dtype, device=device,
            quant_method=quant_method, group=group,
        )

    def weight_loader(self, param, loaded, shard_id=None):
        """This rank's rows of the full checkpoint tensor."""
        _copy(param.data, _shard(param, loaded, self.group, getattr(param, "output_dim", None), self.group.rank))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input stacked into one (gate/up)."""

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = False, dtype, device, quant_method=None, group=SINGLE):
        """output_sizes: each stacked part's full row count, in checkpoint order (shard_id = its index)."""
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size, [group.split(n, "output size") for n in output_sizes], bias=bias, dtype=dtype, device=device,
            quant_method=quant_method, group=group,
        )
        self._tag_shards(list(range(len(output_sizes))))

    def weight_loader(self, param, loaded, shard_id=None):
        """Part shard_id's rows (this rank's share); shard_id None: a pre-fused tensor holding every part."""
        dim = getattr(param, "output_dim", None)
        if dim is None:
            _copy(param.data, loaded)
            return
        if shard_id is None:
            for i, part in enumerate(_split_fused(param, loaded, dim, self.output_partition_sizes, self.group.size)):
                self.weight_loader(param, part, i)
            return
        target = _part(param, dim, self.output_partition_sizes, shard_id)
        _copy(target, _shard_to(target, loaded, dim, self.group.rank, self.group.size))


class QKVParallelLinear(LinearBase):
    """The q, k and v projections stacked into one: [heads * head_dim | kv_heads * head_dim | kv_heads * head_dim].

    With fewer KV heads than ranks, each KV head is replicated on size / kv_heads ranks (vLLM's rule).
    """

    SHARDS = ("q", "k", "v")

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
        bias: bool = False, dtype, device, quant_method=None, group=SINGLE,
    ):
        """Per-rank heads: num_heads / size, and max(1, num_kv_heads / size) KV heads."""
        self.head_dim = head_dim
        self.num_heads = group.split(num_heads, "num_attention_heads")
        if num_kv_heads >= group.size:
            self.num_kv_heads = group.split(num_kv_heads, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if group.size % num_kv_heads:
                raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over {group.size} ranks")
            self.num_kv_heads, self.kv_replicas = 1, group.size // num_kv_heads
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], bias=bias, dtype=dtype, device=device, quant_method=quant_method, group=group)
        self._tag_shards(list(self.SHARDS))

    def weight_loader(self, param, loaded, shard_id=None):
        """Shard "q", "k" or "v" (this rank's heads); None: a pre-fused qkv tensor."""
        dim = getattr(param, "output_dim", None)
        if dim is None:
            _copy(param.data, loaded)
            return
        if shard_id is None:
            q, kv = self.output_partition_sizes[0], self.output_partition_sizes[1]
            kv_full = kv * self.group.size // self.kv_replicas
            full = [q * self.group.size, kv_full, kv_full]
            for name, part in zip(self.SHARDS, _split_exact(param, loaded, dim, self.output_partition_sizes, full)):
                self.weight_loader(param, part, name)
            return
        i = self.SHARDS.index(shard_id)
        rank, parts = self.group.rank, self.group.size
        if i > 0:  # a KV head held by kv_replicas ranks
            rank, parts = rank // self.kv_replicas, parts // self.kv_replicas
        target = _part(param, dim, self.output_partition_sizes, i)
        _copy(target, _shard_to(target, loaded, dim, rank, parts))


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x_r @ W_r.T (+ b): this rank holds a share of W's columns (the input features)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, dtype, device, quant_method=None, group=SINGLE):
        """A row-parallel layer whose input arrives already split (the column-parallel layer's output)."""
        super().__init__(
            group.split(input_size, "input size"), [output_size], bias=bias, dtype=dtype, device=device,
            quant_method=quant_method, group=group,
        )
        self.reduce = group.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The partial product, summed over the group; the bias is added once (rank 0, before the sum), a LoRA
        product on every rank (its partial product over this rank's columns of A)."""
        out = self.quant_method.apply(self, x, self.bias if self.group.rank == 0 else None)
        if self.lora is not None:
            self.lora.add(x, out)
        return self.group.all_reduce(out) if self.reduce else out

    def weight_loader(self, param, loaded, shard_id=None):
        """This rank's columns of the full tensor (a bias is whole)."""
        _copy(param.data, _shard(param, loaded, self.group, getattr(param, "input_dim", None), self.group.rank))


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """target <- source, ValueError when the shapes differ."""
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"shape {tuple(source.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(source)


def _shard(param: nn.Parameter, loaded: torch.Tensor, group: ParallelGroup, dim: int | None, rank: int) -> torch.Tensor:
    """loaded cut to this rank's share along dim (its length is param's along dim); whole when dim is None."""
    if dim is None:
        return loaded
    return _shard_to(param.data, loaded, dim, rank, group.size)


def _shard_to(target: torch.Tensor, loaded: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """The rank-th of `parts` target-sized slices of loaded along dim; ValueError unless loaded holds exactly
    `parts` of them (a checkpoint tensor of the wrong size is never cut to fit)."""
    n = target.shape[dim]
    if loaded.dim() <= dim or loaded.shape[dim] != n * parts:
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {n * parts} along dimension {dim}")
    return loaded if parts == 1 else loaded.narrow(dim, rank * n, n)


def _part(param: nn.Parameter, dim: int, sizes: list[int], index: int) -> torch.Tensor:
    """The slice of param that holds stacked part `index`: the layer counts rows, param's dim may hold them
    packed or grouped, so offsets scale by param.shape[dim] / sum(sizes)."""
    num, den = param.shape[dim], sum(sizes)
    start, length = sum(sizes[:index]) * num, sizes[index] * num
    if start % den or length % den:
        raise ValueError(f"a parameter of {num} rows along dimension {dim} cannot hold parts {sizes}")
    return param.data.narrow(dim, start // den, length // den)


def _split_exact(param, loaded: torch.Tensor, dim: int, sizes: list[int], full_sizes: list[int]) -> list[torch.Tensor]:
    """A fused checkpoint tensor split into its parts (each the full, unsharded part), in param's units."""
    num, den = param.shape[dim], sum(sizes)
    lengths = [n * num // den for n in full_sizes]
    if loaded.dim() <= dim or loaded.shape[dim] != sum(lengths):
        raise ValueError(f"fused shape {tuple(loaded.shape)} does not hold parts of {lengths} along dimension {dim}")
    return list(loaded.split(lengths, dim=dim))


def _split_fused(param, loaded: torch.Tensor, dim: int, sizes: list[int], group_size: int) -> list[torch.Tensor]:
    """A fused tensor split into parts whose full sizes are the per-rank sizes times the group size."""
    return _split_exact(param, loaded, dim, sizes, [n * group_size for n in sizes])
