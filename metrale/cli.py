"""The `metrale` command: serve, generate, status."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import signal
import sys
import time

import click
import msgspec

from metrale import cpu_isa, settings
from metrale.config import EngineArgs, ServeConfig
from metrale.ipc.sampling import SamplingParams


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(importlib.metadata.version("metrale"), "--version", "-V", prog_name="metrale",
                      help="print metrale's version and exit.")
def main() -> None:
    """metrale: an LLM serving engine."""


def _option(s: settings.Setting):
    """A setting's click option: its flag, type, choices or range, default and help, as the table says."""
    kind = s.flag_type or s.base_type
    if s.choices is not None:
        kind = click.Choice(list(s.choices))
    elif s.min is not None or s.max is not None:
        kind = (click.IntRange if kind is int else click.FloatRange)(min=s.min, max=s.max)
    extra = {"metavar": s.metavar} if s.metavar else {}
    if s.envvar:
        extra.update(envvar=list(s.envvar), show_envvar=True)
    if s.is_switch:
        return click.option(s.flag, s.name, is_flag=True, help=s.help)
    if s.multiple:
        cls = _EntryList if s.name == "lora_modules" else click.Option
        return click.option(s.flag, s.name, multiple=True, help=s.help, cls=cls, **extra)
    return click.option(s.flag, *s.aliases, s.name, default=s.default, type=kind, show_default=s.default is not None,
                        help=s.help, **extra)


class _EntryList(click.Option):
    """vLLM's `--lora-modules a=PATH b=PATH` (argparse nargs="+") as well as the flag repeated: the words after the
    flag that are NAME=PATH entries (or JSON objects) are its values too, so a model argument after them is not."""

    def add_to_parser(self, parser, ctx):
        super().add_to_parser(parser, ctx)
        option = getattr(parser, "_long_opt", {}).get(self.opts[0])  # click's parser: a private table
        if option is None:
            return
        take = option.process

        def process(value, state):
            take(value, state)
            while state.rargs and ("=" in state.rargs[0] or state.rargs[0].startswith("{")) \
                    and not state.rargs[0].startswith("-"):
                take(state.rargs.pop(0), state)

        option.process = process


def serve_options(f):
    """`metrale serve`'s options: one per setting with a flag, in the table's order."""
    for s in reversed([s for s in settings.SETTINGS if s.flag]):
        f = _option(s)(f)
    return f


@main.command()
@serve_options
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
    try:  # a CPU kernel class the CPU lacks (METRALE_CPU_ISA) is a start-up mistake, not a worker crash loop
        cpu_isa.chosen()
    except ValueError as e:
        _fail(str(e))
    engine = EngineArgs(**{st.name: st.value(o[st.name]) for st in settings.of_scope("engine") if st.flag})
    try:
        engine.validate()
    except ValueError as e:
        _fail(str(e))
    served = {st.name: st.value(o[st.name]) for st in settings.of_scope("serve") if st.flag}
    engine = _fitted_max_logprobs(engine)
    config = ServeConfig(engine=engine, **served)
    try:
        sup = Supervisor(config)
    except StartupError as e:
        _fail(str(e))
    stop = lambda *_: sup.request_stop()  # noqa: E731 - no lock in a signal handler; the watch loop notices and returns
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
            several = f"; {len(sup.frontends)} frontends, ZMQ ports {', '.join(map(str, sup.client_ports))}" \
                if len(sup.frontends) > 1 else ""
            click.echo(f"metrale serving {sup.model_dir} on {sup.client_address}{http} (pid {os.getpid()}){several}")
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


_RING_LIMIT_BYTES = 4 << 30  # a ticket ring larger than this is a mistake in the flags, not a server


def _fitted_max_logprobs(engine: EngineArgs) -> EngineArgs:
    """engine with --max-logprobs lowered to what the ticket ring can hold (one warning line says so); unchanged
    when it fits, or when the model cannot be resolved (the supervisor names that mistake)."""
    from metrale.ipc.sampling import MAX_LOGPROBS
    from metrale.model_facts import ModelError, resolve_model

    if engine.model is None or 0 <= engine.max_logprobs <= MAX_LOGPROBS:
        return engine  # the default's ring always fits (and the demo model is the supervisor's to make)
    try:
        facts = resolve_model(engine.model, engine.max_model_len)
    except (ModelError, ValueError, OSError):
        return engine
    fitted, why = max_logprobs_that_fit(engine, facts.vocab_size, facts.max_model_len)
    if why:
        click.echo(f"metrale serve: warning: {why}; serving up to {fitted} (a request for more is a 400)", err=True)
        return msgspec.structs.replace(engine, max_logprobs=fitted)
    return engine


def max_logprobs_that_fit(engine: EngineArgs, vocab_size: int, max_model_len: int) -> tuple[int, str | None]:
    """(--max-logprobs as given, None) when its ticket ring (that many alternatives per token of a step, in each
    slot) fits in /dev/shm's free space (or 4 GiB); else (the largest count that fits, why). vLLM's users pass the
    vocabulary's size out of habit: the server then serves as many as it can hold rather than none."""
    from metrale.engine_core.core import MAX_STREAM_BURST, geometry_for
    from metrale.ipc.sampling import MAX_LOGPROBS, logprobs_cap
    from metrale.ipc.ticket_layout import region_offsets

    def ring_bytes(n: int) -> int:
        g = geometry_for(msgspec.structs.replace(engine, max_logprobs=n), max_model_len, MAX_STREAM_BURST, vocab_size)
        return g.num_slots * region_offsets(g)["_end"]

    asked = min(logprobs_cap(engine.max_logprobs, vocab_size), vocab_size)  # the ring holds no more than the vocabulary
    try:
        limit = min(_RING_LIMIT_BYTES, shutil.disk_usage("/dev/shm").free)
    except OSError:  # no /dev/shm to measure: the 4 GiB bound alone
        limit = _RING_LIMIT_BYTES
    if asked <= MAX_LOGPROBS or ring_bytes(asked) <= limit:
        return engine.max_logprobs, None
    lo, hi = MAX_LOGPROBS, asked  # ring_bytes(lo) fits (the default's ring), ring_bytes(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ring_bytes(mid) <= limit else (lo, mid)
    return lo, (f"--max-logprobs {engine.max_logprobs}: {asked} alternatives per token need a "
                f"{ring_bytes(asked) / 2**30:.1f} GiB ticket ring, over the {limit / 2**30:.1f} GiB it may take; at "
                f"most {lo} fit with --max-num-batched-tokens {engine.max_num_batched_tokens} and --max-num-seqs "
                f"{engine.max_num_seqs}")


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
        where = (f" replica {p.replica}" if replicas and not p.name.startswith("frontend") else "") + \
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
                + (f", {s.repicks} repicks" if s.repicks else "")
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
