"""Tokenizer: a Hugging Face model folder's tokenizer.json + tokenizer_config.json, or a GGUF file's tokenizer
metadata (frontend/gguf_tokenizer.py), without transformers.

Encoding gives the ids transformers' AutoTokenizer (5.x) gives for the same folder: the `tokenizers` pipeline of
tokenizer.json, post-processor included; like transformers 5, `add_bos_token` / `add_eos_token` in
tokenizer_config.json do not override tokenizer.json when it exists. A GGUF file's tokenizer gives the ids
llama.cpp gives for that file. Decoding never applies `clean_up_tokenization_spaces`, so the text of a sequence
is the concatenation of the texts of its parts (the incremental detokenizer relies on that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as _HfTokenizer

from metrale import gguf_metadata

if TYPE_CHECKING:
    from metrale.frontend.gguf_tokenizer import GgufTokenizer

# Token strings a model may use to mark reasoning, tool calls and code; looked up by the engine's row masks.
_NAMED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "```")


UNDECODED = False  # token_texts' entry for an id not decoded yet (None: decoded, not whole characters)


@dataclass(slots=True)
class Tokenizer:
    """Text ↔ token ids for one model folder, plus the facts about special tokens the server needs."""

    backend: _HfTokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    special_token_ids: frozenset[int] = frozenset()
    chat_template: str | None = None
    model_max_length: int | None = None
    _lookups: dict[str, int | None] = field(default_factory=dict)
    _texts: dict[bool, list[str | None | bool]] = field(default_factory=dict)  # token_texts, by skip_special_tokens

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json and the configs beside it, or a GGUF's tokenizer when model_dir names one
        (metrale.gguf_metadata.gguf_file); FileNotFoundError when there is no tokenizer.json."""
        gguf = gguf_metadata.gguf_file(model_dir)
        if gguf is not None:
            return cls.from_gguf(gguf)
        root = Path(model_dir)
        backend = _HfTokenizer.from_file(str(root / "tokenizer.json"))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        model_cfg = _read_json(root / "config.json")
        gen_cfg = _read_json(root / "generation_config.json")

        def lookup(name: str) -> int | None:
            """The id of the special token tokenizer_config.json names `name`, or None."""
            content = _token_content(tok_cfg.get(name))
            return None if content is None else backend.token_to_id(content)

        bos, eos = lookup("bos_token"), lookup("eos_token")
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        return cls(
            backend=backend,
            bos_token_id=bos if bos is not None else _first_id(model_cfg.get("bos_token_id")),
            eos_token_ids=_eos_ids(gen_cfg, model_cfg, eos),
            pad_token_id=lookup("pad_token"),
            unk_token_id=lookup("unk_token"),
            special_token_ids=special,
            chat_template=_chat_template(root, tok_cfg),
            model_max_length=_max_length(tok_cfg),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer, special tokens and chat template stored in a GGUF file; GgufError when it has none."""
        from metrale.frontend.gguf_tokenizer import tokenizer_from_gguf

        return cls.from_gguf_tokenizer(tokenizer_from_gguf(gguf_metadata.open_gguf(path), str(path)))

    @classmethod
    def from_gguf_tokenizer(cls, built: GgufTokenizer) -> Tokenizer:
        """A Tokenizer over what frontend.gguf_tokenizer rebuilt (a GgufTokenizer)."""
        backend = built.backend
        return cls(
            backend=backend,
            bos_token_id=built.bos_token_id,
            eos_token_ids=built.eos_token_ids,
            pad_token_id=built.pad_token_id,
            unk_token_id=built.unk_token_id,
            special_token_ids=frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special),
            chat_template=built.chat_template,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, the BOS/EOS the model's post-processor adds."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode() on the tokenizer's own threads, so an event loop keeps running meanwhile."""
        encoding = await self.backend.async_encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids

    async def char_starts(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Where each token of encode(text) starts in text, in characters, on the tokenizer's own threads: a token
        holding some bytes of a character where that character starts, an added special token (BOS) where it is
        added (0)."""
        encoding = await self.backend.async_encode(text, add_special_tokens=add_special_tokens)
        return [start for start, _ in encoding.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence decodes to U+FFFD."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, skip_special_tokens: bool = True) -> list[str | None | bool]:
        """Each id's text decoded alone, by id, filled as ids are met (token_text): UNDECODED until then, None where
        that text is not whole characters (it has U+FFFD: a byte of a split character, or a broken one). One table
        per tokenizer, shared by every request's detokenizer: over a byte-level decoder, an id's text after whole
        characters is its entry here. Filled lazily: a whole vocabulary decoded at once takes a noticeable while
        and memory for ids a server may never emit."""
        texts = self._texts.get(skip_special_tokens)
        if texts is None:
            texts = self._texts[skip_special_tokens] = [UNDECODED] * self.vocab_size
        return texts

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str | None:
        """token_texts()[token_id], decoded now if it was not (token_id within the vocabulary)."""
        texts = self.token_texts(skip_special_tokens)
        text = texts[token_id]
        if text is UNDECODED:
            alone = self.backend.decode([token_id], skip_special_tokens=skip_special_tokens)
            text = texts[token_id] = None if "\ufffd" in alone else alone
        return text

    def token_id(self, token: str) -> int | None:
        """The id of the single token spelled `token` (e.g. "</think>"), or None when it is not one token."""
        if token not in self._lookups:
            self._lookups[token] = self._single_token_id(token)
        return self._lookups[token]

    def named_token_ids(self) -> dict[str, int]:
        """The reasoning / tool-call / code-fence tokens this vocabulary has, by spelling."""
        found = {name: self.token_id(name) for name in _NAMED_TOKENS}
        return {name: i for name, i in found.items() if i is not None}

    def _single_token_id(self, token: str) -> int | None:
        """token_to_id, or the encoding of `token` when that is exactly one id (a merged BPE token)."""
        direct = self.backend.token_to_id(token)
        if direct is not None:
            return direct
        ids = self.backend.encode(token, add_special_tokens=False).ids
        return ids[0] if len(ids) == 1 and self.backend.decode(ids, skip_special_tokens=False) == token else None


def _read_json(path: Path) -> dict:
    """The object in a JSON file, or {} when the file is absent."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: object) -> str | None:
    """A special-token entry of tokenizer_config.json (a string or an AddedToken dict) as its text."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _first_id(value: object) -> int | None:
    """An id field that may be an int or a list of ints, as its first int."""
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and isinstance(value[0], int):
        return value[0]
    return None


def _ids(value: object) -> list[int]:
    """An id field that may be an int, a list of ints or absent, as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _eos_ids(gen_cfg: dict, model_cfg: dict, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Every end-of-sequence id: generation_config's, then config.json's, then the tokenizer's, deduplicated."""
    found = _ids(gen_cfg.get("eos_token_id")) + _ids(model_cfg.get("eos_token_id"))
    if tokenizer_eos is not None:
        found.append(tokenizer_eos)
    return tuple(dict.fromkeys(found))


def _chat_template(root: Path, tok_cfg: dict) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config's (the "default" one of a named list)."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template") or _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _max_length(tok_cfg: dict) -> int | None:
    """tokenizer_config's model_max_length when it is a real limit (HF writes 1e30 for "none")."""
    value = tok_cfg.get("model_max_length")
    return int(value) if isinstance(value, (int, float)) and 0 < value < 1e12 else None
