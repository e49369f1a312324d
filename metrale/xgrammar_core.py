"""xgrammar's native core without its Python package: grammars compiled and matched with numpy, no torch.

`import xgrammar` imports torch (its matcher module allocates torch bitmasks at import) and transformers (its
tokenizer module), and tvm_ffi, the binding layer beneath it, tries torch first. The engine core must not import
torch, and the frontend has no use for either. The native objects themselves (TokenizerInfo, GrammarCompiler,
GrammarMatcher, CompiledGrammar) take any DLPack array for a bitmask, numpy's included. So this module loads
xgrammar's native binding (`xgrammar.tvm_ffi_binding._ffi_api`) under its own package name without running the
package's `__init__` (torch hidden while tvm_ffi loads, unless it is already imported), and calls the native
objects as xgrammar's own Python wrappers call them. That is private API, so the version is pinned
(pyproject.toml) and checked here. A later plain `import xgrammar` in the same process still works: the package
finishes initialising itself on its first attribute lookup.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
import sys
import threading
from types import ModuleType

import numpy as np

XGRAMMAR_VERSION = "0.2.9"  # the wrappers' calls below are this version's
VOCAB_RAW, VOCAB_BYTE_FALLBACK, VOCAB_BYTE_LEVEL = 0, 1, 2  # xgrammar's VocabType

_lock = threading.Lock()
_core: ModuleType | None = None


class GrammarError(ValueError):
    """A grammar, schema or regex xgrammar cannot compile (the message is xgrammar's)."""


def core() -> ModuleType:
    """xgrammar's native API module (GrammarCompiler, GrammarMatcher, ...), loaded once per process."""
    global _core
    with _lock:
        if _core is None:
            _core = _load()
        return _core


def _load() -> ModuleType:
    """Import the native binding without xgrammar/__init__.py (see the module docstring)."""
    version = importlib.metadata.version("xgrammar")
    if version != XGRAMMAR_VERSION:
        raise ImportError(f"metrale needs xgrammar=={XGRAMMAR_VERSION} (found {version}): pip install "
                          f"--no-deps xgrammar=={XGRAMMAR_VERSION}")
    package = sys.modules.get("xgrammar")
    if package is not None and hasattr(package, "GrammarCompiler"):  # the full package is loaded already
        return importlib.import_module("xgrammar.tvm_ffi_binding._ffi_api")
    if package is None:
        spec = importlib.util.find_spec("xgrammar")
        package = importlib.util.module_from_spec(spec)
        package.__getattr__ = _finish_initialising(package, spec)  # a later `import xgrammar` gets it whole
        sys.modules["xgrammar"] = package
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # tvm_ffi's optional `import torch` then finds none
    try:
        importlib.import_module("xgrammar.load_binding")  # loads the shared library
        return importlib.import_module("xgrammar.tvm_ffi_binding._ffi_api")
    finally:
        if hide_torch:
            del sys.modules["torch"]


def _finish_initialising(package: ModuleType, spec):
    """A module __getattr__ that runs xgrammar's own __init__ the first time a missing attribute is asked for."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        del package.__getattr__
        spec.loader.exec_module(package)
        return getattr(package, name)

    return __getattr__


# ---- the vocabulary as xgrammar sees it -------------------------------------------------------


def detect_vocab_type(tokenizer_json: str) -> tuple[int, bool]:
    """(vocab_type, add_prefix_space) of a Hugging Face tokenizer.json, as xgrammar detects them."""
    meta = json.loads(core().TokenizerInfo._detect_metadata_from_hf(tokenizer_json))
    return int(meta["vocab_type"]), bool(meta["add_prefix_space"])


def tokenizer_info(encoded_vocab: list[str], vocab_type: int, vocab_size: int, stop_token_ids: list[int],
                   add_prefix_space: bool):
    """A native TokenizerInfo; the vocabulary is padded (or cut) to the model's vocab_size (its logits' width)."""
    vocab = list(encoded_vocab[:vocab_size]) + [""] * max(0, vocab_size - len(encoded_vocab))
    return core().TokenizerInfo(vocab, vocab_type, vocab_size, list(stop_token_ids) or None, add_prefix_space)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return -(-vocab_size // 32)


# ---- compiling ----------------------------------------------------------------------------------


def compiler(info):
    """A native GrammarCompiler (one thread: the box is small and compiles are short), without its cache."""
    return core().GrammarCompiler(info, 1, False, -1, False)


def compile_spec(comp, kind: str, spec: str):
    """Compile one grammar: kind is json (a schema's text), json_object, regex, choice (a JSON list) or grammar
    (EBNF). GrammarError when xgrammar refuses it."""
    try:
        if kind == "json":
            # Compact separators, no free whitespace: a small model cannot pad forever.
            return comp.compile_json_schema(spec, False, None, None, True, None, False)
        if kind == "json_object":
            return comp.compile_json_schema('{"type": "object"}', False, None, None, False, None, False)
        if kind == "regex":
            return comp.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return comp.compile_grammar_from_strings("root ::= " + " | ".join(_ebnf_literal(c) for c in choices), "root")
        if kind == "grammar":
            return comp.compile_grammar_from_strings(spec, "root")
    except RuntimeError as exc:  # xgrammar's errors (tvm_ffi raises them as RuntimeError or its subclasses)
        raise GrammarError(_first_line(str(exc))) from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


def _ebnf_literal(text: str) -> str:
    """An EBNF string literal for text (xgrammar reads JSON-style escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(message: str) -> str:
    """xgrammar's message without the C++ location prefix, its check's condition and the traceback."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else message
    line = line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", line)


def serialize(compiled) -> str:
    """A compiled grammar as xgrammar's JSON (the tokenizer's vocabulary not included)."""
    return str(compiled.serialize_json())


def deserialize(data: str, info):
    """A compiled grammar back from serialize(); GrammarError when it was made for another vocabulary."""
    try:
        return core().CompiledGrammar.deserialize_json(data, info)
    except RuntimeError as exc:
        raise GrammarError(_first_line(str(exc))) from None


# ---- matching -----------------------------------------------------------------------------------


def matcher(compiled):
    """A native GrammarMatcher at the grammar's start (stop tokens: the tokenizer info's)."""
    return core().GrammarMatcher(compiled, None, False, -1, None)


def fill_bitmask(m, out: np.ndarray, row: int) -> bool:
    """Write the matcher's next-token bitmask into out[row] (int32 [G, W], C-contiguous); False when every token
    is allowed."""
    return bool(m.fill_next_token_bitmask(out, row, False))
