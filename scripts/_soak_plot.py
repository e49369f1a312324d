"""The soak's plot: throughput, TTFT p50/p99 by send time, RSS (and open fds, when sampled) by role over the run,
each fault marked. matplotlib is the `soak` extra (pip install -e '.[soak]'); without it there is no plot.

Not a benchmark of its own: scripts/soak.py drives it.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def draw(path: Path, bin_s: float, rate: list[float], rate_label: str, ttfts: list[list[float]], series: list[dict],
         faults: list, start: float) -> str | None:
    """rate: one value per bin; ttfts: the TTFTs (ms) of the requests sent in each bin; series: soak samples ("t",
    "rss" and maybe "fds" by role); faults: Faults (injected_at on the monotonic clock whose start is `start`).
    The path written, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    with_fds = any("fds" in s for s in series)
    xs = [i * bin_s for i in range(len(rate))]
    fig, axes = plt.subplots(4 if with_fds else 3, 1, figsize=(11, 10 if with_fds else 8), sharex=True)
    axes[0].plot(xs, rate)
    axes[0].set_ylabel(rate_label)
    for q, style in ((50, "-"), (99, "--")):
        line = [statistics.quantiles(v, n=100)[q - 1] if len(v) > 1 else (v[0] if v else None) for v in ttfts]
        axes[1].plot(xs, line, style, label=f"TTFT p{q}")
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    axes[1].legend()
    panels = [("rss", "RSS MiB", 2**20)] + ([("fds", "open fds", 1)] if with_fds else [])
    for ax, (key, label, unit) in zip(axes[2:], panels):
        for role in sorted({r for s in series for r in s.get(key, {})}):
            ax.plot([s["t"] for s in series], [s.get(key, {}).get(role, 0) / unit for s in series], label=role)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    axes[-1].set_xlabel("seconds")
    for f in faults:
        if f.injected_at is not None:
            for ax in axes:
                ax.axvline(f.injected_at - start, color="red", alpha=0.3)
            axes[0].annotate(f.kind, (f.injected_at - start, 0), rotation=90, fontsize=6, color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
