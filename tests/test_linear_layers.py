"""The linear-layer seam: weight loaders that load fused and split checkpoints alike and keep only this rank's
shard, a pluggable linear method, and the registry's one clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod, LinearMethod, set_weight_attrs
from metrale.gpu_worker.layers.parallel import ParallelGroup
from metrale.gpu_worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from metrale.gpu_worker.models import SUPPORTED_ARCHITECTURES, model_class
from metrale.model_facts import ModelError

CPU = dict(dtype=torch.float32, device=torch.device("cpu"))
G = torch.Generator().manual_seed(5)


def _rand(*shape):
    return torch.randn(*shape, generator=G)


def _load(layer, name, tensor, shard=None):
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard)


def test_qkv_loads_split_and_fused_checkpoints_into_the_same_weight():
    q, k, v = _rand(8 * 4, 16), _rand(2 * 4, 16), _rand(2 * 4, 16)
    split = QKVParallelLinear(16, 4, 8, 2, **CPU)
    for name, w in zip("qkv", (q, k, v)):
        _load(split, "weight", w, name)
    fused = QKVParallelLinear(16, 4, 8, 2, **CPU)
    _load(fused, "weight", torch.cat((q, k, v)))
    assert torch.equal(split.weight, torch.cat((q, k, v)))
    assert torch.equal(fused.weight, split.weight)


def test_merged_column_loads_gate_up_parts_or_the_fused_tensor():
    gate, up = _rand(12, 8), _rand(12, 8)
    split = MergedColumnParallelLinear(8, [12, 12], **CPU)
    _load(split, "weight", up, 1)
    _load(split, "weight", gate, 0)
    fused = MergedColumnParallelLinear(8, [12, 12], **CPU)
    _load(fused, "weight", torch.cat((gate, up)))
    assert torch.equal(split.weight, torch.cat((gate, up)))
    assert torch.equal(fused.weight, split.weight)


def test_a_checkpoint_tensor_of_the_wrong_size_is_refused_not_cut():
    layer = MergedColumnParallelLinear(8, [12, 12], **CPU)
    with pytest.raises(ValueError, match="expected 12"):
        _load(layer, "weight", _rand(13, 8), 0)
    with pytest.raises(ValueError, match="fused"):
        _load(layer, "weight", _rand(25, 8))


def test_loaders_keep_rank_ones_shard_in_a_group_of_two():
    rank1 = ParallelGroup(rank=1, size=2)
    w, b = _rand(10, 6), _rand(10)
    col = ColumnParallelLinear(6, 10, bias=True, group=rank1, **CPU)
    _load(col, "weight", w)
    _load(col, "bias", b)
    assert torch.equal(col.weight, w[5:]) and torch.equal(col.bias, b[5:])

    row = RowParallelLinear(6, 10, bias=True, group=rank1, **CPU)
    _load(row, "weight", w)
    _load(row, "bias", b)
    assert torch.equal(row.weight, w[:, 3:]) and torch.equal(row.bias, b)  # the bias is whole (added once)

    gate, up = _rand(8, 6), _rand(8, 6)
    merged = MergedColumnParallelLinear(6, [8, 8], group=rank1, **CPU)
    _load(merged, "weight", torch.cat((gate, up)))
    assert torch.equal(merged.weight, torch.cat((gate[4:], up[4:])))

    # 4 heads of 2 dims, 1 KV head replicated on both ranks.
    q, k, v = _rand(8, 6), _rand(2, 6), _rand(2, 6)
    qkv = QKVParallelLinear(6, 2, 4, 1, group=rank1, **CPU)
    for name, t in zip("qkv", (q, k, v)):
        _load(qkv, "weight", t, name)
    assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
    assert torch.equal(qkv.weight, torch.cat((q[4:], k, v)))

    table = _rand(7, 3)
    embed = VocabParallelEmbedding(7, 3, group=rank1, **CPU)
    _load(embed, "weight", table)
    assert torch.equal(embed.weight[:3], table[4:]) and not embed.weight[3:].any()  # padded to 4 rows a rank
    head = ParallelLMHead(7, 3, group=rank1, **CPU)
    _load(head, "weight", table)
    assert torch.equal(head.weight[:3], table[4:])


def test_a_group_of_one_is_the_plain_product():
    w, b, x = _rand(10, 6), _rand(10), _rand(3, 6)
    row = RowParallelLinear(6, 10, bias=True, **CPU)
    _load(row, "weight", w)
    _load(row, "bias", b)
    row.process_weights_after_loading()
    assert torch.allclose(row(x), F.linear(x, w, b), atol=1e-5)
    ids = torch.tensor([0, 6, 3])
    embed = VocabParallelEmbedding(7, 3, **CPU)
    table = _rand(7, 3)
    _load(embed, "weight", table)
    assert torch.equal(embed(ids), table[ids])


class _ScaledInt8(LinearMethod):
    """A toy method through the same seam: int8 rows with one float scale per row."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, *, dtype, device, weight_loader):
        rows = sum(output_partition_sizes)
        qweight = torch.nn.Parameter(torch.zeros(rows, input_size_per_partition, dtype=torch.int8, device=device), requires_grad=False)
        scale = torch.nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False)
        set_weight_attrs(qweight, output_dim=0, input_dim=1, weight_loader=weight_loader)
        set_weight_attrs(scale, output_dim=0, input_dim=None, weight_loader=weight_loader)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("scale", scale)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.qweight.to(x.dtype) * layer.scale[:, None], bias)


def test_another_linear_method_loads_split_parts_through_the_same_loader():
    q8 = [torch.randint(-100, 100, (n, 6), dtype=torch.int8, generator=G) for n in (8, 4, 4)]
    scales = [torch.rand(n, generator=G) for n in (8, 4, 4)]
    layer = QKVParallelLinear(6, 2, 4, 2, quant_method=_ScaledInt8(), **CPU)
    for name, w, s in zip("qkv", q8, scales):
        _load(layer, "qweight", w, name)
        _load(layer, "scale", s, name)
    x = _rand(3, 6)
    want = F.linear(x, torch.cat(q8).float() * torch.cat(scales)[:, None])
    assert torch.allclose(layer(x), want, atol=1e-4)


def test_the_dense_method_packs_and_matches_f_linear():
    layer = ColumnParallelLinear(16, 24, bias=True, **CPU)
    w, b, x = _rand(24, 16), _rand(24), _rand(5, 16)
    _load(layer, "weight", w)
    _load(layer, "bias", b)
    layer.process_weights_after_loading()
    assert isinstance(layer.quant_method, DenseLinearMethod)
    assert torch.allclose(layer(x), F.linear(x, w, b), atol=1e-4)


def test_an_unknown_architecture_is_one_error_listing_the_supported_ones():
    with pytest.raises(ModelError) as err:
        model_class("GPT2LMHeadModel")
    message = str(err.value)
    assert "GPT2LMHeadModel" in message and all(a in message for a in SUPPORTED_ARCHITECTURES)
    assert isinstance(err.value, ValueError) and "\n" not in message
