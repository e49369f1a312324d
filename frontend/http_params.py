"""From an HTTP request's JSON to the engine's terms: the body fields both endpoints share, the model they name,
and the SamplingParams each choice runs with. Every refusal is a 400 (404 for a model) naming the field.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Literal

import msgspec
from aiohttp import web

from metrale.ipc.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutputs, seeded_for_choice

from .bad_words import bad_words_token_ids
from .http_errors import ApiError

log = logging.getLogger("metrale.frontend.http")

MAX_CHOICES = 128  # prompts × n of one request
_MAX_SEED = 2**63 - 1  # the engine's seeds are non-negative int64s


class StreamOptions(msgspec.Struct, kw_only=True):
    """stream_options: whether a stream reports usage at its end (and, continuous_usage_stats, on every chunk)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share: OpenAI's sampling parameters and metrale's extras (vLLM's names)."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # metrale extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    max_thinking_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    adaptive_sampling: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None  # prefix-cache namespace: requests with different salts never share KV
    # vLLM's extensions (http_extensions.py): honoured, or refused with a 400 naming them
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "left" (None too): keep the last tokens; "right": the first
    use_beam_search: bool | None = None  # http_beam.py, with n beams and the three fields below
    length_penalty: float | None = None  # beam search: a hypothesis scores its log-probability / length ** this
    early_stopping: bool | str | None = None  # beam search: False, True or "never" (transformers')
    include_stop_str_in_output: bool | None = None  # beam search: keep the eos that ended a hypothesis
    prompt_logprobs: int | None = None  # each prompt token's logprob and top-N (not streamed; not with beams)
    logprob_token_ids: list[int] | None = None  # vLLM's: the alternatives listed are these ids (with logprobs)
    allowed_token_ids: list[int] | None = None  # vLLM's: sampling only among these
    bad_words: list[str] | None = None  # vLLM's: words never generated (tokenized here: bad_words.py)
    # Structured outputs: OpenAI's response_format (json_object, json_schema) or vLLM's structured_outputs
    # (json, json_object, regex, choice, grammar); at most one of the two.
    response_format: dict | None = None
    structured_outputs: dict | None = None


# Simple sampling fields copied as they are when given.
_PASSTHROUGH = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
                "min_tokens", "max_thinking_tokens", "ignore_eos", "repetition_penalty", "skip_special_tokens",
                "adaptive_sampling", "priority")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The one model the HTTP API serves: the names clients give it (--served-model-name, else its folder's name,
    with the folder's path accepted too), and the sampling defaults for what a request leaves out."""

    names: tuple[str, ...]
    dir: str
    dir_named: bool = True  # no --served-model-name: the folder's path names it too
    sampling_defaults: dict = field(default_factory=dict)  # model_facts.generation_defaults
    force_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage
    per_request_metrics: bool = False  # --enable-per-request-metrics: vLLM's timing beside a one-choice usage
    tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens by id unless told not to
    # LoRA adapters by name (their folders): the server's own dict (FrontendServer.adapters, which follows run-time
    # loads); a request naming one runs with it
    adapters: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        """The name replies carry."""
        return self.names[0]

    def tokens_as_ids(self, asked: bool | None) -> bool:
        """Whether logprobs name tokens "token_id:N": as the request says, else as the server was started."""
        return self.tokens_as_token_ids if asked is None else asked

    def check(self, model: str | None) -> None:
        """404 unless model names this server's model or one of its LoRA adapters (or is left out)."""
        if model is not None and model not in self.names and model not in self.adapters \
                and not (self.dir_named and model == str(self.dir)):
            served = ", ".join(repr(n) for n in (*self.names, *self.adapters))
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")


    def reply_name(self, model: str | None) -> str:
        """The model name a reply carries: the adapter a request named (as vLLM answers), else the first name."""
        return model if model is not None and model in self.adapters else self.id

    def adapter(self, model: str | None, use_beam_search: bool = False) -> str | None:
        """The LoRA adapter model names (None: the base model); 400 for an adapter with beam search, which runs on
        the base model only."""
        if model is None or model not in self.adapters:
            return None
        if use_beam_search:
            raise ApiError(400, "use_beam_search runs on the base model, not a LoRA adapter", param="model",
                           code="unsupported_value")
        return model


# Media types a JSON body may be sent as (none given is taken as JSON, as curl with --data-binary sends).
_JSON_TYPES = ("application/json", "")


async def decode_body(request: web.Request, kind: type[msgspec.Struct]):
    """The JSON body as `kind`; 415 unless it is sent as JSON, 400 naming the field when it does not fit.

    Lax coercion, as vLLM's pydantic models take a body: "true" is a bool, "5" an int."""
    if request.content_type not in _JSON_TYPES and not request.content_type.endswith("+json"):
        raise ApiError(415, f"Unsupported Media Type: only 'application/json' is allowed (got "
                       f"{request.content_type!r})", code="unsupported_media_type")
    data = await request.read()
    try:
        body = msgspec.json.decode(data, type=kind, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] if "at `$." in message else None
        missing = _MISSING.fullmatch(message)
        if param is None and missing is not None:
            param = missing["field"]
        raise ApiError(400, readable(message), param=param, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    ignored = _unknown_fields(data, kind)
    if ignored:  # vLLM's warning, so a field a client counts on is not lost unseen
        log.warning("The following fields were present in the request but ignored: %s", ignored)
    return body


def _unknown_fields(data: bytes, kind: type[msgspec.Struct]) -> set[str]:
    """The body's top-level keys that `kind` has no field for (the values are not parsed again)."""
    keys = msgspec.json.decode(data, type=dict[str, msgspec.Raw]).keys()
    return set(keys) - set(kind.__struct_encode_fields__)


# msgspec's type names as a sentence says them.
_KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "array": "an array",
          "object": "an object", "null": "null", "dict": "an object", "list": "an array"}
_EXPECTED = re.compile(r"Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`(?: - at `\$(?P<path>[^`]*)`)?")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`(?: - at `\$(?P<path>[^`]*)`)?")


def readable(message: str) -> str:
    """msgspec's validation message as a sentence a person reads ("Expected `int`, got `str` - at `$.n`" becomes
    "n must be an integer, not a string"); a message of another form as it is."""
    m = _EXPECTED.fullmatch(message)
    if m:
        want = " or ".join(_KINDS.get(k.strip(), k.strip()) for k in m["want"].split("|"))
        got = _KINDS.get(m["got"], m["got"])
        where = _field(m["path"])
        return f"{where} must be {want}, not {got}" if where else f"the body must be {want}, not {got}"
    m = _MISSING.fullmatch(message)
    if m:
        where = _field((m["path"] or "") + "." + m["field"])
        return f"{where} is required"
    return message


def _field(path: str | None) -> str:
    """A msgspec path ("$.a.b[0]", without the "$") as the field it names: "a.b[0]"; "[...]" is any key's value."""
    path = (path or "").lstrip(".")
    if path.endswith("[...]"):
        return f"each value of {path[:-5]}"
    return path


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int,
                    structured: StructuredOutputs | None = None, defaults: dict | None = None,
                    prompt_logprobs: int | None = None, max_logprobs: int = MAX_LOGPROBS,
                    encode: Callable[[str], list[int]] | None = None) -> SamplingParams:
    """The request's SamplingParams (defaults, the model's generation config, for what it leaves out); 400
    naming the field when one is out of range. structured: a constraint the route adds (a forced tool call's
    schema) where the body asks for none. prompt_logprobs: the top-N each prompt token lists (-1: the whole
    vocabulary), None for none. max_logprobs: the server's cap (--max-logprobs as a count), for both. encode(text):
    the tokenizer's ids of a text without special tokens, for bad_words (a route without it refuses them)."""
    if body.seed is not None and not 0 <= body.seed <= _MAX_SEED:  # pydantic's words too, which vLLM's clients match
        side = "greater_than_equal 0" if body.seed < 0 else f"less_than_equal {_MAX_SEED}"
        raise ApiError(400, f"seed {body.seed} is out of range: a seed must be an integer from 0 to {_MAX_SEED} "
                       f"({side})", param="seed", code="invalid_value")
    kw = {**(defaults or {}), **{name: getattr(body, name) for name in _PASSTHROUGH if getattr(body, name) is not None}}
    asked = structured_outputs(body)
    if asked is not None and structured is not None:
        raise ApiError(400, "tool_choice 'required' or a named function cannot be combined with response_format or "
                       "structured_outputs", param="tool_choice", code="invalid_value")
    kw["structured_outputs"] = asked or structured
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if body.bad_words:
        if encode is None:
            raise ApiError(400, "bad_words is not supported here", param="bad_words", code="unsupported_value")
        try:
            kw["bad_words_token_ids"] = bad_words_token_ids(body.bad_words, encode)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="bad_words", code="invalid_value") from None
    params = SamplingParams(max_tokens=max_tokens, logprobs=_num_logprobs(logprobs, vocab_size, max_logprobs),
                            stop=stop, prompt_logprobs=_num_logprobs(prompt_logprobs, vocab_size, max_logprobs,
                                                                     "prompt_logprobs"),
                            stop_token_ids=list(body.stop_token_ids or []), logit_bias=logit_bias(body, vocab_size),
                            allowed_token_ids=body.allowed_token_ids, logprob_token_ids=body.logprob_token_ids, **kw)
    try:
        params.validate(vocab_size, max_logprobs)
    except ValueError as exc:
        message = str(exc)
        raise ApiError(400, message, param=message.split(" ", 1)[0], code="invalid_value") from None
    return params


def structured_outputs(body: SamplingFields) -> StructuredOutputs | None:
    """The constraint response_format or structured_outputs asks for (None for none or type "text"); 400 when
    the field is malformed or both are given."""
    rf, so = body.response_format, body.structured_outputs
    kind = None if rf is None else rf.get("type", "text")
    if kind not in (None, "text") and so is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both", param="structured_outputs",
                       code="invalid_value")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema (an object)",
                           param="response_format", code="invalid_value")
        return StructuredOutputs(json=schema)
    if kind not in (None, "text"):
        raise ApiError(400, f"response_format type must be text, json_object or json_schema (got {kind!r})",
                       param="response_format", code="invalid_value")
    if so is None:
        return None
    try:
        out = msgspec.convert(so, StructuredOutputs)
        out.validate()
    except (msgspec.ValidationError, ValueError) as exc:
        raise ApiError(400, f"structured_outputs: {exc}", param="structured_outputs", code="invalid_value") from None
    return out


seeded = seeded_for_choice  # a request's j-th choice: seed + j when seeded (ipc/sampling.py)


def check_count(count: int) -> None:
    """400 unless 1 <= n (times the prompts) <= MAX_CHOICES."""
    if not 1 <= count <= MAX_CHOICES:
        raise ApiError(400, f"n (times the number of prompts) must be in [1, {MAX_CHOICES}] (got {count})",
                       param="n", code="invalid_value")


def check_stream_options(body: SamplingFields) -> None:
    """400 for stream_options on a request that does not stream (as vLLM and OpenAI answer)."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options",
                       code="invalid_value")


def _num_logprobs(asked: int | None, vocab_size: int, cap: int, name: str = "logprobs") -> int | None:
    """A logprobs count (name: logprobs or prompt_logprobs): -1 is the whole vocabulary (vLLM's), and more than cap
    is a 400 saying so in vLLM's words."""
    if asked == -1:
        asked = vocab_size
    if asked is not None and asked > cap:
        kind = "sample" if name == "logprobs" else "prompt"
        raise ApiError(400, f"Requested {kind} logprobs of {asked}, which is greater than max allowed: {cap}",
                       param=name, code="invalid_value")
    return asked


def logit_bias(body: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """logit_bias with its keys (JSON's strings) as token ids; None when absent or empty; 400 naming every key that
    is not a token of the vocabulary (SamplingParams.validate checks the count and the values)."""
    if not body.logit_bias:
        return None
    out, bad = {}, []
    for key, value in body.logit_bias.items():
        token = int(key) if key.strip().lstrip("-").isdigit() else -1
        if not 0 <= token < vocab_size:
            bad.append(key)
        out[token] = value
    if bad:
        keys = ", ".join(repr(k) for k in bad)
        raise ApiError(400, f"logit_bias: {'keys' if len(bad) > 1 else 'key'} {keys} {'are' if len(bad) > 1 else 'is'} "
                       f"not a token id in the vocabulary [0, {vocab_size})", param="logit_bias", code="invalid_value")
    return out
