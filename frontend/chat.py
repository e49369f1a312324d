"""Chat: a model folder's chat template rendered as transformers renders it, and reasoning split from content.

Rendering follows transformers' `apply_chat_template`: a sandboxed jinja2 environment with trim_blocks and
lstrip_blocks, the `loopcontrols` extension and a `{% generation %}` block, a `tojson` filter that keeps non-ASCII
text, the `raise_exception` and `strftime_now` helpers, and the special tokens (`bos_token`, `eos_token`, ...)
as variables beside `messages`, `tools` and `add_generation_prompt`. Like transformers, the rendered prompt is
tokenized without adding special tokens: a template that wants BOS emits `{{ bos_token }}` itself.

Reasoning: a model whose vocabulary (or template) has `<think>` / `</think>` writes its reasoning between them.
Those tags are often special tokens, which decoding normally drops, so chat requests of such a model are
detokenized with `TagKeepingDecoder` (special tokens skipped except the tags) and `ReasoningSplitter` moves the
text between the tags to `reasoning_content`, chunk by chunk, holding back text that may be the start of a tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Scanning for tags and reading configs are the detokenizer's and the tokenizer's own helpers (one copy each).
from .detokenizer import Decoder, _earliest_stop, _held_suffix
from .tokenizer import Tokenizer, _read_json, _token_content

THINK_START, THINK_END = "<think>", "</think>"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, or the template raised)."""


@dataclass(slots=True)
class ChatTemplate:
    """A compiled chat template and the special-token variables it is rendered with."""

    source: str
    template: jinja2.Template
    variables: dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_source(cls, source: str, variables: dict[str, object] | None = None) -> ChatTemplate:
        """Compile a template; ChatTemplateError when it is not valid jinja."""
        try:
            template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        return cls(source=source, template=template, variables=dict(variables or {}))

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The model's template (tokenizer_config.json, chat_template.jinja or a GGUF's), or None when it has none."""
        if not tokenizer.chat_template:
            return None
        return cls.from_source(tokenizer.chat_template, special_token_variables(model_dir, tokenizer))

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        extra: dict[str, object] | None = None,
    ) -> str:
        """The prompt text for `messages`; ChatTemplateError when they are malformed or the template refuses."""
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
        chat = normalize_messages(messages)
        values = {**self.variables, **(extra or {})}
        try:
            text = self.template.render(messages=chat, tools=tools, documents=documents,
                                        add_generation_prompt=add_generation_prompt, **values)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as exc:  # a template indexing what is not there
            raise ChatTemplateError(f"the chat template failed on these messages: {exc!r}") from None
        if continue_final_message:
            text = _cut_after_final_message(text, chat)
        return text


# OpenAI's message roles ("developer": its newer "system"; "function": the legacy tool role) and Llama 3's "ipython".
# Any other role string is passed to the template as it is (vLLM's custom roles): the template decides.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def chat_template_source(value: str) -> str:
    """`--chat-template`: the Jinja of a file when value names one, else value itself when it is a template
    (as vLLM takes it); ChatTemplateError when it is neither, or does not compile."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a long inline template is no path
        is_file = False
    if is_file:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template {value}: unreadable ({exc})") from None
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ChatTemplateError(f"--chat-template {value!r}: no such file, and not an inline Jinja template")
    ChatTemplate.from_source(source)  # compiles now: a broken template is a start-up error, not a 400 per chat
    return source


def normalize_messages(messages: object) -> list[dict]:
    """OpenAI chat messages as templates expect them: text parts joined into one string, tool arguments as objects."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string role")
        role = message["role"]
        if not role:
            raise ChatTemplateError(f"messages[{i}].role must not be empty")
        if "content" not in message and not (role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"messages[{i}] ({role}) has no content")
        if message.get("content") is None and role != "assistant":
            raise ChatTemplateError(f"messages[{i}].content must not be null for the {role} role")
        item = dict(message)
        item["content"] = _text_content(message.get("content"), i)
        if isinstance(item.get("tool_calls"), list):
            item["tool_calls"] = [_parsed_tool_call(call) for call in item["tool_calls"]]
        out.append(item)
    return out


def _text_content(content: object, i: int) -> str:
    """A message's content as one string: a string, null, or a list of text parts (joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"messages[{i}].content: only text parts are supported (got {kind!r})")
        return "\n".join(texts)
    raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")


def _parsed_tool_call(call: object) -> object:
    """A tool call whose function arguments are a JSON string, with them parsed (templates iterate them)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def _cut_after_final_message(text: str, chat: list[dict]) -> str:
    """The rendered text up to the end of the final message's content (so generation continues it)."""
    final = chat[-1]["content"]
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message's content is not in the rendered prompt")
    return text[: at + len(final)]


def special_token_variables(model_dir: str | Path, tokenizer: Tokenizer) -> dict[str, object]:
    """bos_token, eos_token, unk_token, pad_token (and additional_special_tokens) as tokenizer_config.json names them
    (else as the tokenizer's ids name them: a GGUF file has no tokenizer_config.json)."""
    cfg = _read_json(Path(model_dir) / "tokenizer_config.json")
    out: dict[str, object] = {}
    for name in _SPECIAL_NAMES:
        value = _token_content(cfg.get(name))
        if value is not None:
            out[name] = value
    backend = tokenizer.backend
    if "bos_token" not in out and tokenizer.bos_token_id is not None:
        out["bos_token"] = backend.id_to_token(tokenizer.bos_token_id)
    if "eos_token" not in out and tokenizer.eos_token_ids:
        out["eos_token"] = backend.id_to_token(tokenizer.eos_token_ids[0])
    for name, token_id in (("pad_token", tokenizer.pad_token_id), ("unk_token", tokenizer.unk_token_id)):
        if name not in out and token_id is not None:  # a GGUF names them by id only
            out[name] = backend.id_to_token(token_id)
    extra = cfg.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(_token_content, extra) if t is not None]
    return out


# ---- the jinja2 environment transformers renders with ------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        """The block's body, unchanged."""
        return caller()


def _raise_exception(message: str) -> None:
    """The templates' way to refuse messages (e.g. roles out of order)."""
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: non-ASCII text kept, no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """The current local time formatted (some templates print today's date)."""
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed jinja2 environment configured as transformers configures it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---- reasoning -----------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ReasoningTags:
    """The spelling of a model's reasoning tags, and the ids of those that are single special tokens."""

    start: str = THINK_START
    end: str = THINK_END
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: Tokenizer, template: str | None) -> ReasoningTags | None:
        """The tags when the vocabulary has both as tokens or the template writes the end tag, else None."""
        start_id, end_id = tokenizer.token_id(THINK_START), tokenizer.token_id(THINK_END)
        if (start_id is None or end_id is None) and THINK_END not in (template or ""):
            return None
        ids = frozenset(i for i in (start_id, end_id) if i is not None and i in tokenizer.special_token_ids)
        return cls(special_ids=ids)

    def open_at_end_of(self, prompt: str) -> bool:
        """True when the prompt leaves a reasoning block open (the template wrote the start tag last)."""
        return prompt.rstrip().endswith(self.start)


class TagKeepingDecoder:
    """Decodes as the tokenizer does with skip_special_tokens, except that the reasoning tags stay in the text."""

    __slots__ = ("_tok", "_drop")

    def __init__(self, tokenizer: Tokenizer, keep_ids: frozenset[int]) -> None:
        self._tok = tokenizer
        self._drop = frozenset(tokenizer.special_token_ids - keep_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; special tokens other than the kept ones are skipped when asked."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._drop]
        return self._tok.decode(ids, skip_special_tokens=False)


def tag_keeping_decoder(tokenizer: Tokenizer, tags: ReasoningTags | None) -> Decoder | None:
    """The decoder a chat request of this model needs, or None when the tokenizer's own is right."""
    if tags is None or not tags.special_ids:
        return None
    return TagKeepingDecoder(tokenizer, tags.special_ids)


class ReasoningSplitter:
    """Streams text in, (reasoning, content) deltas out; the tags themselves are never emitted."""

    __slots__ = ("_tags", "in_reasoning", "_held")

    def __init__(self, tags: ReasoningTags, in_reasoning: bool = False) -> None:
        self._tags = (tags.start, tags.end)
        self.in_reasoning = in_reasoning
        self._held = ""  # text that may be the start of a tag

    def push(self, text: str) -> tuple[str, str]:
        """Split new text; a tag cut across chunks is held back until it is whole (or cannot be one)."""
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._held + text
        while True:
            at, tag = _earliest_stop(buf, self._tags)
            if at < 0:
                break
            (reasoning if self.in_reasoning else content).append(buf[:at])
            self.in_reasoning = tag == self._tags[0]
            buf = buf[at + len(tag) :]
        keep = _held_suffix(buf, self._tags)
        self._held = buf[len(buf) - keep :] if keep else ""
        (reasoning if self.in_reasoning else content).append(buf[: len(buf) - keep])
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """At the end: the held-back text, which was not a tag after all."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def split_reasoning(text: str, tags: ReasoningTags, in_reasoning: bool = False) -> tuple[str, str]:
    """A whole output as (reasoning, content)."""
    splitter = ReasoningSplitter(tags, in_reasoning)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2
