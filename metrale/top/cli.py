"""The `metrale top` command (click): refresh a rich Live view from Sampler snapshots until Ctrl-C."""

from __future__ import annotations

import time

import click


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="the server's ZMQ host.")
@click.option("--port", default=7410, show_default=True, help="the server's ZMQ client port.")
@click.option("--interval", default=1.0, type=click.FloatRange(min=0.1), show_default=True, help="seconds between frames.")
@click.option("--once", is_flag=True, help="print one frame (rates over --interval) and exit.")
def top(host: str, port: int, interval: float, once: bool) -> None:
    """A live view of a running server: processes, queues, KV blocks, tokens/s, latencies, faults."""
    from rich.console import Console
    from rich.live import Live

    from metrale.frontend.client import Client

    from .snapshot import Sampler
    from .view import render

    console = Console()
    with Client(host, port, timeout=5.0) as client:
        sampler = Sampler(client, host, port)
        snap = sampler.sample()
        if once:
            time.sleep(interval)  # a second look, so CPU and rates have an interval to cover
            console.print(render(sampler.sample()))
            return
        try:
            with Live(render(snap), console=console, refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render(sampler.sample()))
        except KeyboardInterrupt:
            pass
