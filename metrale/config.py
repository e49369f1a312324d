"""The knobs, one struct for each audience: EngineArgs (model + engine, shared by LLM and serve) and ServeConfig.

They are msgspec Structs so the supervisor hands them to its child processes as JSON, never pickle.
"""

from __future__ import annotations

import msgspec

# --quantization: None follows the checkpoint (a GGUF's Q8_0 / 4-bit layers stay quantized, a Hugging Face one is
# dense); "none" makes every linear layer dense; int8 / int4 quantize every one at load; "-dequantized": the same
# quantized weights multiplied dense (the reference the quantized kernels are checked against).
QUANTIZATIONS = ("none", "int8", "int4", "int8-dequantized", "int4-dequantized")


class EngineArgs(msgspec.Struct, kw_only=True):
    """What model to load and how the engine core schedules it. Same names in LLM(...) and `metrale serve`."""

    model: str | None = None  # a Hugging Face folder or a GGUF file; None = the built-in tiny demo model
    max_model_len: int | None = None  # cap on prompt + output; None: what the model's config allows
    dtype: str = "auto"  # auto | float32 | bfloat16
    quantization: str | None = None  # see QUANTIZATIONS
    device: str | None = None  # cuda when present, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; the worker picks num_kv_blocks from it
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 4096
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap": preempted KV goes to host memory while it fits
    swap_space_gb: float = 4.0  # host memory for swapped KV, per worker
    pipeline: bool = True
    # Decode steps run eager: no decode graphs (graph_runner.py; captured on CUDA, where they are on by default).
    enforce_eager: bool = False
    # Most decode steps one tick runs for requests that report only at their finish (the offline LLM's),
    # where the model steps inline (LLM on a CPU): the host's tick is then paid once per burst. 1: off.
    decode_burst: int = 8
    seed: int | None = None
    show_progress: bool = True
    # torch threads of a serve worker on a CPU; None: one fewer than the cores (the engine core and the
    # frontend need the last one: a descheduled torch thread stalls every step).
    worker_threads: int | None = None
    # N worker ranks form one device (`metrale serve` and LLM): the model's layers are split across them.
    tensor_parallel_size: int = 1
    # `metrale serve` only: N engine cores, each with its own worker (group), behind one frontend.
    data_parallel_size: int = 1
    # How tensor-parallel ranks on one CPU host sum: auto (the shared-memory all-reduce), shm or gloo.
    all_reduce: str = "auto"
    # Speculative decoding: "ngram" (prompt lookup) drafts up to num_speculative_tokens tokens per decode, all
    # verified in one step (engine_core/speculative.py); None: off.
    speculative: str | None = None
    num_speculative_tokens: int = 3
    # Steps of this many running rows or more decode without drafts (vLLM's --speculative-disable-by-batch-size):
    # on a CPU a verify step's extra rows cost more than they save past a small batch. None: any batch.
    speculative_disable_by_batch_size: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first knob that cannot work."""
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16 (got {self.dtype!r})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "decode_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (got {self.quantization!r})")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap (got {self.preemption_mode!r})")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0 (got {self.swap_space_gb})")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 (got {self.num_kv_blocks})")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.all_reduce not in ("auto", "shm", "gloo"):
            raise ValueError(f"all_reduce must be auto, shm or gloo (got {self.all_reduce!r})")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative must be ngram or None (got {self.speculative!r})")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 2:
            raise ValueError("speculative_disable_by_batch_size must be at least 2 (got "
                             f"{self.speculative_disable_by_batch_size})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16] (got {self.num_speculative_tokens})")


    def runner_kwargs(self, model_dir: str) -> dict:
        """The model runner's keyword arguments (in-process for LLM, as JSON for a worker process)."""
        return {
            "model_dir": model_dir,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "device": self.device,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_memory": self.kv_cache_memory,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "show_progress": self.show_progress,
            "swap_space": int(self.swap_space_gb * 2**30) if self.preemption_mode == "swap" else 0,
            "max_model_len": self.max_model_len,
            "decode_graphs": False if self.enforce_eager else None,
        }


class ServeConfig(msgspec.Struct, kw_only=True):
    """`metrale serve`: the engine plus where and how the three processes talk."""

    engine: EngineArgs = msgspec.field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 7410
    http_port: int | None = None  # also serve the OpenAI-compatible HTTP API here
    run_dir: str = ""  # where the ipc:// sockets live (a fresh temp dir per serve)
    max_frame_bytes: int = 1 << 20
    on_worker_fault: str = "recover"  # recover | fail
    stream_interval: int = 1  # a request's tokens go out every this many (its first and last at once)
    shutdown_timeout_s: float = 0.0  # on SIGTERM / Ctrl-C, live requests get this long to finish
    worker_hang_timeout_s: float = 10.0  # the least time a step may take before its worker counts as hung
    grammar_timeout_s: float = 10.0  # a structured_outputs grammar that takes longer to compile is a 400
    tool_call_parser: str = "hermes"  # how chat outputs become tool_calls: hermes (Qwen's <tool_call>) or llama3_json
    # Several hosts: node 0 runs the frontend; the nodes meet at node 0's master address (a torch.distributed
    # TCP store there). See metrale/node_layout.py for what each node runs.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Clients must send it (frontend/api_key.py). Only the frontend learns it, through its environment: the
    # supervisor leaves it out of the engine core's command line (ServeConfig travels there as JSON).
    api_key: str | None = None
    # Admin requests (worker kill / restart, metrale/worker_control.py): refused unless enabled, and from a
    # non-loopback peer unless admin_allow_remote.
    enable_admin: bool = False
    admin_allow_remote: bool = False
    served_model_names: list[str] = []  # the names clients give the model (default: its folder's name)
    chat_template: str | None = None  # a file or inline Jinja in place of the model's template
    generation_config: str = "auto"  # auto | vllm | a folder: HTTP requests' sampling defaults
    disable_log_requests: bool = False  # no access-log line per HTTP request
    enable_force_include_usage: bool = False  # every HTTP stream ends with its usage (vLLM's flag)
