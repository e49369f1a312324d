"""SamplingParams: what a request asks of the sampler, validated once at the edge."""

from __future__ import annotations

import json as _json

import msgspec

# --max-logprobs' default (vLLM's), and the most prompt logprobs per token a worker reports (its plan check holds
# them to this whatever the flag: a larger --max-logprobs widens sample logprobs only).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 32
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # lower runs first and may preempt higher; any client may set it
MAX_GRAMMAR_CHARS = 65536  # a schema, regex or grammar's text (a choice list's, as JSON)
MAX_CHOICES = 256
MAX_LOGIT_BIAS = 300  # ids one request may bias (OpenAI's limit)
MAX_BAD_WORDS = 24  # bad_words_token_ids sequences: with EOS and stop ids their bans fit a plan row's ban list
MAX_BAD_WORD_TOKENS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # allowed_token_ids' length (a bitmask holds any set: this bounds the message only)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range of a bias value


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on the whole output (vLLM's StructuredOutputsParams): exactly one field is set.

    json: a JSON schema (an object, or its text); json_object: any JSON object; regex: a regular expression the
    output matches; choice: the output is one of these strings; grammar: an EBNF grammar (xgrammar's dialect,
    rule `root`). Compiled by the frontend (docs/protocol.md), applied to every pick as a token mask."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kind_and_spec(self) -> tuple[str, str]:
        """(kind, text) of the one constraint given: what the grammar compiler takes, and its cache key.

        A schema given as an object is written as compact JSON in its own key order (which is the order the
        output's properties follow)."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else _json_text(self.json)
            return "json", spec
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json_text(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        raise ValueError("structured_outputs needs one of json, json_object, regex, choice, grammar")

    def validate(self) -> None:
        """Raise ValueError unless exactly one constraint is set, within the size bounds."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) == 1, "structured_outputs", "must set exactly one of json, json_object, regex, choice, grammar", given)
        if self.choice is not None:
            _check(0 < len(self.choice) <= MAX_CHOICES and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", f"must be 1..{MAX_CHOICES} non-empty strings", self.choice[:4])
        kind, spec = self.kind_and_spec()
        _check(len(spec) <= MAX_GRAMMAR_CHARS, f"structured_outputs.{kind}", f"must have at most {MAX_GRAMMAR_CHARS} characters", len(spec))
        _check(kind not in ("regex", "grammar") or bool(spec), f"structured_outputs.{kind}", "must not be empty", spec)


def _json_text(value: object) -> str:
    """Compact JSON, keys in their order."""
    return _json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick each new token. Field names and defaults follow vLLM's SamplingParams."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    seed: int | None = None  # batch-invariant: noise is a function of (seed, position)
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop ids are banned until this many tokens exist
    logprobs: int | None = None  # top-N logprobs per token (0 = only the sampled token's)
    # Each prompt token's log-probability given the ones before it, with the top-N alternatives (0: its own only),
    # reported once with the first output (vLLM's prompt_logprobs). Such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    max_thinking_tokens: int | None = None  # after this many thinking tokens, force the think-end token
    adaptive_sampling: bool = False  # greedy inside a code fence or a tool call
    priority: int = 0  # lower runs first (vLLM's convention); FCFS among equals
    structured_outputs: StructuredOutputs | None = None  # a grammar the output follows (JSON schema, regex, ...)
    # Added to the named tokens' logits before every other stage (penalties, bans, temperature), as vLLM's
    # logits processor does; logprobs stay those of the raw logits. -100 all but bans a token, +100 all but forces it.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: every pick is among these ids (the others' logits are -inf for the pick, set where a
    # grammar's mask is, after logit_bias and penalties, before bans, temperature and the filters; logprobs stay the
    # raw logits'). Rides the plan as a static bitmask row (step_builder.py).
    allowed_token_ids: list[int] | None = None
    # vLLM's logprob_token_ids: each output token's logprobs list these ids (raw logits, in this order) in place of
    # the top-N; at most the server's max_logprobs of them (the ticket ring's alternatives per row).
    logprob_token_ids: list[int] | None = None
    # vLLM's bad_words as the token sequences it bans (the frontend tokenizes HTTP's bad_words: frontend/bad_words.py):
    # a one-token sequence is never picked; a longer one's last token is banned while the output ends with the
    # tokens before it.
    bad_words_token_ids: list[list[int]] | None = None
    # Samples per prompt (the offline LLM; over HTTP the body's `n`). Sample j runs with seed + j when seeded
    # (seeded_for_choice), so they differ yet repeat; greedy samples are copies. A ZMQ request is one sample.
    n: int = 1

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax."""
        return self.temperature == 0.0

    @property
    def num_logprobs(self) -> int | None:
        """The alternatives each output token's logprobs list (vLLM's num_logprobs): len(logprob_token_ids) when
        given (those ids), else logprobs; None: no logprobs are reported."""
        return len(self.logprob_token_ids) if self.logprob_token_ids is not None else self.logprobs

    @property
    def has_penalties(self) -> bool:
        """True when the sampler needs the row's token history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raise ValueError naming the first field whose value the engine cannot serve. max_logprobs: the server's
        --max-logprobs as a count (logprobs_cap)."""
        prompt_cap = max_logprobs
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1", self.max_tokens)
        _check(_finite(self.temperature) and self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer", self.top_k)
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        _check(_finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(_finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed", "must be an integer in [0, 2**63)", self.seed)
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings", len(self.stop))
        _check(all(0 < len(s) <= MAX_STOP_STRING_LEN for s in self.stop), "stop", f"each stop string must have 1..{MAX_STOP_STRING_LEN} characters", self.stop)
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids))
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]", self.min_tokens)
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= max_logprobs), "logprobs", f"must be in [0, {max_logprobs}]", self.logprobs)
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= prompt_cap),
               "prompt_logprobs", f"must be in [0, {prompt_cap}]", self.prompt_logprobs)
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        lo, hi = PRIORITY_RANGE
        _check(isinstance(self.priority, int) and lo <= self.priority <= hi, "priority", f"must be an integer in [{lo}, {hi}]", self.priority)
        _check(self.max_thinking_tokens is None or (isinstance(self.max_thinking_tokens, int) and self.max_thinking_tokens >= 0), "max_thinking_tokens", "must be >= 0", self.max_thinking_tokens)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if self.logit_bias:
            self._validate_logit_bias(vocab_size)
        where = "[0, ...)" if vocab_size is None else f"[0, {vocab_size})"
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids",
                   f"must list 1 to {MAX_ALLOWED_TOKEN_IDS} token ids", len(ids))
            bad = _outside(ids, vocab_size)
            _check(not bad, "allowed_token_ids", f"ids must be token ids of the vocabulary {where}", bad[:8])
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            _check(len(words) <= MAX_BAD_WORDS, "bad_words", f"at most {MAX_BAD_WORDS} token sequences", len(words))
            _check(all(0 < len(w) <= MAX_BAD_WORD_TOKENS for w in words), "bad_words",
                   f"each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens", [len(w) for w in words])
            bad = _outside([t for w in words for t in w], vocab_size)
            _check(not bad, "bad_words", f"ids must be token ids of the vocabulary {where}", bad[:8])
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            _check(0 < len(ids) <= max(max_logprobs, 0) and len(set(ids)) == len(ids), "logprob_token_ids",
                   f"must list 1 to {max_logprobs} distinct token ids (the server's max_logprobs)", len(ids))
            bad = _outside(ids, vocab_size)
            _check(not bad, "logprob_token_ids", f"ids must be token ids of the vocabulary {where}", bad[:8])
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            _check(not bad, "stop_token_ids", f"ids must be in [0, {vocab_size})", bad)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        """Raise ValueError naming the first id of logit_bias that is not a token (of the vocabulary, when known)
        or whose value is outside LOGIT_BIAS_RANGE."""
        bias = self.logit_bias
        _check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"must map at most {MAX_LOGIT_BIAS} token ids to biases", len(bias))
        lo, hi = LOGIT_BIAS_RANGE
        where = "[0, ...)" if vocab_size is None else f"[0, {vocab_size})"
        for token, value in bias.items():
            inside = isinstance(token, int) and token >= 0 and (vocab_size is None or token < vocab_size)
            _check(inside, "logit_bias", f"ids must be token ids of the vocabulary {where}", token)
            if not (_finite(value) and lo <= value <= hi):
                raise ValueError(f"logit_bias values must be in [{lo:g}, {hi:g}] (got {value!r} for token id {token})")


def seeded_for_choice(params: SamplingParams, j: int) -> SamplingParams:
    """The params of a request's j-th sample (choice): one sample, with seed + j when seeded (so n samples differ
    yet repeat); j 0 keeps the request's own seed."""
    if params.n != 1:
        params = msgspec.structs.replace(params, n=1)
    if j == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + j) % 2**63)


def _outside(ids: list[int], vocab_size: int | None) -> list:
    """The entries of ids that are not token ids (of a vocabulary of vocab_size, when known)."""
    return [i for i in ids if not (isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                   and (vocab_size is None or i < vocab_size))]


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    """--max-logprobs as the most alternatives a token may list: -1 is the whole vocabulary."""
    return vocab_size if max_logprobs == -1 else max_logprobs


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} {rule} (got {value!r})")
