"""The `metrale top` frame: a Snapshot drawn as rich renderables (no terminal needed; tests render it to text)."""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .snapshot import Snapshot


def render(snap: Snapshot) -> RenderableType:
    """The whole frame: a header, the processes, the engine's queues and KV, rates and latencies, the faults."""
    parts: list[RenderableType] = [_header(snap), _processes(snap)]
    if snap.stats is not None:
        parts.append(_engine(snap))
    parts.append(_latency(snap))
    parts.append(_faults(snap))
    if snap.error:
        parts.append(Text(snap.error, style="yellow"))
    return Group(*parts)


def _header(snap: Snapshot) -> Text:
    """Address, health and the time of the frame."""
    state = Text("healthy", style="bold green") if snap.healthy else Text("UNHEALTHY", style="bold red")
    line = Text.assemble(("metrale top ", "bold"), f"{snap.address}  ", state,
                         f"  {time.strftime('%H:%M:%S', time.localtime(snap.taken_at))}")
    if snap.waiting_for:
        line.append(f"  waiting for {snap.waiting_for}", style="yellow")
    return line


def _processes(snap: Snapshot) -> Table:
    """One row per process: pid, state, uptime, restarts, CPU and memory."""
    t = Table(title="processes", title_justify="left", expand=False)
    for name, justify in (("name", "left"), ("pid", "right"), ("state", "left"), ("uptime", "right"),
                          ("restarts", "right"), ("CPU %", "right"), ("RSS MiB", "right")):
        t.add_column(name, justify=justify)
    for p in snap.processes:
        t.add_row(p.name, str(p.pid), Text("alive", "green") if p.alive else Text("DOWN", "bold red"),
                  _duration(p.uptime_s), str(p.restarts), _num(p.cpu_percent, "{:.0f}"),
                  _num(None if p.rss_bytes is None else p.rss_bytes / 2**20, "{:.0f}"))
    return t


def _engine(snap: Snapshot) -> Table:
    """Requests by state, KV blocks, token rates and the worker's idle share."""
    s = snap.stats
    t = Table(title="engine", title_justify="left", show_header=False, expand=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("running", str(s.running), "KV blocks used", f"{s.kv_blocks_used} / {s.kv_blocks_total}")
    t.add_row("waiting", str(s.waiting), "KV blocks cached", str(s.kv_blocks_cached))
    t.add_row("swapped", str(s.swapped), "prefix cache hits", f"{100 * s.prefix_cache_hit_rate:.0f} %")
    t.add_row("tokens/s in", _num(snap.tokens_in_per_s, "{:.1f}"), "preemptions", str(s.preemptions))
    t.add_row("tokens/s out", _num(snap.tokens_out_per_s, "{:.1f}"), "tokens generated", str(s.generated_tokens))
    t.add_row("worker idle", _num(None if snap.worker_idle is None else 100 * snap.worker_idle, "{:.0f} %"),
              "steps", str(s.steps))
    return t


def _latency(snap: Snapshot) -> Table | Text:
    """TTFT and ITL p50 / p99 over the frontend's recent window."""
    f = snap.frontend
    if f is None:
        return Text("latency: the server reports no recent latencies", style="dim")
    t = Table(title=f"latency, last {f.window_s:.0f} s", title_justify="left", expand=False)
    for name in ("", "p50 ms", "p99 ms", "samples"):
        t.add_column(name, justify="right" if name else "left")
    t.add_row("TTFT", *_ms(f.ttft_p50_s, f.ttft_p99_s, f.ttft_samples), str(f.ttft_samples))
    t.add_row("ITL", *_ms(f.itl_p50_s, f.itl_p99_s, f.itl_samples), str(f.itl_samples))
    return t


def _faults(snap: Snapshot) -> Text:
    """The last faults the supervisor reported, newest last."""
    if not snap.faults:
        return Text("faults: none", style="dim")
    out = Text("faults:\n", style="bold")
    for at, fault in snap.faults:
        out.append(f"  {time.strftime('%H:%M:%S', time.localtime(at))}  {fault}\n", style="red")
    return out


def _ms(p50: float, p99: float, samples: int) -> tuple[str, str]:
    """Two latencies in milliseconds, or dashes with no sample."""
    return ("-", "-") if samples == 0 else (f"{1000 * p50:.1f}", f"{1000 * p99:.1f}")


def _num(value: float | None, fmt: str) -> str:
    """A figure, or a dash when there is none."""
    return "-" if value is None else fmt.format(value)


def _duration(seconds: float) -> str:
    """12 s, 3m04s, 2h05m."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
