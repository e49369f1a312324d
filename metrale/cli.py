"""The `metrale` command: serve, generate, status."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import sys
import time

import click
import msgspec

from metrale.config import QUANTIZATIONS, EngineArgs, ServeConfig
from metrale.ipc.sampling import SamplingParams


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(importlib.metadata.version("metrale"), "--version", "-V", prog_name="metrale",
                      help="print metrale's version and exit.")
def main() -> None:
    """metrale: an LLM serving engine."""


@main.command()
@click.option("--model", default=None, help="Hugging Face model folder or GGUF file (default: the built-in tiny demo model).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to bind the ZMQ and HTTP ports on (loopback unless told otherwise).")
@click.option("--port", default=7410, show_default=True, help="ZMQ client port (0: any free port).")
@click.option("--http-port", default=None, type=int, help="also serve the OpenAI-compatible HTTP API on this port.")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), show_default=True,
              help="weights' and activations' dtype (auto: the checkpoint's, bfloat16 for a quantized GGUF).")
@click.option("--quantization", default=None, type=click.Choice(QUANTIZATIONS),
              help="int8 / int4: quantize every linear layer at load (weight-only); none: all dense "
                   "(default: as the checkpoint is; a GGUF's Q8_0 and 4-bit layers stay quantized).")
@click.option("--device", default=None, help="cuda or cpu (default: cuda when present).")
@click.option("--max-num-seqs", default=64, show_default=True, help="requests running at once, at most.")
@click.option("--max-num-batched-tokens", default=2048, show_default=True,
              help="tokens one step runs, at most (prefill chunks and decodes together).")
@click.option("--block-size", default=16, show_default=True, help="tokens per KV-cache block.")
@click.option("--num-kv-blocks", default=None, type=int,
              help="KV-cache blocks (default: from --kv-cache-memory, else what the device's memory allows).")
@click.option("--kv-cache-memory", default=None, type=float, help="bytes of KV cache (e.g. 2e9).")
@click.option("--max-waiting", default=4096, show_default=True,
              help="requests queued beyond the running ones, at most; more are refused as busy.")
@click.option("--no-prefix-caching", is_flag=True, help="do not reuse the KV blocks of earlier requests' prefixes.")
@click.option("--preemption-mode", default="recompute", type=click.Choice(["recompute", "swap"]), show_default=True,
              help="when the KV cache runs dry: drop a request's blocks and recompute them later, or swap them to host memory.")
@click.option("--swap-space", default=4.0, show_default=True, help="GiB of host memory for swapped-out KV.")
@click.option("--no-pipeline", is_flag=True, help="run the synchronous loop instead of the pipelined decode lane.")
@click.option("--enforce-eager", is_flag=True, help="no decode graphs (CUDA graphs on a GPU): every step runs eager.")
@click.option("--on-worker-fault", default="recover", type=click.Choice(["recover", "fail"]), show_default=True,
              help="when the worker dies: resume its requests on the new one, or fail them with worker_fault.")
@click.option("--max-frame-bytes", default=1 << 20, show_default=True,
              help="largest ZMQ request frame (and HTTP body) taken; larger ones are too_long.")
@click.option("--stream-interval", default=1, type=click.IntRange(min=1), show_default=True,
              help="send a request's tokens every N tokens (its first and last at once): less CPU per token, burstier streams.")
@click.option("--seed", default=None, type=int, help="the engine's seed (requests without one of their own).")
@click.option("--worker-threads", default=None, type=int, help="torch threads of the worker on a CPU (default: cores - 1, or every core on a box of two or fewer).")
@click.option("--max-model-len", default=None, type=click.IntRange(min=2), help="cap on prompt + output tokens (default: what the model's config allows).")
@click.option("--shutdown-timeout", default=0.0, type=click.FloatRange(min=0), show_default=True,
              help="on Ctrl-C / SIGTERM, let live requests finish for up to this many seconds (new ones get 503 / shutdown).")
@click.option("--worker-hang-timeout", default=10.0, type=click.FloatRange(min=0.1), show_default=True,
              help="a worker whose step runs this long (and far longer than its recent steps) is killed as hung and restarted.")
@click.option("--tensor-parallel-size", "-tp", default=1, type=click.IntRange(min=1), show_default=True,
              help="worker ranks that split the model's layers and form one device (torch.distributed).")
@click.option("--data-parallel-size", "-dp", default=1, type=click.IntRange(min=1), show_default=True,
              help="engine replicas (each with its own worker ranks) behind the one frontend, routed by load and prefix.")
@click.option("--all-reduce", default="auto", type=click.Choice(["auto", "shm", "gloo"]), show_default=True,
              help="how tensor-parallel ranks on one CPU host sum: shared memory (auto) or gloo.")
@click.option("--nnodes", default=1, type=click.IntRange(min=1), show_default=True,
              help="hosts this server spans (run `metrale serve` on each, with its --node-rank).")
@click.option("--node-rank", default=0, type=click.IntRange(min=0), show_default=True,
              help="this host's place among --nnodes (node 0 runs the frontend).")
@click.option("--master-addr", default="127.0.0.1", show_default=True,
              help="node 0's address, where the nodes meet (a torch.distributed TCP store).")
@click.option("--master-port", default=29500, show_default=True,
              help="the store's port on node 0; replicas on other nodes also use the ports just above it.")
@click.option("--grammar-timeout", default=10.0, type=click.FloatRange(min=0.01), show_default=True,
              help="seconds a structured_outputs grammar may take to compile; longer (or invalid) is a 400 for that request.")
@click.option("--tool-call-parser", default="hermes", type=click.Choice(["hermes", "llama3_json"]), show_default=True,
              help="how chat outputs are parsed into tool_calls: Hermes/Qwen <tool_call> JSON, or Llama 3 JSON.")
@click.option("--speculative", default=None, type=click.Choice(["ngram"]),
              help="speculative decoding: ngram drafts tokens by prompt lookup, verified in one step.")
@click.option("--num-speculative-tokens", default=3, type=click.IntRange(1, 16), show_default=True,
              help="draft tokens per verify step (with --speculative).")
@click.option("--speculative-disable-by-batch-size", default=None, type=click.IntRange(min=2),
              help="with --speculative: steps of this many running requests or more decode without drafts.")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="a name clients give the model (repeat for several; /v1/models lists them, requests must name "
                   "one, replies carry the first). Default: the model folder's name.")
@click.option("--chat-template", default=None, metavar="FILE|JINJA",
              help="a chat template (a file, or the Jinja itself) in place of the model's own.")
@click.option("--generation-config", default="auto", show_default=True, metavar="auto|vllm|FOLDER",
              help="HTTP requests' sampling defaults (temperature, top_p, top_k, min_p, penalties) for what they leave "
                   "out: auto, the model's generation_config.json; vllm, none; or a folder holding one.")
@click.option("--disable-log-requests", is_flag=True, help="no access-log line per HTTP request.")
@click.option("--enable-force-include-usage", is_flag=True,
              help="every HTTP stream ends with its usage, as if it asked stream_options.include_usage.")
@click.option("--api-key", default=None, envvar=["METRALE_API_KEY", "VLLM_API_KEY"], show_envvar=True,
              help="clients must send this key (HTTP: Authorization: Bearer KEY on /v1/*; ZMQ: api_key in each "
                   "message); /health stays open.")
@click.option("--enable-admin", is_flag=True,
              help="take admin requests (metrale worker kill / restart) from this machine: for fault tests.")
@click.option("--admin-allow-remote", is_flag=True,
              help="with --enable-admin and a non-loopback --host: take admin requests from other machines too.")
@click.argument("model_tag", required=False)
def serve(**o) -> None:
    """Start frontend, engine core and GPU worker, and serve until Ctrl-C.

    MODEL_TAG, as `vllm serve MODEL` takes it, is the same as --model."""
    from metrale.supervisor import StartupError, Supervisor

    if o["model_tag"] is not None:
        if o["model"] is not None and o["model"] != o["model_tag"]:
            _fail(f"two models: {o['model_tag']} and --model {o['model']}")
        o["model"] = o["model_tag"]

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _check_device(o["device"])
    engine = EngineArgs(
        model=o["model"],
        max_model_len=o["max_model_len"],
        dtype=o["dtype"],
        quantization=o["quantization"],
        device=o["device"],
        block_size=o["block_size"],
        num_kv_blocks=o["num_kv_blocks"],
        kv_cache_memory=int(o["kv_cache_memory"]) if o["kv_cache_memory"] else None,
        max_num_seqs=o["max_num_seqs"],
        max_num_batched_tokens=o["max_num_batched_tokens"],
        max_waiting=o["max_waiting"],
        enable_prefix_caching=not o["no_prefix_caching"],
        preemption_mode=o["preemption_mode"],
        swap_space_gb=o["swap_space"],
        pipeline=not o["no_pipeline"],
        enforce_eager=o["enforce_eager"],
        seed=o["seed"],
        worker_threads=o["worker_threads"],
        tensor_parallel_size=o["tensor_parallel_size"],
        data_parallel_size=o["data_parallel_size"],
        all_reduce=o["all_reduce"],
        speculative=o["speculative"],
        num_speculative_tokens=o["num_speculative_tokens"],
        speculative_disable_by_batch_size=o["speculative_disable_by_batch_size"],
    )
    try:
        engine.validate()
    except ValueError as e:
        _fail(str(e))
    config = ServeConfig(
        engine=engine, host=o["host"], port=o["port"], http_port=o["http_port"], on_worker_fault=o["on_worker_fault"], max_frame_bytes=o["max_frame_bytes"],
        stream_interval=o["stream_interval"], shutdown_timeout_s=o["shutdown_timeout"],
        worker_hang_timeout_s=o["worker_hang_timeout"], nnodes=o["nnodes"], node_rank=o["node_rank"],
        master_addr=o["master_addr"], master_port=o["master_port"], grammar_timeout_s=o["grammar_timeout"],
        tool_call_parser=o["tool_call_parser"],
        api_key=o["api_key"] or None,
        enable_admin=o["enable_admin"], admin_allow_remote=o["admin_allow_remote"],
        served_model_names=list(o["served_model_names"]), chat_template=o["chat_template"],
        generation_config=o["generation_config"], disable_log_requests=o["disable_log_requests"],
        enable_force_include_usage=o["enable_force_include_usage"],
    )
    try:
        sup = Supervisor(config)
    except StartupError as e:
        _fail(str(e))
    stop = lambda *_: sup._stop.set()  # noqa: E731 - the watch loop notices and returns
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        try:
            sup.start()
        except StartupError as e:
            sup.stop()
            _fail(str(e))
        if config.node_rank > 0:
            lay = sup.layout
            what = f"replicas {list(lay.replicas)}" if lay.replicas else f"tensor-parallel ranks {list(lay.ranks)}"
            click.echo(f"metrale node {config.node_rank} of {config.nnodes} running {what} of {sup.model_dir} for "
                       f"{config.master_addr}:{config.master_port} (pid {os.getpid()})")
        else:
            http = f", HTTP on {sup.endpoints.http_endpoint}" if sup.endpoints and sup.endpoints.http_endpoint else ""
            click.echo(f"metrale serving {sup.model_dir} on {sup.client_address}{http} (pid {os.getpid()})")
        sys.stdout.flush()
        sup.watch()
    finally:
        sup.stop()
    if sup.given_up is not None:
        click.echo(f"metrale serve: stopped: {sup.given_up}", err=True)
        sys.exit(1)


def _fail(message: str) -> None:
    """A mistake at start-up: one line naming it, exit code 2 (nothing is left running)."""
    click.echo(f"metrale serve: error: {message}", err=True)
    sys.exit(2)


def _check_device(device: str | None) -> None:
    """--device cuda on a machine without CUDA is a start-up mistake, not a worker crash loop."""
    if device is None or not device.startswith("cuda"):
        if device not in (None, "cpu"):
            _fail(f"--device {device}: unknown device (use cpu or cuda)")
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
        _fail(f"--device {device}: CUDA is not available (torch {torch.__version__} is {build}); use --device cpu")


def _restart_cost(r) -> str:
    """A WorkerRecovery in words: when, why, and what it cost (fault to new worker, fault to first resumed token)."""
    when = time.strftime("%H:%M:%S", time.localtime(r.lost_at))
    ready = "no new worker yet" if r.ready_s is None else f"new worker ready after {r.ready_s:.2f} s"
    if r.resumed_s is not None:
        cost = f"first resumed token after {r.resumed_s:.2f} s ({r.requests} request{'s' * (r.requests != 1)} resumed)"
    elif r.requests:
        cost = f"no resumed token yet ({r.requests} requests were running)"
    else:
        cost = "no request was running"
    return f"at {when}, {r.cause}; {ready}, {cost}"


_api_key_option = click.option("--api-key", default=None, envvar=["METRALE_API_KEY", "VLLM_API_KEY"], show_envvar=True,
                               help="the server's --api-key.")


@main.command()
@click.argument("prompt")
@click.option("--host", default="127.0.0.1", show_default=True, help="the server's host.")
@click.option("--port", default=7410, show_default=True, help="the server's ZMQ client port.")
@click.option("--max-tokens", default=64, show_default=True, help="new tokens at most.")
@click.option("--temperature", default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", default=1.0, show_default=True, help="nucleus sampling: the smallest set of tokens of this much probability.")
@click.option("--seed", default=None, type=int, help="the request's seed (the same seed, the same text).")
@click.option("--json", "as_json", is_flag=True, help="print each delta as a JSON line.")
@_api_key_option
def generate(prompt: str, host: str, port: int, max_tokens: int, temperature: float, top_p: float, seed: int | None,
             as_json: bool, api_key: str | None) -> None:
    """Stream a completion of PROMPT from a running server."""
    from metrale.frontend.client import Client, RequestError

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    with Client(host, port, api_key=api_key) as client:
        try:
            for delta in client.generate(prompt, params=params):
                if as_json:
                    click.echo(msgspec.json.encode(delta).decode())
                else:
                    click.echo(delta.text, nl=False)
        except RequestError as e:
            raise click.ClickException(f"{e.code}: {e.message}")
        except TimeoutError as e:
            raise click.ClickException(str(e))
    if not as_json:
        click.echo()


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="the server's host.")
@click.option("--port", default=7410, show_default=True, help="the server's ZMQ client port.")
@click.option("--json", "as_json", is_flag=True, help="print health and stats as one JSON object.")
@_api_key_option
def status(host: str, port: int, as_json: bool, api_key: str | None) -> None:
    """Print each process's pid, uptime and restarts, the last fault, and the engine's counters."""
    from metrale.frontend.client import Client, RequestError

    with Client(host, port, timeout=5.0, api_key=api_key) as client:
        try:
            health = client.health()
        except TimeoutError as e:
            raise click.ClickException(str(e))
        try:
            stats = client.stats()
        except (TimeoutError, RequestError) as e:  # the engine core may be restarting: health still tells
            stats, why = None, str(e)
    if as_json:
        click.echo(msgspec.json.encode({"health": health, "stats": stats}).decode())
        return
    click.echo(f"metrale at {host}:{port}: {'healthy' if health.healthy else 'UNHEALTHY'}")
    replicas = any(p.replica for p in health.processes)
    grouped = {p.replica for p in health.processes if p.rank}  # replicas whose workers form a group of ranks
    for p in health.processes:
        state = "alive" if p.alive else "DOWN"
        where = (f" replica {p.replica}" if replicas and p.name != "frontend" else "") + \
            (f" rank {p.rank}" if p.name == "gpu_worker" and p.replica in grouped else "")
        click.echo(f"{p.name:<12} pid {p.pid:<8} up {p.uptime_s:9.1f} s  restarts {p.restarts:<3} {state}{where}")
    click.echo(f"last fault: {health.last_fault or 'none'}")
    if stats is None:
        click.echo(f"engine: no counters ({why})")
    else:
        for label, s in [("engine", stats), *((f"replica {k}", r) for k, r in enumerate(stats.replicas))]:
            click.echo(
                f"{label}: {s.running} running, {s.waiting} waiting, KV blocks {s.kv_blocks_used} used / "
                f"{s.kv_blocks_cached} cached / {s.kv_blocks_total} total, {s.generated_tokens} tokens generated, "
                f"prefix-cache hit rate {s.prefix_cache_hit_rate:.2f}"
                + (f", {s.kernels} kernels" if s.kernels else "")
                + (f", {s.host_repicks} host repicks" if s.host_repicks else "")
            )
            if s.last_worker_recovery is not None:
                where = "" if s is stats else f"{label}: "
                click.echo(f"{where}last worker restart: {_restart_cost(s.last_worker_recovery)}")


@main.group()
def worker() -> None:
    """Worker control for fault tests (the server must run with --enable-admin)."""


def _admin_options(f):
    """The options every `metrale worker` command takes: where the server is, its key, which worker."""
    for option in reversed([
        click.option("--host", default="127.0.0.1", show_default=True, help="the server's host."),
        click.option("--port", default=7410, show_default=True, help="the server's ZMQ client port."),
        _api_key_option,
        click.option("--rank", default=0, show_default=True, type=click.IntRange(min=0),
                     help="the worker's tensor-parallel rank."),
        click.option("--replica", default=0, show_default=True, type=click.IntRange(min=0),
                     help="the data-parallel replica (engine core) it belongs to."),
    ]):
        f = option(f)
    return f


@worker.command("kill")
@click.option("--signal", "sig", default="KILL", show_default=True, type=click.Choice(["KILL", "TERM", "STOP"], case_sensitive=False),
              help="KILL / TERM: the worker dies and is restarted; STOP: it hangs until the hung-worker detection "
                   "(--worker-hang-timeout) kills it.")
@_admin_options
def worker_kill(sig: str, host: str, port: int, api_key: str | None, rank: int, replica: int) -> None:
    """Send a GPU worker a signal; its requests resume on the worker that replaces it."""
    _admin(host, port, api_key, lambda c: c.kill_worker(sig.upper(), rank=rank, replica=replica))


@worker.command("restart")
@_admin_options
def worker_restart(host: str, port: int, api_key: str | None, rank: int, replica: int) -> None:
    """Stop a GPU worker (SIGTERM, then SIGKILL after 5 s); a new one takes over its requests."""
    _admin(host, port, api_key, lambda c: c.restart_worker(rank=rank, replica=replica))


def _admin(host: str, port: int, api_key: str | None, ask) -> None:
    """Send one admin request and print the supervisor's answer (an error exits 1 with its code and why)."""
    from metrale.frontend.client import Client, RequestError

    with Client(host, port, timeout=10.0, api_key=api_key) as client:
        try:
            reply = ask(client)
        except RequestError as e:
            raise click.ClickException(f"{e.code}: {e.message}")
        except TimeoutError as e:
            raise click.ClickException(str(e))
    click.echo(reply.detail)


# Operator tools, each in its own package (their modules import their work only when run).
from metrale.bench.cli import bench  # noqa: E402
from metrale.top.cli import top  # noqa: E402

main.add_command(bench)
main.add_command(top)


if __name__ == "__main__":
    main()
