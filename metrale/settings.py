"""Every setting, defined once: its name, type, default, help, vLLM's flag and the process views it reaches.

Derived from this table: `metrale serve`'s options (metrale/cli.py, in this order), the fields and defaults of
EngineArgs and ServeConfig (metrale/config.py), and so LLM(...)'s keywords. The per-process views read their
defaults from DEFAULTS: EngineOptions and SchedulerConfig (engine core), the ModelRunner's keywords (worker) and
FrontendConfig (frontend). tests/test_settings.py holds every one of them to the table.

Nothing here imports more than the standard library: the engine core and the frontend read it too.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

# The process views a setting reaches (Setting.reaches):
#   supervisor   read off ServeConfig by the supervisor or a process's main (ports, ranks, threads, hang watch)
#   frontend     FrontendConfig (frontend/server.py)
#   engine_core  EngineOptions (engine_core/engine.py)
#   scheduler    SchedulerConfig (engine_core/scheduler.py)
#   runner       the ModelRunner's keywords (gpu_worker/model_runner.py; EngineArgs.runner_kwargs)
# A view that takes it under another name or unit says so after a colon ("runner:swap_space"); the default of a
# view's field of the setting's own name must be the table's.
VIEWS = ("supervisor", "frontend", "engine_core", "scheduler", "runner")

# --quantization: None follows the checkpoint (a GGUF's Q8_0 / 4-bit layers stay quantized, a Hugging Face one is
# dense); "none" makes every linear layer dense; int8 / int4 quantize every one at load; "-dequantized": the same
# quantized weights multiplied dense (the reference the quantized kernels are checked against).
QUANTIZATIONS = ("none", "int8", "int4", "int8-dequantized", "int4-dequantized")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
# vLLM's (and torch's) other names for two of them: `--dtype half` is what vLLM's own tests pass.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
ALL_REDUCE_CHOICES = ("auto", "shm", "gloo")  # how tensor-parallel ranks on one CPU host sum


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting. `scope` says whose field it is: "engine" (EngineArgs: LLM(...) and serve) or "serve"
    (ServeConfig: `metrale serve` only)."""

    name: str  # the field's name in EngineArgs / ServeConfig, LLM's keyword
    type: Any  # the field's type
    default: Any
    help: str  # the flag's help (`metrale serve --help`), or what it does where there is no flag
    scope: str  # "engine" | "serve"
    reaches: tuple[str, ...] = ()  # VIEWS, "view:other_name" where the view renames or converts it
    flag: str | None = None  # `metrale serve`'s flag; None: LLM(...) only
    vllm: str | None = None  # vLLM's flag for the same value, where it has one
    aliases: tuple[str, ...] = ()  # short flags (-tp)
    choices: tuple[str, ...] | None = None
    min: float | None = None  # the flag's range (checked by click)
    max: float | None = None
    flag_type: Any = None  # the flag's type where it differs from the field's (a float for 2e9 bytes)
    from_flag: Callable[[Any], Any] | None = None  # the flag's value to the field's (None: as it is)
    metavar: str | None = None
    envvar: tuple[str, ...] = ()
    multiple: bool = False  # the flag may be repeated; the field is the list

    @property
    def is_switch(self) -> bool:
        """A bool field: its flag takes no value and sets the opposite of the default (--no-pipeline)."""
        return self.type is bool

    def value(self, given: Any) -> Any:
        """The field's value for what the flag's click option parsed."""
        if self.is_switch:
            return (not self.default) if given else self.default
        return self.from_flag(given) if self.from_flag is not None else given

    @property
    def base_type(self) -> type:
        """The field's type without None (int for `int | None`)."""
        if isinstance(self.type, types.UnionType) or typing.get_origin(self.type) is typing.Union:
            return next(t for t in typing.get_args(self.type) if t is not type(None))
        return typing.get_origin(self.type) or self.type


def _bytes_or_none(v: float | None) -> int | None:
    return int(v) if v else None


S = Setting
# In `metrale serve --help`'s order; settings without a flag at the end.
SETTINGS: tuple[Setting, ...] = (
    S("model", str | None, None, "Hugging Face model folder or GGUF file (default: the built-in tiny demo model).",
      "engine", ("supervisor", "frontend:model_dir", "runner:model_dir"), flag="--model", vllm="--model"),
    S("host", str, "127.0.0.1", "address to bind the ZMQ and HTTP ports on (loopback unless told otherwise).",
      "serve", ("supervisor", "frontend:http_host"), flag="--host", vllm="--host"),
    # vLLM's --port is its HTTP port: metrale's is --http-port.
    S("port", int, 7410, "ZMQ client port (0: any free port).", "serve", ("supervisor", "frontend:client_address"),
      flag="--port"),
    S("http_port", int | None, None, "also serve the OpenAI-compatible HTTP API on this port.", "serve",
      ("frontend",), flag="--http-port"),
    # No range here: the supervisor checks it, so a bad value is one line (exit 2) like every start-up mistake.
    S("api_server_count", int, 1,
      "frontend processes (API servers) sharing the HTTP port (SO_REUSEPORT), each linked to every engine core; "
      "frontend i takes ZMQ clients on --port + i.", "serve", ("supervisor", "frontend"),
      flag="--api-server-count", vllm="--api-server-count", aliases=("-asc",)),
    S("dtype", str, "auto", "weights' and activations' dtype (auto: the checkpoint's, bfloat16 for a quantized GGUF).",
      "engine", ("runner",), flag="--dtype", vllm="--dtype", choices=DTYPES),
    S("quantization", str | None, None,
      "int8 / int4: quantize every linear layer at load (weight-only); none: all dense "
      "(default: as the checkpoint is; a GGUF's Q8_0 and 4-bit layers stay quantized).",
      "engine", ("runner",), flag="--quantization", vllm="--quantization", choices=QUANTIZATIONS),
    S("device", str | None, None, "cuda or cpu (default: cuda when present).", "engine", ("runner",),
      flag="--device", vllm="--device"),
    # vLLM's default is 256 (V1 on a GPU); metrale's flag has said 64 since it was added.
    S("max_num_seqs", int, 64, "requests running at once, at most.", "engine", ("engine_core", "scheduler", "runner"),
      flag="--max-num-seqs", vllm="--max-num-seqs"),
    S("max_num_batched_tokens", int, 2048, "tokens one step runs, at most (prefill chunks and decodes together).",
      "engine", ("engine_core", "scheduler"), flag="--max-num-batched-tokens", vllm="--max-num-batched-tokens"),
    S("block_size", int, 16, "tokens per KV-cache block.", "engine", ("runner",), flag="--block-size",
      vllm="--block-size"),
    S("num_kv_blocks", int | None, None,
      "KV-cache blocks (default: from --kv-cache-memory, else what the device's memory allows).",
      "engine", ("runner",), flag="--num-kv-blocks", vllm="--num-gpu-blocks-override"),
    S("kv_cache_memory", int | None, None, "bytes of KV cache (e.g. 2e9).", "engine", ("runner",),
      flag="--kv-cache-memory", vllm="--kv-cache-memory-bytes", flag_type=float, from_flag=_bytes_or_none),
    S("max_waiting", int, 4096, "requests queued beyond the running ones, at most; more are refused as busy.",
      "engine", ("engine_core", "scheduler"), flag="--max-waiting"),
    S("enable_prefix_caching", bool, True, "do not reuse the KV blocks of earlier requests' prefixes.", "engine",
      ("engine_core",), flag="--no-prefix-caching", vllm="--no-enable-prefix-caching"),
    S("preemption_mode", str, "recompute",
      "when the KV cache runs dry: drop a request's blocks and recompute them later, or swap them to host memory.",
      "engine", ("engine_core", "scheduler", "runner:swap_space"), flag="--preemption-mode", vllm="--preemption-mode",
      choices=("recompute", "swap")),
    S("swap_space_gb", float, 4.0, "GiB of host memory for swapped-out KV.", "engine", ("runner:swap_space",),
      flag="--swap-space", vllm="--swap-space"),
    S("pipeline", bool, True, "run the synchronous loop instead of the pipelined decode lane.", "engine",
      ("engine_core",), flag="--no-pipeline"),
    S("enforce_eager", bool, False, "no decode graphs (CUDA graphs on a GPU): every step runs eager.", "engine",
      ("runner:decode_graphs",), flag="--enforce-eager", vllm="--enforce-eager"),
    S("on_worker_fault", str, "recover",
      "when the worker dies: resume its requests on the new one, or fail them with worker_fault.", "serve",
      ("supervisor",), flag="--on-worker-fault", choices=("recover", "fail")),
    S("max_frame_bytes", int, 1 << 20, "largest ZMQ request frame (and HTTP body) taken; larger ones are too_long.",
      "serve", ("frontend",), flag="--max-frame-bytes"),
    S("stream_interval", int, 1,
      "send a request's tokens every N tokens (its first and last at once): less CPU per token, burstier streams.",
      "serve", ("frontend", "engine_core"), flag="--stream-interval", vllm="--stream-interval", min=1),
    S("max_logprobs", int, 20,
      "the most alternatives a token's logprobs may list (logprobs, top_logprobs, prompt_logprobs); -1: the "
      "whole vocabulary. The ticket ring holds this many per token, so a large value costs shared memory.",
      "engine", ("engine_core", "frontend", "runner"), flag="--max-logprobs", vllm="--max-logprobs", min=-1),
    S("seed", int | None, None, "the engine's seed (requests without one of their own).", "engine", ("engine_core",),
      flag="--seed", vllm="--seed"),
    S("worker_threads", int | None, None,
      "torch threads of the worker on a CPU (default: cores - 1, or every core on a box of two or fewer).",
      "engine", ("supervisor",), flag="--worker-threads"),
    S("max_model_len", int | None, None, "cap on prompt + output tokens (default: what the model's config allows).",
      "engine", ("runner", "supervisor", "frontend"), flag="--max-model-len", vllm="--max-model-len", min=2),
    S("shutdown_timeout_s", float, 0.0,
      "on Ctrl-C / SIGTERM, let live requests finish for up to this many seconds (new ones get 503 / shutdown).",
      "serve", ("frontend",), flag="--shutdown-timeout", min=0),
    S("worker_hang_timeout_s", float, 10.0,
      "a worker whose step runs this long (and far longer than its recent steps) is killed as hung and restarted.",
      "serve", ("supervisor:HangWatch.floor_s",), flag="--worker-hang-timeout", min=0.1),
    S("frontend_hang_timeout_s", float, 15.0,
      "a frontend whose event loop has not turned for this long (stopped, stuck) is killed as hung and restarted.",
      "serve", ("supervisor:FrontendHangWatch.timeout_s",), flag="--frontend-hang-timeout", min=1.0),
    S("tensor_parallel_size", int, 1,
      "worker ranks that split the model's layers and form one device (torch.distributed).",
      "engine", ("supervisor",), flag="--tensor-parallel-size", vllm="--tensor-parallel-size", aliases=("-tp",), min=1),
    S("data_parallel_size", int, 1,
      "engine replicas (each with its own worker ranks) behind the one frontend, routed by load and prefix.",
      "engine", ("supervisor",), flag="--data-parallel-size", vllm="--data-parallel-size", aliases=("-dp",), min=1),
    S("all_reduce", str, "auto", "how tensor-parallel ranks on one CPU host sum: shared memory (auto) or gloo.",
      "engine", ("supervisor",), flag="--all-reduce", choices=ALL_REDUCE_CHOICES),
    S("nnodes", int, 1, "hosts this server spans (run `metrale serve` on each, with its --node-rank).", "serve",
      ("supervisor",), flag="--nnodes", vllm="--nnodes", min=1),
    S("node_rank", int, 0, "this host's place among --nnodes (node 0 runs the frontend).", "serve", ("supervisor",),
      flag="--node-rank", vllm="--node-rank", min=0),
    S("master_addr", str, "127.0.0.1", "node 0's address, where the nodes meet (a torch.distributed TCP store).",
      "serve", ("supervisor",), flag="--master-addr", vllm="--master-addr"),
    S("master_port", int, 29500,
      "the store's port on node 0; replicas on other nodes also use the ports just above it.",
      "serve", ("supervisor",), flag="--master-port", vllm="--master-port"),
    S("grammar_timeout_s", float, 10.0,
      "seconds a structured_outputs grammar may take to compile; longer (or invalid) is a 400 for that request.",
      "serve", ("frontend",), flag="--grammar-timeout", min=0.01),
    S("tool_call_parser", str, "hermes",
      "how chat outputs are parsed into tool_calls: Hermes/Qwen <tool_call> JSON, or Llama 3 JSON.", "serve",
      ("frontend",), flag="--tool-call-parser", vllm="--tool-call-parser", choices=("hermes", "llama3_json")),
    # vLLM says it as --speculative-config '{"method": "ngram", ...}'.
    S("speculative", str | None, None,
      "speculative decoding: ngram drafts tokens by prompt lookup, verified in one step.",
      "engine", ("engine_core",), flag="--speculative", choices=("ngram",)),
    S("num_speculative_tokens", int, 3, "draft tokens per verify step (with --speculative).", "engine",
      ("engine_core",), flag="--num-speculative-tokens", vllm="--num-speculative-tokens", min=1, max=16),
    S("speculative_disable_by_batch_size", int | None, None,
      "with --speculative: steps of this many running requests or more decode without drafts.", "engine",
      ("engine_core",), flag="--speculative-disable-by-batch-size", vllm="--speculative-disable-by-batch-size", min=2),
    S("served_model_names", list[str], [],
      "a name clients give the model (repeat for several; /v1/models lists them, requests must name "
      "one, replies carry the first). Default: the model folder's name.", "serve", ("frontend",),
      flag="--served-model-name", vllm="--served-model-name", metavar="NAME", multiple=True, from_flag=list),
    S("chat_template", str | None, None, "a chat template (a file, or the Jinja itself) in place of the model's own.",
      "serve", ("frontend",), flag="--chat-template", vllm="--chat-template", metavar="FILE|JINJA"),
    S("generation_config", str, "auto",
      "HTTP requests' sampling defaults (temperature, top_p, top_k, min_p, penalties) for what they leave "
      "out: auto, the model's generation_config.json; vllm, none; or a folder holding one.", "serve", ("frontend",),
      flag="--generation-config", vllm="--generation-config", metavar="auto|vllm|FOLDER"),
    S("disable_log_requests", bool, False, "no access-log line per HTTP request.", "serve",
      ("frontend:log_requests",), flag="--disable-log-requests", vllm="--disable-log-requests"),
    S("enable_force_include_usage", bool, False,
      "every HTTP stream ends with its usage, as if it asked stream_options.include_usage.", "serve", ("frontend",),
      flag="--enable-force-include-usage", vllm="--enable-force-include-usage"),
    S("enable_per_request_metrics", bool, False,
      "whole HTTP answers of one choice (and a stream's usage chunk) carry vLLM's timing \"metrics\": queue, time "
      "to first token, generation, mean inter-token gap (ms), tokens per second.", "serve", ("frontend",),
      flag="--enable-per-request-metrics", vllm="--enable-per-request-metrics"),
    S("return_tokens_as_token_ids", bool, False,
      "HTTP logprobs name tokens \"token_id:N\" unless a request's return_tokens_as_token_ids says false.", "serve",
      ("frontend",), flag="--return-tokens-as-token-ids", vllm="--return-tokens-as-token-ids"),
    # Taken so vLLM's command lines start: metrale's usage always has prompt_tokens_details (OpenAI's shape).
    S("enable_prompt_tokens_details", bool, False,
      "vLLM's flag, accepted: every HTTP usage has prompt_tokens_details.cached_tokens, given or not.", "serve", (),
      flag="--enable-prompt-tokens-details", vllm="--enable-prompt-tokens-details"),
    # Only the frontend learns it, through its environment: the supervisor leaves it out of the engine core's
    # command line (ServeConfig travels there as JSON).
    S("api_key", str | None, None,
      "clients must send this key (HTTP: Authorization: Bearer KEY on /v1/*; ZMQ: api_key in each "
      "message); /health stays open.", "serve", ("frontend",), flag="--api-key", vllm="--api-key",
      envvar=("METRALE_API_KEY", "VLLM_API_KEY"), from_flag=lambda v: v or None),
    S("enable_admin", bool, False,
      "take admin requests (metrale worker kill / restart) from this machine: for fault tests.",
      "serve", ("supervisor", "frontend:admin_address"), flag="--enable-admin"),
    S("admin_allow_remote", bool, False,
      "with --enable-admin and a non-loopback --host: take admin requests from other machines too.", "serve",
      ("frontend",), flag="--admin-allow-remote"),
    S("enable_lora", bool, False, "serve LoRA adapters (--lora-modules): a request names one as its model.",
      "engine", ("runner",), flag="--enable-lora", vllm="--enable-lora"),
    S("lora_modules", list[str], [],
      "a LoRA adapter as NAME=PATH (a PEFT folder: adapter_config.json + adapter_model.safetensors); repeat for "
      "several. Each takes a slot of --max-loras, loaded at start-up.", "engine", ("engine_core", "runner", "frontend"),
      flag="--lora-modules", vllm="--lora-modules", metavar="NAME=PATH", multiple=True, from_flag=list),
    S("allow_runtime_lora_updating", bool, False,
      "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).",
      "serve", ("frontend",), flag="--allow-runtime-lora-updating"),
    S("max_loras", int, 1, "LoRA adapters held at once (their slots); rows of all of them run in one step.",
      "engine", ("runner",), flag="--max-loras", vllm="--max-loras", min=1),
    S("max_lora_rank", int, 16, "the largest LoRA rank an adapter may have.", "engine", ("runner",),
      flag="--max-lora-rank", vllm="--max-lora-rank", min=1),
    # LLM(...) only.
    S("decode_burst", int, 8,
      "most decode steps one tick runs for requests that report only at their finish (the offline LLM's), where "
      "the model steps inline (LLM on a CPU): the host's tick is then paid once per burst. 1: off.", "engine",
      ("engine_core",)),
    S("show_progress", bool, True, "a progress bar while the weights load.", "engine", ("runner",)),
)
del S

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
assert len(BY_NAME) == len(SETTINGS), "a setting is defined twice"

# Each setting's default by name (DEFAULTS.max_num_seqs): what the views' own fields and keywords default to.
DEFAULTS = types.SimpleNamespace(**{s.name: s.default for s in SETTINGS})


def of_scope(scope: str) -> tuple[Setting, ...]:
    """The settings that are fields of EngineArgs ("engine") or ServeConfig ("serve")."""
    return tuple(s for s in SETTINGS if s.scope == scope)


def struct_fields(scope: str) -> list[tuple[str, Any, Any]]:
    """(name, type, default) of each setting of a scope, as msgspec.defstruct takes them."""
    return [(s.name, s.type, s.default) for s in of_scope(scope)]
