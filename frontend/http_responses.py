"""POST /v1/responses: OpenAI's Responses API over the chat route, as vLLM serves it.

A Responses request is turned into the chat request it stands for — `instructions` and `input` items into
messages, flat function tools into chat tools, `text.format` into `response_format` — and run by
ChatCompletions.submit: the same template, tool parsing, structured outputs and generate_local path. Its one
choice's parts then become output items (responses_events.py), streamed as Responses events or sent whole.

metrale keeps no responses, runs no built-in tools and takes text only: a field that asks for those (`store`,
`previous_response_id`, `background`, a web_search tool, an image part, …) is a 400 naming it, as is any field
this route does not know — a client that sends one relies on it, and silence would mislead it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import msgspec
from aiohttp import web

from metrale.ipc.messages import Error
from metrale.ipc.sampling import SamplingParams

from .http_chat import ChatCompletions, ChatRequest, ChatRun, delta_parts, token_logprobs, whole_parts
from .http_errors import ApiError, json_response
from .http_params import ServedModel, decode_body
from .http_reply import _SSE_HEADERS, TokenTexts, usage
from .http_run import Choice
from .responses_events import (REASONING, EventStream, OutputItems, new_id, reasoning_token_count,
                               response_usage)


class FormatText(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """text.format {"type": "text"}: free text (the default)."""


class FormatJsonObject(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True):
    """text.format {"type": "json_object"}: any JSON object."""


class FormatJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True, omit_defaults=True,
                       forbid_unknown_fields=True):
    """text.format {"type": "json_schema", ...}: JSON valid for `schema` (always enforced, strict or not)."""

    name: str
    schema: dict
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: FormatText | FormatJsonObject | FormatJsonSchema | None = None
    verbosity: str | None = None  # a hint to OpenAI's models; only "medium" (the default) is served


class ReasoningConfig(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    effort: str | None = None  # given to the chat template as `reasoning_effort` (as vLLM does)
    summary: str | None = None  # refused: metrale writes no summaries
    generate_summary: str | None = None  # (its older name)


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # padding OpenAI adds against side channels; metrale adds none


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/responses. A field not named here is a 400 naming it."""

    input: str | list
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call is kept
    stream: bool = False
    stream_options: StreamOptions | None = None
    reasoning: ReasoningConfig | None = None
    # Echoed only: nothing for metrale to do with them
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache needs none
    max_tool_calls: int | None = None  # limits built-in tool calls, and metrale runs none
    truncation: str | None = None  # "disabled" only
    service_tier: str | None = None  # "auto" / "default" only
    prompt_cache_retention: str | None = None  # "in_memory" only
    # Refused when set: state metrale does not keep, work it does not do
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    # metrale's extras (vLLM's names), as on the chat route: pass them as extra_body
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    max_thinking_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    adaptive_sampling: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    structured_outputs: dict | None = None
    chat_template_kwargs: dict | None = None


# Copied to the chat request as they are.
_EXTRAS = ("temperature", "top_p", "seed", "top_k", "min_p", "min_tokens", "max_thinking_tokens", "ignore_eos",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stop_token_ids",
           "skip_special_tokens", "adaptive_sampling", "priority", "cache_salt", "structured_outputs")
# The chat route's field names in its errors, as this route calls them.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text", "logprobs": "top_logprobs"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


async def decode_request(request: web.Request) -> ResponsesRequest:
    """The body as a ResponsesRequest; 400 naming a field that is missing, mistyped, or not one of this route's."""
    try:
        return await decode_body(request, ResponsesRequest)
    except ApiError as exc:
        named = re.search(r"(unknown|missing required) field `([^`]+)`$", exc.message)
        if exc.param is not None or named is None:
            raise
        if named[1] == "unknown":
            raise _bad(named[2], f"{named[2]} is not supported on /v1/responses", "unsupported_value") from None
        raise _bad(named[2], f"{named[2]} is required") from None


def refuse_unserved(body: ResponsesRequest) -> None:
    """400 naming the first field that asks for what metrale cannot do."""
    reasoning, text = body.reasoning, body.text
    unserved = (
        ("store", body.store, "metrale keeps no responses: store must be false or left out"),
        ("background", body.background, "background responses are not supported"),
        ("previous_response_id", body.previous_response_id is not None,
         "metrale keeps no responses: send the whole conversation in input"),
        ("conversation", body.conversation is not None, "metrale keeps no conversations: send them in input"),
        ("prompt", body.prompt is not None, "stored prompt templates are not supported"),
        ("truncation", body.truncation not in (None, "disabled"), "only truncation 'disabled' is supported"),
        ("service_tier", body.service_tier not in (None, "auto", "default"), "only service_tier 'auto' or 'default'"),
        ("prompt_cache_retention", body.prompt_cache_retention not in (None, "in_memory"),
         "only prompt_cache_retention 'in_memory' is supported"),
        ("reasoning.summary", reasoning is not None and (reasoning.summary or reasoning.generate_summary) is not None,
         "reasoning summaries are not supported"),
        ("text.verbosity", text is not None and text.verbosity not in (None, "medium"),
         "only text.verbosity 'medium' is supported"),
        ("stream_options", body.stream_options is not None and not body.stream,
         "stream_options can only be given with stream true"),
    )
    for param, refused, message in unserved:
        if refused:
            raise _bad(param, message, "unsupported_value")
    for item in body.include or ():
        if item != LOGPROBS_INCLUDE:
            raise _bad("include", f"include {item!r} is not supported (only {LOGPROBS_INCLUDE!r})", "unsupported_value")


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request stands for; 400 naming the input item, tool or field that does not fit."""
    fmt = body.text.format if body.text is not None else None
    tools = chat_tools(body.tools)
    choice = chat_tool_choice(body.tool_choice, bool(tools))
    if fmt is not None and not isinstance(fmt, FormatText) and (choice == "required" or isinstance(choice, dict)):
        raise _bad("tool_choice", "tool_choice 'required' or a named function cannot be combined with a JSON "
                   "text.format")
    logprobs = LOGPROBS_INCLUDE in (body.include or ()) or bool(body.top_logprobs)
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort is not None:
        kwargs["reasoning_effort"] = body.reasoning.effort
    return ChatRequest(messages=chat_messages(body.instructions, body.input), tools=tools or None, tool_choice=choice,
                       max_completion_tokens=body.max_output_tokens, response_format=_response_format(fmt),
                       logprobs=logprobs, top_logprobs=body.top_logprobs if logprobs else None,
                       chat_template_kwargs=kwargs or None, **{name: getattr(body, name) for name in _EXTRAS})


def chat_messages(instructions: str | None, items: str | list) -> list[dict]:
    """The chat messages of `instructions` (a system message in front) and `input`: a string (one user message) or
    a list of messages, function_call / function_call_output items and reasoning items."""
    out = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not items:
        raise _bad("input", "input must be a string or a non-empty list of items")
    names: dict[str, str] = {}  # call_id -> function name: templates name the tool that answers
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn it goes with
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, f"{at} must be an object (a message or an item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{at}.role", f"{at}.role must be one of {', '.join(_ROLES)} (got {role!r})")
            message = {"role": role, "content": _text_of(item.get("content"), f"{at}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            call_id, name, arguments = (_string(item, key, at) for key in ("call_id", "name", "arguments"))
            names[call_id] = name
            if not out or out[-1]["role"] != "assistant":  # parallel calls (and text before them) are one turn
                out.append({"role": "assistant", "content": ""})
            if reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", at)
            output = item.get("output")
            message = {"role": "tool", "tool_call_id": call_id, "content": _text_of(output, f"{at}.output")}
            if call_id in names:
                message["name"] = names[call_id]
            out.append(message)
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                raise _bad(f"{at}.encrypted_content", "encrypted reasoning is not supported", "unsupported_value")
            reasoning = _text_of(item.get("content") or [], f"{at}.content", ("reasoning_text",))
        else:
            raise _bad(f"{at}.type", f"input items of type {kind!r} are not supported (messages, function_call, "
                       "function_call_output and reasoning are)", "unsupported_value")
    return out


def _text_of(content: object, at: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    """A content field's text: a string, or a list of text parts (of `kinds`) joined by newlines, as the chat
    route joins its parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(at, f"{at} must be a string or a list of {' / '.join(kinds)} parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _bad(f"{at}[{j}]", f"{at}[{j}]: only {' / '.join(kinds)} parts with a string text are supported "
                       f"(got {kind or type(part).__name__!r})", "unsupported_value")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{at}.{key}", f"{at}.{key} must be a string")
    return value


def chat_tools(tools: list | None) -> list[dict]:
    """Responses' flat function tools in the chat route's shape; 400 for any other kind (metrale runs none)."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}].type", f"tools of type {kind!r} are not supported: metrale runs no built-in "
                       "tools, only function tools the client runs", "unsupported_value")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools[{i}].name", f"tools[{i}].name must be a non-empty string")
        function = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None, has_tools: bool) -> str | dict | None:
    """tool_choice in the chat route's shape ("auto" without tools means no tools, as it does for OpenAI)."""
    if choice is None or isinstance(choice, str):
        return None if choice == "auto" and not has_tools else choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...} '
               f"(got type {choice.get('type')!r})", "unsupported_value")


def _response_format(fmt: FormatText | FormatJsonObject | FormatJsonSchema | None) -> dict | None:
    """text.format as the chat route's response_format."""
    if isinstance(fmt, FormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJsonSchema):
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}}
    return None


@dataclass(slots=True)
class Envelope:
    """What every response object of one request carries: its id, time, model and the request's settings."""

    id: str
    created_at: int
    model: str
    settings: dict

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        """The response object (incomplete_details says why a response is incomplete)."""
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "error": None, "incomplete_details": details, "output": output, "usage": usage,
                **self.settings}


def echoed_settings(body: ResponsesRequest, params: SamplingParams) -> dict:
    """The request's settings as a response echoes them (sampling as the choice ran, defaults filled in)."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else FormatText()
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": msgspec.to_builtins(body.reasoning) if body.reasoning is not None else None,
            "service_tier": body.service_tier, "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": msgspec.to_builtins(fmt), "verbosity": "medium"},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0, "truncation": "disabled", "user": body.user,
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "background": False}


class Responses:
    """The /v1/responses handler, running each request through the chat route's ChatCompletions."""

    def __init__(self, chat: ChatCompletions, model: ServedModel, texts: TokenTexts) -> None:
        self.chat = chat
        self.model = model
        self.texts = texts
        tags, tokenizer = chat.reasoning, chat.server.tokenizer
        self._tag_ids = (tokenizer.token_id(tags.start), tokenizer.token_id(tags.end)) if tags else (None, None)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses."""
        body = await decode_request(request)
        self.model.check(body.model)
        refuse_unserved(body)
        try:
            chat = await self.chat.submit(request, chat_request(body))
        except ApiError as exc:
            exc.param = _PARAMS.get(exc.param, exc.param)
            raise
        try:
            envelope = Envelope(new_id("resp"), int(time.time()), self.model.reply_name(body.model), echoed_settings(body, chat.params))
            limit = 1 if body.parallel_tool_calls is False else None
            if body.stream:
                return await self._stream(request, chat, envelope, limit)
            await chat.run.collect(chat.choices)
            return json_response(self._whole(chat, envelope, limit))
        finally:
            chat.run.close()

    def _whole(self, chat: ChatRun, envelope: Envelope, limit: int | None) -> dict:
        """The response object of a collected choice."""
        c = chat.choices[0]
        opened = c.splitter is not None and c.splitter.in_reasoning
        reasoning, content, calls = whole_parts(c)
        heads = [{"index": i, "id": call["id"], "function": call["function"]} for i, call in enumerate(calls)]
        logprobs = token_logprobs(c.logprobs, self.texts) if chat.logprobs is not None else []
        items = OutputItems(limit)
        items.add(reasoning or "", content or "", heads, logprobs)
        status = _status(c)
        items.finish(status)
        return envelope.response(status, items.done, self._usage(c, items.done, opened))

    async def _stream(self, request: web.Request, chat: ChatRun, envelope: Envelope,
                      limit: int | None) -> web.StreamResponse:
        """The response as Responses SSE events; an engine error after the first byte ends it with an `error`
        event (no response.completed)."""
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        events = EventStream()
        started = envelope.response("in_progress", [])
        await response.write(events.encode([{"type": "response.created", "response": started},
                                            {"type": "response.in_progress", "response": started}]))
        c = chat.choices[0]
        opened = c.splitter is not None and c.splitter.in_reasoning
        items = OutputItems(limit)
        async for msg in chat.run.messages():
            if isinstance(msg, Error):
                err = ApiError.from_engine(msg)
                await response.write(events.encode([{"type": "error", "code": err.code, "message": err.message,
                                                     "param": err.param}]))
                await response.write_eof()
                return response
            c.fold(msg)
            kept = c.kept_logprobs(msg, self.texts) if chat.logprobs is not None else ()
            out = items.add(*delta_parts(c, msg), token_logprobs([item for item, _ in kept], self.texts))
            if msg.finish_reason is not None:
                out += items.finish(_status(c))
            if out:
                await response.write(events.encode(out))
        status = _status(c)
        final = envelope.response(status, items.done, self._usage(c, items.done, opened))
        await response.write(events.encode([{"type": f"response.{status}", "response": final}]))
        await response.write_eof()
        return response

    def _usage(self, c: Choice, output: list[dict], opened: bool) -> dict:
        """The response's usage; its reasoning tokens counted on the output's token ids when the tags are single
        tokens, else by encoding the reasoning text."""
        counts = usage([c])
        start, end = self._tag_ids
        if start is not None and end is not None:
            thinking = reasoning_token_count(c.token_ids, start, end, opened)
        else:
            text = "".join(part["text"] for item in output if item["type"] == REASONING for part in item["content"])
            thinking = len(self.chat.server.tokenizer.encode(text, False)) if text else 0
        return response_usage(counts["prompt_tokens"], counts["completion_tokens"],
                               counts["prompt_tokens_details"]["cached_tokens"], thinking)


def _status(c: Choice) -> str:
    """A finished choice's response status: incomplete when cut by max_output_tokens (or the model's length)."""
    return "incomplete" if c.finish_reason == "length" else "completed"
