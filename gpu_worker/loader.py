"""Build the model a checkpoint's facts name (models/registry.py) and fill it from its safetensors or its GGUF file
(gguf_weights.py). Never touches a hub."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from metrale import gguf_metadata
from metrale.settings import DTYPE_ALIASES
from metrale.gpu_worker.gguf_weights import gguf_blocks, gguf_layer_kinds, gguf_tensors, mapped, release_pages
from metrale.gpu_worker.layers.attention_backends import TORCH, TorchAttention
from metrale.gpu_worker.layers.gguf_embedding import GgufEmbedding
from metrale.gpu_worker.layers.gguf_linear import GgufLinearMethod, load_tied_head
from metrale.gpu_worker.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from metrale.gpu_worker.layers.linear_method import DenseLinearMethod
from metrale.gpu_worker.layers.parallel import SINGLE, ParallelGroup
from metrale.gpu_worker.layers.quantization import Int4LinearMethod, linear_methods, quantize_tied_head
from metrale.gpu_worker.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from metrale.gpu_worker.models.context import ModelContext
from metrale.gpu_worker.models.decoder import default_weight_loader
from metrale.gpu_worker.models.registry import model_class
from metrale.model_facts import ModelFacts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: dict) -> torch.dtype:
    """The torch dtype for "auto" (the config's dtype) or a dtype name (vLLM's "half" and "float" too)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def weight_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors files: those the index names, else every *.safetensors."""
    root = pathlib.Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def load_model(
    facts: ModelFacts,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    native: bool = False,
    attention: TorchAttention = TORCH,
    show_progress: bool = True,
    quantization: str | None = None,
    group: ParallelGroup = SINGLE,
):
    """The model for facts (its architecture's class from the registry), loaded and ready to run.

    native: the native CPU kernels are loaded; attention: the device's attention backend; quantization: the
    linear layers' methods (layers/quantization.py: None follows the checkpoint, a GGUF's Q8_0 and 4-bit layers
    staying quantized); group: this process's tensor-parallel group (its layers hold this rank's shards, cut from
    the checkpoint's full tensors). ModelError for an architecture no model here implements (before anything is
    read); ValueError for a checkpoint that does not fit the model.
    """
    cls = model_class(facts.architecture)
    gguf = gguf_metadata.gguf_file(facts.path)
    layer_of = _layer_of(cls)
    kinds = gguf_layer_kinds(gguf, layer_of) if gguf is not None else None
    methods = linear_methods(quantization, kinds.get if kinds is not None else None)
    ctx = ModelContext(
        facts=facts, dtype=resolve_dtype(dtype, facts.config), device=torch.device(device), native=native,
        attention=attention, quant=methods, group=group,
    )
    model = cls(ctx)
    if gguf is not None:
        codes = {n for n, m in model.named_modules() if getattr(getattr(m, "quant_method", None), "codes", False)}
        linear = {n for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), GgufLinearMethod)}
        blocks = set(linear)
        if _embeds_in_place(model, quantization, kinds, ctx):
            embed = model.model.embed_tokens
            model.model.embed_tokens = GgufEmbedding(embed.vocab_size, embed.weight.shape[1], dtype=ctx.dtype)
            blocks.add("model.embed_tokens")
        stream = gguf_tensors(gguf, facts.config, lambda name: layer_of(name) in codes, lambda name: layer_of(name) in blocks,
                              lambda name: layer_of(name) in linear)
        model.load_weights(_in_place(model, stream, gguf, group))
    else:
        model.load_weights(_tensors(weight_files(facts.path), show_progress))
    if model.lm_head.shares_weight:
        # A tied head is dense by construction; give it its own copy of the table as the checkpoint's
        # embedding is stored (a GGUF's Q6_K or Q8_0 token_embd, its blocks) or as --quantization asks.
        embed_kinds = {"lm_head": (kinds or {}).get("model.embed_tokens")}
        head = linear_methods(quantization, embed_kinds.get)("lm_head")
        embed = model.model.embed_tokens
        if isinstance(head, GgufLinearMethod):
            raw = embed.blocks() if isinstance(embed, GgufEmbedding) else gguf_blocks(gguf, "model.embed_tokens.weight")
            load_tied_head(model.lm_head, raw, head, ctx.dtype)
        elif not isinstance(head, DenseLinearMethod):
            if isinstance(head, Int4LinearMethod):
                head.codes = False  # the table was loaded as floats
            quantize_tied_head(model.lm_head, embed.weight, head)
    if gguf is not None:
        release_pages(gguf)
    return model


def _embeds_in_place(model, quantization: str | None, kinds: dict | None, ctx: ModelContext) -> bool:
    """True when the GGUF's token embedding is read in place (layers/gguf_embedding.py): its type has a table row,
    the layers follow the file (quantization None), one rank on a CPU, and the model's embedding is the plain one."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return (
        quantization is None and kinds is not None and kinds.get("model.embed_tokens") is not None
        and ctx.group.size == 1 and ctx.device.type == "cpu" and type(embed) is VocabParallelEmbedding
    )


# The loaders that copy a whole unsharded tensor into a parameter of its shape with one copy_ (which torch skips
# when source and target are the same memory): a parameter they fill may be the file's pages themselves.
_WHOLE_COPY = (default_weight_loader, VocabParallelEmbedding.weight_loader, ParallelLMHead.weight_loader, LinearBase.weight_loader,
               ColumnParallelLinear.weight_loader, RowParallelLinear.weight_loader)


def _in_place(model, weights: Iterator[tuple[str, torch.Tensor]], gguf, group: ParallelGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF stream, with every parameter that can take its tensor as stored made a view of the file's map
    (on a CPU, same dtype and shape, a whole-tensor loader, one rank): its loader's copy then copies nothing."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        target = model.checkpoint_target(name) if group.size == 1 else None
        param = params.get(target[0]) if target is not None and target[1] is None else None
        loader = getattr(param, "weight_loader", default_weight_loader)
        if (
            param is not None and param.device.type == "cpu" and getattr(loader, "__func__", loader) in _WHOLE_COPY
            and not getattr(param, "shard_ids", None)
            and param.dtype == tensor.dtype and param.shape == tensor.shape and tensor.is_contiguous() and mapped(tensor, gguf)
        ):
            param.data = tensor
        yield name, tensor


def _layer_of(cls) -> Callable[[str], str]:
    """A checkpoint tensor name -> the prefix of the layer it loads into (q/k/v_proj -> qkv_proj, ...)."""

    def layer_of(name: str) -> str:
        for param_suffix, ckpt_suffix, _ in cls.stacked_params:
            if ckpt_suffix in name:
                name = name.replace(ckpt_suffix, param_suffix)
                break
        return name.rsplit(".", 1)[0]

    return layer_of


def _tensors(files: list[pathlib.Path], show_progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the files, one at a time."""
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not show_progress, leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)
