"""Start-up cost of `metrale serve`: seconds from launch to its "serving" line, on an idle box and on one whose
cores are all busy with other work (spinning processes), alternated; and how many lines the start logged.

    python scripts/bench_startup.py [--model DIR] [--reps 3]

Prints one JSON line: medians of idle and busy start-up seconds, their ratio, and the log lines per start.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def start_once(model: str | None, busy: bool) -> tuple[float, int]:
    """Seconds until `metrale serve` says it serves, and how many log lines it wrote by then."""
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 1)] if busy else []
    for p in spinners:
        p.start()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "metrale.cli", "serve", "--port", "0"] + (["--model", model] if model else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        while True:
            with open(log.name) as f:
                text = f.read()
            if "metrale serving" in text:
                return time.monotonic() - t0, text.count("\n")
            if proc.poll() is not None:
                raise SystemExit(f"metrale serve exited with {proc.returncode}:\n{text[-2000:]}")
            time.sleep(0.05)  # polling the log of another process: a benchmark, no event to wait on
    finally:
        proc.terminate()
        proc.wait(60)
        stop.set()
        for p in spinners:
            p.join()
        os.unlink(log.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    start_once(args.model, busy=False)  # warm: the demo model and the native kernels are built once
    idle, busy, lines = [], [], []
    for _ in range(args.reps):
        for is_busy, out in ((False, idle), (True, busy)):
            seconds, n = start_once(args.model, is_busy)
            out.append(seconds)
            lines.append(n)
    result = {"startup_idle_s": round(statistics.median(idle), 2), "startup_busy_s": round(statistics.median(busy), 2),
              "busy_over_idle": round(statistics.median(busy) / statistics.median(idle), 2),
              "log_lines_per_start_max": max(lines), "reps": args.reps, "cores": os.cpu_count()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
