"""Tool calls: a chat model's output text turned into OpenAI `tool_calls`, chunk by chunk, as OpenAI streams them.

A parser takes the output's content as it comes (`push`) and at the end (`flush`) and answers the content to
show and the tool-call deltas to send: a call's first delta carries its index, id, type and name (arguments ""),
later ones pieces of its arguments (a JSON text). The whole answer folds the same deltas (`fold_calls`).

- `hermes` (Hermes, Qwen 2.5 / 3): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text
  outside the tags is content. Text that may be the start of a tag is held back until it is one or cannot be.
- `llama3_json` (Llama 3.1+): an output that is a JSON object `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`; several joined by `;`) is a call; any other output is content.
- tool_choice a named function: the output is that function's arguments, made by a JSON-schema grammar of its
  parameters, streamed as argument pieces as they come (`NamedCall`).
- tool_choice "required": the output is a JSON array of `{"name", "parameters"}` objects, one per call, made by
  a grammar over every tool's schema (`RequiredCalls`).
Either forced form always parses: the grammar allows nothing else.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .detokenizer import _earliest_stop, _held_suffix

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class ToolChoiceError(ValueError):
    """tools / tool_choice that cannot be served (the message names what is wrong)."""


def call_id() -> str:
    """A fresh tool-call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_deltas(index: int, name: str, arguments: str) -> list[dict]:
    """The stream deltas of one complete call: its head, then its arguments."""
    head = {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    return [head, {"index": index, "function": {"arguments": arguments}}] if arguments else [head]


def fold_calls(deltas: list[dict]) -> list[dict]:
    """A whole response's tool_calls from its stream deltas (arguments pieces joined)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}}
        else:
            call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def merge_by_index(deltas: list[dict]) -> list[dict]:
    """One chunk's call deltas with those of one call joined (a head and its first arguments piece become one
    entry: a client reading tool_calls[0] of each chunk must not miss a piece)."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            last = out[-1]
            joined = last["function"].get("arguments", "") + d["function"].get("arguments", "")
            out[-1] = {**last, "function": {**last["function"], "arguments": joined}}
        else:
            out.append(d)
    return out


def complete_calls(calls: list[dict]) -> list[dict]:
    """The calls whose arguments are a whole JSON text (an output cut by max_tokens may leave one unfinished)."""
    out = []
    for call in calls:
        try:
            json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            continue
        out.append(call)
    return out


def forced(parser: object) -> bool:
    """Whether the parser reads a forced call (tool_choice a named function or "required"): its output is JSON."""
    return isinstance(parser, (NamedCall, RequiredCalls))


def _arguments_text(value: object) -> str:
    """Arguments as OpenAI sends them: a JSON text (a string a model wrote as JSON text is kept as it is)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _as_call(obj: object, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], _arguments_text(args if args is not None else {})


@dataclass(slots=True)
class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks among content."""

    calls: int = 0
    _held: str = ""
    _inside: bool = False

    def push(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = [], []
        buf = self._held + text
        while True:
            tag = _HERMES_CLOSE if self._inside else _HERMES_OPEN
            at, _ = _earliest_stop(buf, (tag,))
            if at < 0:
                break
            if self._inside:
                deltas += self._call(buf[:at])
            else:
                content.append(buf[:at])
            self._inside = not self._inside
            buf = buf[at + len(tag) :]
        if self._inside:
            self._held = buf  # a call is parsed once it is whole
        else:
            keep = _held_suffix(buf, (_HERMES_OPEN,))
            self._held = buf[len(buf) - keep :] if keep else ""
            content.append(buf[: len(buf) - keep])
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[dict]]:
        held, self._held = self._held, ""
        if self._inside:  # an unclosed call: a call if it parses, else the text as written
            deltas = self._call(held)
            return ("" if deltas else _HERMES_OPEN + held), deltas
        return held, []

    def _call(self, body: str) -> list[dict]:
        try:
            parsed = _as_call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            parsed = None
        if parsed is None:
            return []
        self.calls += 1
        return call_deltas(self.calls - 1, *parsed)


@dataclass(slots=True)
class Llama3JsonParser:
    """An output that is a JSON call object (or several joined by `;`); anything else is content."""

    calls: int = 0
    _buf: str = ""
    _decided: bool = False  # the output is known to be content (streamed on as it comes)

    def push(self, text: str) -> tuple[str, list[dict]]:
        if self._decided:
            return text, []
        self._buf += text
        start = self._buf.lstrip()
        if start and not (start.startswith("{") or _PYTHON_TAG.startswith(start[: len(_PYTHON_TAG)])
                          or start.startswith(_PYTHON_TAG)):
            self._decided = True
            out, self._buf = self._buf, ""
            return out, []
        return "", []

    def flush(self) -> tuple[str, list[dict]]:
        buf, self._buf = self._buf, ""
        body = buf.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :].strip()
        calls = []
        for part in (p for p in body.split(";") if p.strip()) if body else ():
            try:
                parsed = _as_call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                parsed = None
            if parsed is None:
                return buf, []
            calls.append(parsed)
        deltas = []
        for name, arguments in calls:
            deltas += call_deltas(self.calls, name, arguments)
            self.calls += 1
        return ("" if calls else buf), deltas


@dataclass(slots=True)
class NamedCall:
    """tool_choice a named function: the whole output is its arguments (streamed as they come)."""

    name: str
    calls: int = 0

    def push(self, text: str) -> tuple[str, list[dict]]:
        deltas = []
        if self.calls == 0:
            deltas = call_deltas(0, self.name, "")
            self.calls = 1
        if text:
            deltas.append({"index": 0, "function": {"arguments": text}})
        return "", deltas

    def flush(self) -> tuple[str, list[dict]]:
        return self.push("") if self.calls == 0 else ("", [])


@dataclass(slots=True)
class RequiredCalls:
    """tool_choice "required": the output is a JSON array of {name, parameters}; the calls go out at its end."""

    calls: int = 0
    _buf: list[str] = field(default_factory=list)

    def push(self, text: str) -> tuple[str, list[dict]]:
        self._buf.append(text)
        return "", []

    def flush(self) -> tuple[str, list[dict]]:
        text, self._buf = "".join(self._buf), []
        items = _array_items(text)  # cut short by max_tokens: the calls written whole still count
        if not items:
            return text, []
        deltas = []
        for item in items:
            parsed = _as_call(item, "parameters")
            if parsed is not None:
                deltas += call_deltas(self.calls, *parsed)
                self.calls += 1
        return "", deltas


def _array_items(text: str) -> list:
    """The complete items of a JSON array, even one whose end is missing."""
    decoder = json.JSONDecoder()
    at = text.find("[") + 1
    if at == 0:
        return []
    items = []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


ToolParser = HermesParser | Llama3JsonParser | NamedCall | RequiredCalls


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What a chat request's tools and tool_choice ask for: the parser each choice's output goes through, and the
    JSON schema that forces a call (None: the model decides)."""

    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None
    schema: dict | None = None

    def parser(self, parser_name: str) -> ToolParser | None:
        """A fresh parser for one choice (None: the output is plain content)."""
        if self.mode == "named":
            return NamedCall(self.name)
        if self.mode == "required":
            return RequiredCalls()
        if self.mode == "auto":
            return HermesParser() if parser_name == "hermes" else Llama3JsonParser()
        return None


def tool_choice_of(tools: list | None, choice: str | dict | None) -> ToolChoice:
    """The request's ToolChoice; ToolChoiceError when tools or tool_choice are malformed or do not match."""
    functions = _functions(tools)
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolChoiceError(f"tool_choice must be none, auto, required or a function (got {choice!r})")
        if choice != "none" and not functions:
            raise ToolChoiceError(f"tool_choice {choice!r} needs tools")
        if choice == "required":
            return ToolChoice("required", schema=_required_schema(functions))
        return ToolChoice(choice)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolChoiceError('tool_choice must be {"type": "function", "function": {"name": ...}}')
    if name not in functions:
        raise ToolChoiceError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolChoice("named", name=name, schema=functions[name])


def _functions(tools: list | None) -> dict[str, dict]:
    """Each tool's name and its parameters' JSON schema."""
    out = {}
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
        params = fn.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[fn["name"]] = params
    return out


def _required_schema(functions: dict[str, dict]) -> dict:
    """A JSON array of one or more calls, each {"name": one tool's name, "parameters": its schema}."""
    defs: dict[str, dict] = {}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _hoisted(name, params, defs)},
              "required": ["name", "parameters"]} for name, params in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


_LOCAL_REFS = ("#/$defs/", "#/definitions/")


def _hoisted(name: str, params: dict, defs: dict[str, dict]) -> dict:
    """A tool's parameters for use inside the combined schema: in there "#" is the array, so the tool's own
    $defs / definitions move to the root's $defs under "<tool>__<def>" and its local $refs are rewritten to
    them ("#" itself, a recursive schema, to "<tool>__" holding the parameters)."""
    prefix = f"{name}__"
    recursive = []

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = node.get("$ref")
        if ref == "#":
            recursive.append(True)
            out["$ref"] = f"#/$defs/{prefix}"
        elif isinstance(ref, str) and ref.startswith(_LOCAL_REFS):
            out["$ref"] = "#/$defs/" + prefix + ref.split("/", 2)[2]
        return out

    for key in ("definitions", "$defs"):
        for def_name, sub in (params.get(key) or {}).items():
            defs[prefix + def_name] = rewrite(sub)
    body = rewrite(params)
    if recursive:
        defs[prefix] = body
    return body
