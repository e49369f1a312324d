"""How a model turns its hidden states into one embedding: read from its sentence-transformers files.

A sentence-transformers folder lists its modules in `modules.json`: the transformer, a Pooling module (its
`config.json` names the mode: the current `pooling_mode` field, or the older `pooling_mode_*_tokens` flags) and
maybe a Normalize module. A plain decoder checkpoint has none of them and pools as vLLM pools one: its last
token, normalised. A pipeline metrale cannot reproduce (a Dense projection, max pooling) is named in `unsupported`,
so generation still serves and only an embeddings request is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' pooling modes -> metrale's (ipc/plan.py POOL_KINDS)
_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_OLD_FLAGS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
              "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """The model's pooling: "last", "mean" or "cls"; whether the vector is L2-normalised; whether it was trained
    to be truncated (Matryoshka: a request's `dimensions`); and what makes embeddings unavailable ("" when none)."""

    kind: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    unsupported: str = ""


def read_pooling(model_dir: str | Path, config: dict) -> PoolingConfig:
    """The pooling of the model in model_dir (config: its config.json)."""
    root = Path(model_dir)
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    modules_file = root / "modules.json"
    if not root.is_dir() or not modules_file.is_file():
        return PoolingConfig(matryoshka=matryoshka)
    try:
        modules = json.loads(modules_file.read_text())
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        pooling = next((m for m, k in zip(modules, kinds) if k == "Pooling"), None)
        mode = "lasttoken"
        if pooling is not None:
            pooling_config = json.loads((root / pooling.get("path", "") / "config.json").read_text())
            mode = _mode(pooling_config)
    except (OSError, ValueError, AttributeError, TypeError) as e:
        return PoolingConfig(matryoshka=matryoshka, unsupported=f"its sentence-transformers files cannot be read ({e})")
    others = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    unsupported = ""
    if mode not in _MODES:
        unsupported = f"its sentence-transformers pooling mode {mode!r} (metrale pools lasttoken, mean or cls)"
    elif others:
        unsupported = f"its sentence-transformers modules {', '.join(others)} (metrale runs Pooling and Normalize)"
    return PoolingConfig(_MODES.get(mode, "last"), "Normalize" in kinds, matryoshka, unsupported)


def _mode(pooling_config: dict) -> str:
    """The one pooling mode of a Pooling module's config (both formats); a combination is named as such."""
    mode = pooling_config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _OLD_FLAGS.items() if pooling_config.get(flag)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    return modes[0] if len(modes) == 1 else "+".join(modes) or "none"
