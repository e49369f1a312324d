"""Multi-LoRA on a decoder's projections: adapters in preallocated slots, and one forward whose rows may each use
another adapter or none (vLLM's design; the rows are grouped per adapter on the host).

`LoraSlots(model, max_loras=, max_lora_rank=)` gives each projection of each decoder layer built from the shared
blocks (the stacked `qkv_proj`, `o_proj`, the stacked `gate_up_proj`, `down_proj`) a `LoraLinear`: slot tensors
A [max_loras, parts * max_lora_rank, in] and B [max_loras, out, parts * max_lora_rank] in the model's dtype, this
rank's shard, zero where an adapter has a smaller rank or does not adapt a part. The parts of a stacked layer
(q, k, v; gate, up) each have an A of their own, so each takes its own block of the rank dimension and its B is
zero off its rows: one pair of products serves every part, and a pre-fused target (Phi-3's qkv_proj) is one part
covering every row.

- `load(slot, adapter)` reads the adapter's tensors and cuts them as the base weights are cut, through the
  layer's own weight loader: a column-parallel layer keeps its rows of B (q/k/v by heads, KV heads replicated as
  the layer replicates them) and A whole; a row-parallel layer keeps its columns of A and B whole, and adds its
  partial product before the all-reduce, which sums to the whole product. The scaling is folded into B.
- `begin_step(token_slots)` / `end_step()` bracket a forward: each token's slot (-1: the base model alone),
  grouped once per step. A step without adapter tokens adds nothing and allocates nothing; one with them sets
  `model.lora_active`, so the forward takes the layers (the native fused decode step has no LoRA).

A quantized layer's product is its method's; the LoRA product is added to it in the model's dtype. Embeddings,
the LM head, experts and Mamba layers are never adapted (lora_adapters.py refuses such adapters).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from metrale.gpu_worker.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from metrale.gpu_worker.layers.parallel import SINGLE, ParallelGroup
from metrale.lora_adapters import AdapterSpec, LoraError, module_of, read_adapter

# Rows of a step that use one adapter: None (every row), a slice (one run of rows) or a device index tensor.
Rows = slice | torch.Tensor | None


@dataclass(slots=True)
class LoraStep:
    """The step's selection, which every LoraLinear of a model reads: (slot, its rows) per adapter present; with
    several adapters, each token's slot one-hot (onehot [T, max_loras]) and, per rank-block width, that one-hot
    widened over each slot's block (masks: what zeroes the other slots' share of a token's product)."""

    groups: list[tuple[int, Rows]] = field(default_factory=list)
    num_tokens: int = 0
    onehot: torch.Tensor | None = None
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, width: int) -> torch.Tensor:
        """[T, max_loras * width]: 1 where a token's column belongs to its own slot's block."""
        m = self.masks.get(width)
        if m is None:
            m = self.masks[width] = self.onehot.repeat_interleave(width, dim=1)
        return m


class LoraLinear:
    """One linear layer's adapter slots, and the products it adds to the layer's output for the step's groups."""

    __slots__ = ("layer", "a", "b", "a_cat", "b_cat", "width", "max_rank", "blocks", "targeted", "step")

    def __init__(self, layer: LinearBase, blocks: dict, step: LoraStep, *, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        """blocks: each part's shard id -> its block of the rank dimension (None: the whole layer as one part)."""
        self.layer = layer
        self.max_rank = max_rank
        self.blocks = blocks
        width = (max(blocks.values()) + 1) * max_rank
        # Every slot's A and B side by side ([L * width, in] and [out, L * width]): a step of several adapters is
        # then two products over all slots, the other slots' columns masked off per token, whatever the mix.
        self.width = width
        self.a_cat = torch.zeros(max_loras * width, layer.input_size_per_partition, dtype=dtype, device=device)
        self.b_cat = torch.zeros(layer.output_size_per_partition, max_loras * width, dtype=dtype, device=device)
        self.a = self.a_cat.view(max_loras, width, -1)  # [L, width, in]
        self.b = self.b_cat.view(-1, max_loras, width).permute(1, 0, 2)  # [L, out, width]
        self.targeted = [False] * max_loras  # a slot whose adapter leaves this layer alone costs it nothing
        self.step = step

    def add(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += (x[rows] @ A.T) @ B.T for each adapter of the step (out: the layer's product, in place)."""
        step = self.step
        if not step.groups:
            return
        if x.dim() != 2:
            x, out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if x.shape[0] != step.num_tokens:
            raise RuntimeError(f"LoRA step selected {step.num_tokens} tokens, the layer got {x.shape[0]} (padded decode graphs?)")
        if step.onehot is not None:  # several adapters (or one over scattered rows): two products, masked
            if any(self.targeted[slot] for slot, _ in step.groups):
                h = torch.mm(x, self.a_cat.t()).mul_(step.mask(self.width))
                out.addmm_(h, self.b_cat.t())
            return
        for slot, rows in step.groups:
            if not self.targeted[slot]:
                continue
            a, b = self.a[slot].t(), self.b[slot].t()
            if rows is None:
                out.addmm_(torch.mm(x, a), b)
            elif isinstance(rows, slice):
                out[rows].addmm_(torch.mm(x[rows], a), b)
            else:
                out.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a), b))

    def load(self, slot: int, part, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put one part's full A [r, in] and scaled B [out, r] into slot, cut to this rank's shard; ValueError
        for a shape the layer does not have."""
        layer, r = self.layer, a.shape[0]
        if r > self.max_rank or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"A {tuple(a.shape)} and B {tuple(b.shape)} are not a LoRA pair of rank <= {self.max_rank}")
        if isinstance(layer, RowParallelLinear):  # this rank's input columns of A; B whole
            a_part = _staged(self.a, (r, layer.input_size_per_partition), input_dim=1)
            layer.weight_loader(a_part, a)
            if tuple(b.shape) != (layer.output_size_per_partition, r):
                raise ValueError(f"B shape {tuple(b.shape)}, expected {(layer.output_size_per_partition, r)}")
            b_part = b
        else:  # this rank's output rows of B (the part's, by the layer's own split); A whole
            if tuple(a.shape) != (r, layer.input_size_per_partition):
                raise ValueError(f"A shape {tuple(a.shape)}, expected {(r, layer.input_size_per_partition)}")
            a_part = a
            b_part = _staged(self.b, (layer.output_size_per_partition, r), output_dim=0)
            layer.weight_loader(b_part, b, part)
        start = self.blocks[part] * self.max_rank
        with torch.no_grad():
            self.a[slot, start : start + r].copy_(a_part)
            self.b[slot, :, start : start + r].copy_(b_part)
        self.targeted[slot] = True

    def unload(self, slot: int) -> None:
        """Zero slot."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.targeted[slot] = False


class LoraSlots:
    """max_loras adapter slots over a loaded DecoderLM's projections, and each step's choice of adapter per token."""

    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int, group: ParallelGroup = SINGLE):
        """Allocate every projection's slots and attach them to the layers (their forward adds the products).

        group: the model's tensor-parallel group (the layers shard with their own; ValueError if it differs).
        """
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras {max_loras} and max_lora_rank {max_lora_rank} must be at least 1")
        model_group = model.ctx.group
        if (group.rank, group.size) != (model_group.rank, model_group.size):
            raise ValueError(f"LoRA slots for rank {group.rank} of {group.size} on a model of rank {model_group.rank} of {model_group.size}")
        self.model = model
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.adapters: list[AdapterSpec | None] = [None] * max_loras
        self.step = LoraStep()
        self.active = False  # the step selected adapter tokens
        self._device, self._dtype = model.ctx.device, model.dtype
        self._targets: dict[str, tuple[LoraLinear, object]] = {}  # PEFT module name -> (its layer's slots, part)
        self._linears: list[LoraLinear] = []
        for layer, names in _projections(model):
            if layer.lora is not None:
                raise ValueError(f"{next(iter(names))}: the model already has LoRA slots attached")
            parts = [p for p in names.values() if p is not None]
            blocks = {None: 0} | {p: i for i, p in enumerate(parts)}  # None: a pre-fused target, over every row
            lora = LoraLinear(layer, blocks, self.step, max_loras=max_loras, max_rank=max_lora_rank,
                              dtype=model.dtype, device=self._device)
            layer.lora = lora
            self._linears.append(lora)
            self._targets.update({name: (lora, part) for name, part in names.items()})
        if not self._linears:
            raise LoraError(f"{model.architecture}: no decoder projection LoRA can adapt")

    def load(self, slot: int, adapter: AdapterSpec | str | os.PathLike) -> AdapterSpec:
        """Load an adapter (a folder or its spec) into slot, replacing what it held; LoraError naming the tensor for
        one this model has no projection for or whose shape is not the base model's (the slot is then left empty)."""
        self.unload(slot)
        spec = adapter if isinstance(adapter, AdapterSpec) else read_adapter(adapter)
        if spec.rank > self.max_lora_rank:
            raise LoraError(f"LoRA adapter {spec.path}: rank {spec.rank} exceeds max_lora_rank {self.max_lora_rank}")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in load_file(str(spec.weights_file)).items():
            module, which = module_of(name)
            pairs.setdefault(module, {})[which] = tensor
        for module, pair in pairs.items():
            if module not in self._targets:
                raise LoraError(f"LoRA adapter {spec.path}: {module!r} is not a projection this "
                                f"{self.model.architecture} model can adapt (another model's adapter, or an expert or Mamba layer)")
            if len(pair) != 2:
                raise LoraError(f"LoRA adapter {spec.path}: {module!r} lacks lora_A or lora_B")
        for module, pair in pairs.items():
            lora, part = self._targets[module]
            try:
                lora.load(slot, part, pair["A"], pair["B"].float() * spec.scaling)
            except ValueError as e:
                self.unload(slot)
                raise LoraError(f"LoRA adapter {spec.path}: {module}: {e}") from None
        self.adapters[slot] = spec
        return spec

    def unload(self, slot: int) -> None:
        """Empty slot (its tensors zeroed)."""
        self._check_slot(slot)
        for lora in self._linears:
            lora.unload(slot)
        self.adapters[slot] = None

    def begin_step(self, token_slots: np.ndarray) -> None:
        """Choose each token's adapter for the next forward: token_slots int [T], a slot or -1 (the base model).

        Grouped here once for every layer: a slot's tokens as one slice when they are one run (a row, or a whole
        step of one adapter), else as an index on the device. LoraError for a slot holding no adapter.
        """
        slots = np.asarray(token_slots)
        if len(slots) == 0 or int(slots.max()) < 0:
            self.end_step()
            return
        present = np.unique(slots)
        if int(present[0]) < -1 or int(present[-1]) >= self.max_loras:
            raise LoraError(f"token slots {present.tolist()} outside -1..{self.max_loras - 1}")
        groups: list[tuple[int, Rows]] = []
        for slot in present[present >= 0].tolist():
            if self.adapters[slot] is None:
                raise LoraError(f"LoRA slot {slot} holds no adapter")
            idx = np.flatnonzero(slots == slot)
            if len(idx) == len(slots):
                rows: Rows = None
            elif int(idx[-1]) - int(idx[0]) + 1 == len(idx):
                rows = slice(int(idx[0]), int(idx[-1]) + 1)
            else:
                rows = torch.from_numpy(idx).to(self._device)
            groups.append((slot, rows))
        self.step.groups, self.step.num_tokens = groups, len(slots)
        self.step.masks = {}
        self.step.onehot = None
        if len(groups) > 1 or isinstance(groups[0][1], torch.Tensor):
            onehot = np.zeros((len(slots), self.max_loras), dtype=np.float32)
            adapted = np.flatnonzero(slots >= 0)
            onehot[adapted, slots[adapted]] = 1.0
            self.step.onehot = torch.from_numpy(onehot).to(device=self._device, dtype=self._dtype)
        if not self.active:
            self.active = self.model.lora_active = True

    def end_step(self) -> None:
        """Back to the base model for every token (what a forward without begin_step runs)."""
        if self.step.groups:
            self.step.groups, self.step.num_tokens = [], 0
            self.step.onehot, self.step.masks = None, {}
        if self.active:
            self.active = self.model.lora_active = False

    def detach(self) -> None:
        """Take the slots off the model's layers (the model is then as loaded)."""
        self.end_step()
        for lora in self._linears:
            lora.layer.lora = None

    def _check_slot(self, slot: int) -> None:
        """ValueError for a slot outside 0..max_loras - 1."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} outside 0..{self.max_loras - 1}")


def _projections(model: nn.Module) -> list[tuple[LinearBase, dict[str, object]]]:
    """Each projection LoRA can adapt, with the PEFT module names that load into it and the part (the weight
    loader's shard id; None: the whole layer) each names. A decoder layer's child with a stacked qkv_proj and an
    o_proj is an attention block, one with a stacked gate_up_proj and a down_proj a gated MLP; anything else (experts,
    Mamba mixers) has none."""
    found = []
    for i, layer in enumerate(model.model.layers):
        for child_name, child in layer.named_children():
            prefix = f"model.layers.{i}.{child_name}"
            qkv, o = getattr(child, "qkv_proj", None), getattr(child, "o_proj", None)
            if isinstance(qkv, QKVParallelLinear) and isinstance(o, RowParallelLinear):
                found.append((qkv, {f"{prefix}.q_proj": "q", f"{prefix}.k_proj": "k", f"{prefix}.v_proj": "v",
                                    f"{prefix}.qkv_proj": None}))
                found.append((o, {f"{prefix}.o_proj": None}))
            gate_up, down = getattr(child, "gate_up_proj", None), getattr(child, "down_proj", None)
            if isinstance(gate_up, MergedColumnParallelLinear) and isinstance(down, RowParallelLinear):
                found.append((gate_up, {f"{prefix}.gate_proj": 0, f"{prefix}.up_proj": 1, f"{prefix}.gate_up_proj": None}))
                found.append((down, {f"{prefix}.down_proj": None}))
    return found


def _staged(like: torch.Tensor, shape: tuple[int, int], **dims) -> torch.Tensor:
    """A zero tensor a layer's weight loader can fill as if it were a weight (output_dim / input_dim tagged)."""
    t = torch.zeros(shape, dtype=like.dtype, device=like.device)
    for name in ("output_dim", "input_dim"):
        setattr(t, name, dims.get(name))
    return t
