"""Every message that crosses a process boundary, as msgspec Structs (msgpack on the wire).

Client ↔ frontend messages are tagged by a "type" field (docs/protocol.md); frontend ↔ engine core
messages are tagged the same way on their own socket.
"""

from __future__ import annotations

import msgspec

from .beam_params import BeamSearchParams
from .pooling import PoolingParams
from .sampling import SamplingParams

# ---- client ↔ frontend ---------------------------------------------------------------


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's log-probability and, when asked, the top-N alternatives."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class _Keyed(msgspec.Struct, kw_only=True):
    """A client message: it carries the server's API key when the server was started with --api-key."""

    api_key: str | None = None


class Generate(_Keyed, tag="generate", kw_only=True):
    """Start a request. Exactly one of prompt (text) and token_ids is given."""

    id: str
    prompt: str | None = None
    token_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share KV blocks
    # An embeddings request: the prompt is pooled (sampling is ignored) and the one Delta carries its embedding.
    pooling: PoolingParams | None = None
    lora: str | None = None  # a LoRA adapter the server loaded (--lora-modules): the request runs with it
    # A beam search of the prompt (sampling gives only logprobs, its top-N per token, and priority): the one final
    # Delta carries beam.beam_width hypotheses in `beams`, best first.
    beam: BeamSearchParams | None = None
    # A client that may re-attach after losing its frontend names its session (a random string kept for its life):
    # the engine core then holds the request's outputs under (session, id) for a Resume (docs/protocol.md §5.6).
    session: str | None = None


class Resume(Generate, tag="resume", kw_only=True):
    """Re-attach to a request of the same session after the connection to the frontend was lost: the Generate as
    first sent, and how many of its output tokens the client has; the stream goes on from there."""

    offset: int = 0


class Abort(_Keyed, tag="abort", kw_only=True):
    """Stop a request; its stream ends with finish_reason "abort"."""

    id: str


class StatsQuery(_Keyed, tag="stats", kw_only=True):
    """Ask for the engine's counters."""

    id: str


class HealthQuery(_Keyed, tag="health", kw_only=True):
    """Ask for each process's pid, uptime, restarts and the last fault."""

    id: str


class ModelInfoQuery(_Keyed, tag="model_info", kw_only=True):
    """Ask what model is served: enough to validate requests and render chats on the client side."""

    id: str


class Admin(_Keyed, tag="admin", kw_only=True):
    """Worker control for fault tests (`metrale serve --enable-admin`): kill or restart a GPU worker.

    action "kill" sends the worker `signal` (KILL, TERM or STOP: STOP exercises the hung-worker detection);
    "restart" stops it (TERM, then KILL) and lets the supervisor start a new one. rank and replica name the worker
    (tensor- and data-parallel position); a server of one worker has rank 0 of replica 0 only.
    """

    id: str
    action: str  # "kill" | "restart"
    signal: str = "KILL"  # with "kill": KILL | TERM | STOP
    rank: int = 0
    replica: int = 0


ClientMessage = Generate | Resume | Abort | StatsQuery | HealthQuery | ModelInfoQuery | Admin


class BeamHypothesis(msgspec.Struct, array_like=True, omit_defaults=True):
    """One of a beam search's finished hypotheses (metrale/beam_search.py's BeamSearchSequence): its generated ids (the
    eos that ended it only with include_stop_str_in_output), one TokenLogprob per id, their log-probability sum, the score that ranked it, and "stop" (it ended in
    an eos) or "length"."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    cum_logprob: float
    score: float
    finish_reason: str


class Delta(msgspec.Struct, tag="delta", kw_only=True, omit_defaults=True):
    """New output of a request. The last delta of a request has a finish_reason."""

    id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int | None = None  # on the last delta
    completion_tokens: int | None = None  # on the last delta
    cached_tokens: int | None = None  # on the last delta: prompt tokens the prefix cache held
    # With sampling.prompt_logprobs, on the first delta with tokens (once per request): entry i is prompt token i's
    # log-probability given those before it, with the top-N alternatives; None first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embeddings request's vector (Generate.pooling), on its one delta
    queued_s: float | None = None  # on the last delta: how long the engine core held it before its first step
    beams: list[BeamHypothesis] | None = None  # a beam search's (Generate.beam) hypotheses, best first, on its one delta


class Error(msgspec.Struct, tag="error", kw_only=True):
    """A request failed (or a frame was rejected). id is "" when none could be read."""

    id: str
    code: str  # an ErrorCode value (ipc/errors.py; docs/protocol.md §4.1)
    message: str


class WorkerRecovery(msgspec.Struct, kw_only=True):
    """The engine core's last replacement of a lost worker, and what it cost the requests it was running."""

    cause: str  # why the worker was lost
    lost_at: float  # unix time the fault began (for a hung worker: when its stuck step started)
    requests: int = 0  # requests it was running, requeued (--on-worker-fault recover) or failed
    ready_s: float | None = None  # from the fault to the new worker's readiness
    resumed_s: float | None = None  # from the fault to the first token of a resumed request (None: none yet)


class EngineStats(msgspec.Struct, kw_only=True):
    """The engine core's counters, for the stats request and LLM.stats()."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_free: int = 0
    prefix_cache_hit_rate: float = 0.0
    preemptions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    steps: int = 0
    generated_tokens: int = 0
    worker_busy_s: float = 0.0  # the worker's time executing steps, since it started
    worker_idle_s: float = 0.0  # the worker's time waiting for the engine core's next plan
    prefix_cache_hit_tokens: int = 0  # prompt tokens found in the prefix cache (hit rate = hits / queried)
    prefix_cache_queried_tokens: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    spec_accepted_tokens: int = 0  # ... and kept (the acceptance rate is their ratio)
    # RepickOnly repairs: tokens the device picked again from a step's kept logits (a recurrent model's step
    # launched ahead whose mask went stale).
    repicks: int = 0
    worker_recoveries: int = 0  # workers this engine core lost and replaced
    kernels: str = ""  # the worker's kernels (ModelInfo.kernels): a CPU's instruction-set class, "torch" or "cuda"
    last_worker_recovery: WorkerRecovery | None = None
    # Data parallel: the frontend's sums over every replica hold each replica's own counters here, in order.
    replicas: list[EngineStats] = []


class FrontendStats(msgspec.Struct, kw_only=True):
    """What the frontend measured: latency percentiles over its recent window, and the prompt tokens it admitted."""

    window_s: float = 0.0  # the span the percentiles cover (up to a minute)
    ttft_samples: int = 0
    itl_samples: int = 0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    itl_p50_s: float = 0.0
    itl_p99_s: float = 0.0
    prompt_tokens: int = 0  # since the frontend started


class Stats(msgspec.Struct, tag="stats_reply", kw_only=True):
    """Answer to StatsQuery."""

    id: str
    stats: EngineStats
    frontend: FrontendStats | None = None  # None from a frontend that measures none


class ProcessHealth(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str  # frontend | engine_core | gpu_worker
    pid: int
    uptime_s: float
    restarts: int
    alive: bool
    replica: int = 0  # the data-parallel replica an engine core or worker belongs to
    rank: int = 0  # a worker's tensor-parallel rank


class Health(msgspec.Struct, tag="health_reply", kw_only=True):
    """Answer to HealthQuery."""

    id: str
    healthy: bool  # every process alive, the engine ready and making progress
    processes: list[ProcessHealth] = []
    last_fault: str | None = None
    ready: bool = True  # an engine core is up and the server takes requests
    waiting_for: str | None = None  # why it is not healthy now: what it waits for
    progress_s: float = 0.0  # seconds since the engine core last reported progress, while requests are live
    replicas_ready: list[bool] = []  # which replicas can run a step now (engine core up, its worker serving), in order


class ModelInfoReply(msgspec.Struct, tag="model_info_reply", kw_only=True):
    """Answer to ModelInfoQuery."""

    id: str
    model: str  # the served model's name
    architecture: str
    vocab_size: int
    max_model_len: int  # prompt + output tokens at most
    eos_token_ids: list[int] = []
    bos_token_id: int | None = None
    chat_template: str | None = None  # Jinja, as the model ships it (None: the model has none)


class AdminReply(msgspec.Struct, tag="admin_reply", kw_only=True):
    """Answer to Admin: what was done (the supervisor's words) and to which process."""

    id: str
    pid: int  # the worker process that was signalled
    detail: str


ServerMessage = Delta | Error | Stats | Health | ModelInfoReply | AdminReply

# ---- frontend ↔ engine core ----------------------------------------------------------


class GrammarBlob(msgspec.Struct, kw_only=True):
    """A request's grammar as the frontend compiled it (params.structured_outputs): xgrammar's serialized
    CompiledGrammar, and the digest of what it was compiled from (the engine core keeps one copy per key)."""

    key: str
    data: str


class GrammarVocab(msgspec.Struct, tag="grammar_vocab", kw_only=True):
    """The vocabulary as xgrammar sees it: the frontend sends it before the first AddRequest with a grammar to
    each engine core it talks to (the engine core has no tokenizer); its grammars are compiled against it."""

    digest: str  # of the fields below: a repeat with the same digest changes nothing
    encoded_vocab: list[str]  # token strings by id, as the tokenizer's vocabulary spells them
    vocab_type: int  # xgrammar's VocabType: 0 raw, 1 byte fallback, 2 byte level
    add_prefix_space: bool
    vocab_size: int  # the model's (its logits' width)
    stop_token_ids: list[int]


class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    """A tokenized request for the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Tokens already streamed to the client (resubmission after an engine-core restart).
    output_token_ids: list[int] = []
    cache_salt: str | None = None
    grammar: GrammarBlob | None = None  # with params.structured_outputs
    pooling: PoolingParams | None = None  # an embeddings request: its prompt is pooled, nothing is generated
    lora: str | None = None  # the LoRA adapter its rows run with (EngineOptions.lora_modules' name)
    beam: BeamSearchParams | None = None  # a beam search (Generate.beam): EngineCore.add_beam_request
    # Held under this key for a frontend that re-attaches after a restart (engine_core/output_ledger.py).
    resume_key: str | None = None
    # Re-attach to the request held under resume_key (its outputs so far come at once): "or_start" runs this one
    # when none is held, "only" refuses it (resume_lost); None: a new request.
    reattach: str | None = None


class AbortRequest(msgspec.Struct, tag="abort_req", kw_only=True):
    request_ids: list[str]


class StatsRequest(msgspec.Struct, tag="stats_req", kw_only=True):
    id: str


class LoraUpdate(msgspec.Struct, tag="lora_update", kw_only=True):
    """Load the PEFT adapter at path under name into a free LoRA slot (EngineCore.load_lora), or, path "", unload
    name; answered by LoraUpdated with the same id."""

    id: str
    name: str
    path: str = ""


class LoraUpdated(msgspec.Struct, tag="lora_updated", kw_only=True):
    """A LoraUpdate done (error None), or refused (why)."""

    id: str
    error: str | None = None


class FrontendUp(msgspec.Struct, tag="frontend_up", kw_only=True):
    """A frontend took this engine core (sent on each EngineReady or adoption): its engine ids start with prefix + "-".
    The requests of the frontends before it are aborted, or held for re-attachment when resumable."""

    prefix: str


EngineInput = AddRequest | AbortRequest | StatsRequest | GrammarVocab | LoraUpdate | FrontendUp


class RequestOutputDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request in one tick."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # with finish_reason "error": what went wrong
    error_code: str | None = None  # with finish_reason "error": an ErrorCode value (ipc/errors.py)
    num_cached_tokens: int | None = None  # on a request's first delta and its last: prompt tokens the prefix cache held
    # With SamplingParams.prompt_logprobs, on the delta with its first tokens: entry i is prompt token i's (None first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embeddings request's vector, on its last delta
    queued_s: float | None = None  # with num_cached_tokens: seconds from its arrival here to its first admission
    # A beam search's (AddRequest.beam), on its one delta: its beam_width hypotheses, best first (no new_token_ids).
    beams: list[BeamHypothesis] | None = None


class EngineLoad(msgspec.Struct, array_like=True):
    """How busy an engine core is (for the frontend's routing between data-parallel replicas)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


class EngineOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    """Everything one tick produced (and, under data parallel, the engine core's load after it)."""

    outputs: list[RequestOutputDelta] = []
    load: EngineLoad | None = None


class WorkerLost(msgspec.Struct, tag="worker_lost", kw_only=True):
    """The engine core's worker (group) died: its requests wait for a new one (the frontend of several replicas
    moves them to another at once)."""

    why: str = ""


class WorkerBack(msgspec.Struct, tag="worker_back", kw_only=True):
    """The engine core serves again after a WorkerLost (its new worker is ready)."""


class StatsResponse(msgspec.Struct, tag="stats_resp", kw_only=True):
    id: str
    stats: EngineStats


class EngineReady(msgspec.Struct, tag="ready", kw_only=True):
    """The engine core (and its worker) are ready; sent once per engine-core start."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int


EngineOutput = EngineOutputs | StatsResponse | EngineReady | WorkerLost | WorkerBack | LoraUpdated
