"""The `metrale` command: serve, generate, status."""

from __future__ import annotations

import logging
import os
import signal
import sys

import click
import msgspec

from metrale.config import QUANTIZATIONS, EngineArgs, ServeConfig
from metrale.ipc.sampling import SamplingParams


@click.group()
def main() -> None:
    """metrale: an LLM serving engine."""


@main.command()
@click.option("--model", default=None, help="Hugging Face model folder or GGUF file (default: the built-in tiny demo model).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7410, show_default=True, help="ZMQ client port (0: any free port).")
@click.option("--http-port", default=None, type=int, help="also serve the OpenAI-compatible HTTP API on this port.")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), show_default=True)
@click.option("--quantization", default=None, type=click.Choice(QUANTIZATIONS),
              help="int8 / int4: quantize every linear layer at load (weight-only); none: all dense "
                   "(default: as the checkpoint is; a GGUF's Q8_0 and 4-bit layers stay quantized).")
@click.option("--device", default=None, help="cuda or cpu (default: cuda when present).")
@click.option("--max-num-seqs", default=64, show_default=True)
@click.option("--max-num-batched-tokens", default=2048, show_default=True)
@click.option("--block-size", default=16, show_default=True)
@click.option("--num-kv-blocks", default=None, type=int)
@click.option("--kv-cache-memory", default=None, type=float, help="bytes of KV cache (e.g. 2e9).")
@click.option("--max-waiting", default=4096, show_default=True)
@click.option("--no-prefix-caching", is_flag=True)
@click.option("--preemption-mode", default="recompute", type=click.Choice(["recompute", "swap"]), show_default=True)
@click.option("--swap-space", default=4.0, show_default=True, help="GiB of host memory for swapped-out KV.")
@click.option("--no-pipeline", is_flag=True, help="run the synchronous loop instead of the pipelined decode lane.")
@click.option("--on-worker-fault", default="recover", type=click.Choice(["recover", "fail"]), show_default=True)
@click.option("--max-frame-bytes", default=1 << 20, show_default=True)
@click.option("--stream-interval", default=1, type=click.IntRange(min=1), show_default=True,
              help="send a request's tokens every N tokens (its first and last at once): less CPU per token, burstier streams.")
@click.option("--seed", default=None, type=int)
@click.option("--worker-threads", default=None, type=int, help="torch threads of the worker on a CPU (default: cores - 1, or every core on a box of two or fewer).")
@click.option("--max-model-len", default=None, type=click.IntRange(min=2), help="cap on prompt + output tokens (default: what the model's config allows).")
@click.option("--shutdown-timeout", default=0.0, type=click.FloatRange(min=0), show_default=True,
              help="on Ctrl-C / SIGTERM, let live requests finish for up to this many seconds (new ones get 503 / shutdown).")
@click.option("--worker-hang-timeout", default=10.0, type=click.FloatRange(min=0.1), show_default=True,
              help="a worker whose step runs this long (and far longer than its recent steps) is killed as hung and restarted.")
@click.option("--api-key", default=None, envvar=["METRALE_API_KEY", "VLLM_API_KEY"], show_envvar=True,
              help="clients must send this key (HTTP: Authorization: Bearer KEY on /v1/*; ZMQ: api_key in each "
                   "message); /health stays open.")
def serve(**o) -> None:
    """Start frontend, engine core and GPU worker, and serve until Ctrl-C."""
    from metrale.supervisor import StartupError, Supervisor

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
        seed=o["seed"],
        worker_threads=o["worker_threads"],
    )
    try:
        engine.validate()
    except ValueError as e:
        _fail(str(e))
    config = ServeConfig(
        engine=engine, host=o["host"], port=o["port"], http_port=o["http_port"], on_worker_fault=o["on_worker_fault"], max_frame_bytes=o["max_frame_bytes"],
        stream_interval=o["stream_interval"], shutdown_timeout_s=o["shutdown_timeout"],
        worker_hang_timeout_s=o["worker_hang_timeout"], api_key=o["api_key"] or None,
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


_api_key_option = click.option("--api-key", default=None, envvar=["METRALE_API_KEY", "VLLM_API_KEY"], show_envvar=True,
                               help="the server's --api-key.")


@main.command()
@click.argument("prompt")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7410, show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=None, type=int)
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
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=7410, show_default=True)
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
    for p in health.processes:
        state = "alive" if p.alive else "DOWN"
        click.echo(f"{p.name:<12} pid {p.pid:<8} up {p.uptime_s:9.1f} s  restarts {p.restarts:<3} {state}")
    click.echo(f"last fault: {health.last_fault or 'none'}")
    if stats is None:
        click.echo(f"engine: no counters ({why})")
    else:
        click.echo(
            f"engine: {stats.running} running, {stats.waiting} waiting, KV blocks {stats.kv_blocks_used} used / "
            f"{stats.kv_blocks_cached} cached / {stats.kv_blocks_total} total, {stats.generated_tokens} tokens generated"
            + (f", {stats.host_repicks} host repicks" if stats.host_repicks else "")
        )


if __name__ == "__main__":
    main()
