"""POST /v1/chat/completions: messages rendered by the model's chat template, n choices streamed or whole, the
reasoning of a reasoning model split from its content, logprobs in the chat API's per-token shape, and vLLM's
prompt_logprobs (the rendered prompt's) at the top of a whole answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from metrale.ipc.messages import Delta, TokenLogprob
from metrale.ipc.sampling import SamplingParams, StructuredOutputs

from .chat import ChatTemplate, ChatTemplateError, ReasoningSplitter, ReasoningTags, tag_keeping_decoder
from .http_errors import ApiError, json_response
from .http_access_log import CHOICES
from .http_beam import beam_search
from .http_extensions import (check_pinned, needs_prompt_ids, pin, prompt_ids, prompt_logprob_dicts, refuse_unserved,
                              token_label)
from .http_params import (SamplingFields, ServedModel, check_count, check_stream_options, decode_body, sampling_params,
                          seeded)
from .http_reply import Reply, TokenTexts, stream
from .http_run import Choice, Run
from .tool_parsers import ToolChoiceError, complete_calls, fold_calls, forced, merge_by_index, tool_choice_of

if TYPE_CHECKING:
    from .server import FrontendServer


class ChatRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    # metrale (and vLLM) extras
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict] | None = None
    echo: bool = False  # vLLM's: the last message's content in front of the answer, when its role is the answer's
    # vLLM's disaggregated serving: its prompt_token_ids (the prefill stage's) are the prompt, messages unrendered;
    # metrale moves no KV between servers, so its other keys change nothing
    kv_transfer_params: dict | None = None


class ChatCompletions:
    """The /v1/chat/completions handler over one FrontendServer, with the model's template and reasoning tags."""

    def __init__(self, server: FrontendServer, model: ServedModel, texts: TokenTexts) -> None:
        self.server = server
        self.model = model
        self.texts = texts
        tokenizer = server.tokenizer
        try:
            self.template = ChatTemplate.load(model.dir, tokenizer)
            self.template_error = None
        except ChatTemplateError as exc:  # a broken template fails chat requests, not the server
            self.template, self.template_error = None, str(exc)
        self.reasoning = ReasoningTags.of(tokenizer, tokenizer.chat_template)
        self.decoder = tag_keeping_decoder(tokenizer, self.reasoning)

    def _encode(self, text: str) -> list[int]:
        """text's token ids without special tokens (bad_words)."""
        return self.server.tokenizer.encode(text, False)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        body = await decode_body(request, ChatRequest)
        self.model.check(body.model)
        _refuse_unsupported(body)
        chat = await self.submit(request, body)
        run, choices, ids, logprobs = chat.run, chat.choices, chat.prompt_ids, chat.logprobs
        voice = Voice.of(body)
        try:
            reply = Reply("chatcmpl", "chat.completion", self.model.reply_name(body.model), body.stream_options, self.model.force_usage,
                          per_request_metrics=self.model.per_request_metrics)
            label = token_label(self.texts, self.model.tokens_as_ids(body.return_tokens_as_token_ids))
            return_ids = bool(body.return_token_ids)
            pinned = body.logprob_token_ids  # the alternatives listed, when asked for by id
            if body.stream:
                reply.prompt_token_ids = ids if return_ids else None
                return await stream(request, run, choices, reply,
                                    lambda c, msg: self._chunk(c, msg, label, return_ids, voice, pinned))
            await run.collect(choices)
            answer = reply.completion(choices, [self._choice(c, label, return_ids, logprobs is not None, voice, pinned)
                                                for c in choices])
            # vLLM's fields, null when not asked for (clients read them as attributes); prompt_logprobs: the
            # prompt's, once for every choice (each ran it)
            answer["prompt_token_ids"] = ids if return_ids else None
            answer["prompt_logprobs"] = None if body.prompt_logprobs is None else \
                prompt_logprob_dicts(choices[0].prompt_logprobs or [], body.prompt_logprobs, self.texts)
            return json_response(answer)
        finally:
            run.close()

    async def submit(self, request: web.Request, body: ChatRequest) -> ChatRun:
        """Render body's messages, start its n choices and wait for each one's first output (the Responses route
        runs its requests through here too). The caller closes the returned Run; on an error it is closed here.
        400 naming the field for tools, messages or sampling fields that cannot be served."""
        try:
            tools = tool_choice_of(body.tools, body.tool_choice)
        except ToolChoiceError as exc:
            raise ApiError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools",
                           code="invalid_value") from None
        forwarded = _forwarded_ids(body.kv_transfer_params, self.server.vocab_size)
        if forwarded is not None:
            prompt = self.server.tokenizer.decode(forwarded, skip_special_tokens=False)  # where reasoning opens
            ids = await prompt_ids(self.server, body, None, forwarded, False)
        else:
            prompt = self.render(body)
            ids = await prompt_ids(self.server, body, prompt, None, False) \
                if needs_prompt_ids(body, self.model.force_usage) else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        explicit_max = max_tokens is not None  # then it must fit beside the prompt (400 otherwise)
        if max_tokens is None:
            max_tokens = self.server.max_model_len or 16  # the engine core stops at max_model_len
        if body.top_logprobs is not None and (body.top_logprobs < -1 or (body.top_logprobs != 0 and not body.logprobs)):
            raise ApiError(400, "top_logprobs must be a positive value or -1, with logprobs true", param="top_logprobs",
                           code="invalid_value")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        check_pinned(body, logprobs, self.server.vocab_size, self.server.max_logprobs)
        if body.logprob_token_ids is not None:  # they take top_logprobs' place (vLLM's)
            logprobs = 0
        self.model.adapter(body.model, body.use_beam_search)
        if body.use_beam_search:
            return await self._beam_search(request, body, prompt, max_tokens if explicit_max else None, logprobs)
        forced = StructuredOutputs(json=tools.schema) if tools.schema is not None else None  # the call must parse
        params = sampling_params(body, max_tokens, logprobs, self.server.vocab_size, forced,
                                 defaults=self.model.sampling_defaults, prompt_logprobs=body.prompt_logprobs,
                                 max_logprobs=self.server.max_logprobs, encode=self._encode)
        check_count(body.n)
        decoder = self.decoder if params.skip_special_tokens else None
        opens_reasoning = self.reasoning is not None and self.reasoning.open_at_end_of(prompt)
        adapter = self.model.adapter(body.model)
        run = Run(self.server, self.texts)
        try:
            choices = request[CHOICES] = []  # the access log counts their tokens
            for j in range(body.n):
                splitter = ReasoningSplitter(self.reasoning, opens_reasoning) if self.reasoning else None
                choices.append(Choice(index=j, prompt_index=0, splitter=splitter, prompt_ids=ids,
                                      tools=tools.parser(self.server.config.tool_call_parser)))
                run.start(j, seeded(params, j), prompt=None if ids else prompt, token_ids=ids, add_special_tokens=False,
                          decoder=decoder, cache_salt=body.cache_salt, strict_length=explicit_max, lora=adapter)
            await run.wait_first("messages")
        except BaseException:  # refused, or the client left: nothing of it may keep running
            run.close()
            raise
        return ChatRun(run, choices, ids, logprobs, params)

    async def _beam_search(self, request: web.Request, body: ChatRequest, prompt: str, max_tokens: int | None,
                           logprobs: int | None) -> ChatRun:
        """Run body's beam search over the rendered prompt (http_beam.py): its n hypotheses as the n choices, each
        with its one final Delta in. max_tokens None: up to the model's length."""
        ids = await prompt_ids(self.server, body, prompt, None, False)
        check_count(body.n)
        decoder = self.decoder if body.skip_special_tokens is not False else None
        run = await beam_search(self.server, self.texts, body, [ids], max_tokens, logprobs, param="messages",
                                decoder=decoder)
        opens_reasoning = self.reasoning is not None and self.reasoning.open_at_end_of(prompt)
        request[CHOICES] = choices = [  # the access log counts their tokens
            Choice(index=j, prompt_index=0, prompt_ids=ids,
                   splitter=ReasoningSplitter(self.reasoning, opens_reasoning) if self.reasoning else None)
            for j in range(body.n)]
        return ChatRun(run, choices, ids, logprobs, run.step)

    def render(self, body) -> str:
        """The chat prompt of a body with messages and the template fields (ChatRequest, a /tokenize one); 400 when
        the model has no template or the messages do not render."""
        if self.template is None:
            why = self.template_error or ("the model has no chat template (no chat_template in tokenizer_config.json "
                                          "and no chat_template.jinja); use /v1/completions")
            raise ApiError(400, why, param="messages", code="chat_template_missing")
        try:
            return self.template.render(body.messages, add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message, tools=body.tools,
                                        documents=body.documents, extra=body.chat_template_kwargs)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_value") from None

    def _chunk(self, c: Choice, msg: Delta, label, return_token_ids: bool, voice: Voice,
               pinned: list[int] | None = None) -> list[dict]:
        """A chat stream's choice entry for one Delta (the first one carries the role, and the echo; none when it
        says nothing). A delta without reasoning or tool calls always has its content, "" when there is no text, so
        clients that concatenate contents never meet a null."""
        logprobs = pin([item for item, _ in c.kept_logprobs(msg, self.texts)], pinned)
        reasoning, content, calls = delta_parts(c, msg)
        first = not c.started
        if not (first or reasoning or content or calls or msg.finish_reason is not None or logprobs
                or (return_token_ids and msg.token_ids)):
            return []
        c.started = True
        delta: dict = {"role": voice.role, "content": voice.echo + content} if first else {}
        if reasoning:  # vLLM's current name, and the one it had before
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if not first and (content or not (reasoning or calls)):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = merge_by_index(calls)  # one entry per call per chunk, as OpenAI streams
        entry = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": _finish_reason(c, msg.finish_reason)}
        if logprobs:
            entry["logprobs"] = {"content": token_logprobs(logprobs, label)}
        if return_token_ids:
            entry["token_ids"] = msg.token_ids
        return [entry]

    def _choice(self, c: Choice, label, return_token_ids: bool, logprobs: bool, voice: Voice,
                pinned: list[int] | None = None) -> dict:
        """One choice of a whole chat completion (its message with every field OpenAI's client declares)."""
        reasoning, content, calls = whole_parts(c)
        message: dict = {"role": voice.role}
        if c.splitter is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        made_to_call = c.tools is not None and forced(c.tools)
        if made_to_call and content is None:
            content = ""  # vLLM's (and OpenAI's) message beside a required or named call
        message["content"] = voice.echo + (content or "") if voice.echo else content
        # A required or named call that max_tokens cut before it ended: no tool_calls at all, as OpenAI answers.
        message["tool_calls"] = None if made_to_call and not calls else calls
        message.update(refusal=None, annotations=None, audio=None, function_call=None)
        entry = {"index": c.index, "message": message, "logprobs": None, "finish_reason": _finish_reason(c, c.finish_reason)}
        if logprobs:  # asked for: an object even when no token is listed
            entry["logprobs"] = {"content": token_logprobs(pin(c.logprobs, pinned), label)}
        entry["token_ids"] = c.token_ids if return_token_ids else None
        return entry


@dataclass(frozen=True, slots=True)
class Voice:
    """Who a chat answer speaks as, and what it echoes (vLLM's): the assistant, or with add_generation_prompt false
    the last message's role (the answer continues that message); with echo, the last message's content when its role
    is the answer's, put in front of the answer's content."""

    role: str = "assistant"
    echo: str = ""

    @classmethod
    def of(cls, body: ChatRequest) -> Voice:
        """The voice of a request whose messages rendered (so they are a list of objects with string roles)."""
        last = body.messages[-1]
        role = "assistant" if body.add_generation_prompt else last["role"]
        if not body.echo or last["role"] != role:
            return cls(role)
        content = last.get("content")
        if isinstance(content, list):  # text parts, joined as the template saw them
            content = "\n".join(p if isinstance(p, str) else p.get("text", "") for p in content)
        return cls(role, content or "")


@dataclass(slots=True)
class ChatRun:
    """A chat request submitted: its engine requests, its choices (each with its first output in) and how it asked."""

    run: Run
    choices: list[Choice]
    prompt_ids: list[int] | None  # tokenized here (return_token_ids, truncation), else None
    logprobs: int | None  # top-N asked for, None when logprobs were not
    params: SamplingParams  # what the choices run with (the model's defaults filled in)


def delta_parts(c: Choice, msg: Delta) -> tuple[str, str, list[dict]]:
    """One Delta of a chat choice as (reasoning, content, tool-call deltas): the reasoning split off, the rest through
    the choice's tool parser; both flushed on the choice's last Delta."""
    reasoning, content = c.splitter.push(msg.text) if c.splitter else ("", msg.text)
    if msg.finish_reason is not None and c.splitter:
        r, t = c.splitter.flush()
        reasoning, content = reasoning + r, content + t
    calls: list[dict] = []
    if c.tools is not None:
        content, calls = c.tools.push(content)
        if msg.finish_reason is not None:
            rest, more = c.tools.flush()
            content, calls = content + rest, calls + more
    return reasoning, content, calls


def whole_parts(c: Choice) -> tuple[str | None, str | None, list[dict]]:
    """A collected chat choice as its message carries it: (reasoning, None when there is none; content, None when
    the choice only called tools or was cut inside a forced call; the complete tool_calls)."""
    text = "".join(c.text)
    reasoning = None
    content: str | None = text
    if c.splitter is not None:
        r1, c1 = c.splitter.push(text)
        r2, c2 = c.splitter.flush()
        reasoning, content = (r1 + r2) or None, c1 + c2
    calls: list[dict] = []
    if c.tools is not None:
        rest, deltas = c.tools.push(content)
        tail, more = c.tools.flush()
        calls = fold_calls(deltas + more)
        content = (rest + tail) or (None if calls else "")
        if c.finish_reason == "length":  # cut short: a call whose arguments did not end is not a call
            calls = complete_calls(calls)
            if forced(c.tools):  # the text was the forced call's JSON, not an answer
                content = None
    return reasoning, content, calls


def token_logprobs(items: list[TokenLogprob], label) -> list[dict]:
    """Logprobs in the chat API's per-token shape (the Responses API's too). label(id): how a token is named."""
    out = []
    for t in items:
        top = [_logprob_entry(label(i), lp) for i, lp in zip(t.top_ids, t.top_logprobs)]
        out.append({**_logprob_entry(label(t.token_id), t.logprob), "top_logprobs": top})
    return out


def _logprob_entry(name: str, logprob: float) -> dict:
    """{token, logprob, bytes} of one token."""
    return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}


def _finish_reason(c: Choice, reason: str | None) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for a choice that stopped after calling tools."""
    return "tool_calls" if reason == "stop" and c.tools is not None and c.tools.calls else reason


def _forwarded_ids(kv_transfer_params: dict | None, vocab_size: int) -> list[int] | None:
    """kv_transfer_params' prompt_token_ids (vLLM's decode-side reuse of the prefill stage's tokens), None when not
    given; 400 naming it when it is not a non-empty list of the vocabulary's ids."""
    ids = (kv_transfer_params or {}).get("prompt_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise ApiError(400, "kv_transfer_params.prompt_token_ids must be a non-empty list of token ids",
                       param="kv_transfer_params.prompt_token_ids", code="invalid_value")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"Token id {bad[0]} is out of vocabulary (this model's ids are 0 to {vocab_size - 1})",
                       param="kv_transfer_params.prompt_token_ids", code="invalid_value")
    return ids


def _refuse_unsupported(body: ChatRequest) -> None:
    """400 for chat options this server does not implement, or a stream_options without stream."""
    check_stream_options(body)
    refuse_unserved(body)
