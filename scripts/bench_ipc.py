"""Ticket round trip between the engine core and a GPU worker process, with an empty step.

Plan written and published → the worker picks it up → an empty runner answers at once → result
published → the engine sees it and copies it out. Measured twice in one run: with the brief spin on
both sides then the doorbell (the default), and with the doorbell alone (spin 0). Prints one JSON line:

    python scripts/bench_ipc.py [--round-trips 5000] [--rows 8] [--spin-us 100]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from metrale.engine_core.worker_device import WorkerDevice
from metrale.gpu_worker.result_copy import Ready
from metrale.ipc.plan import ModelInfo, StepPlan, StepResult
from metrale.ipc.tickets import RingGeometry


class EmptyRunner:
    """A runner whose step costs nothing: the same preallocated result every time."""

    def __init__(self, rows: int = 8) -> None:
        self.info = ModelInfo("empty", 32000, 4096, (2,), 1024, 16, "float32")
        self._result = StepResult(tokens=np.arange(rows, dtype=np.int32))

    def execute(self, plan: StepPlan) -> StepResult:
        return self._result

    def launch(self, plan: StepPlan) -> Ready:
        return Ready(self._result)


def decode_plan(rows: int, blocks: int) -> StepPlan:
    """A decode step: one token per row, every row sampling, a block table of `blocks` per row."""
    i32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    r = rows
    return StepPlan(
        input_ids=i32(np.arange(r)),
        positions=i32(np.full(r, 100)),
        slot_mapping=np.arange(r, dtype=np.int64) * 16,
        query_start=i32(np.arange(r + 1)),
        seq_lens=i32(np.full(r, 101)),
        block_tables=i32(np.arange(r * blocks).reshape(r, blocks)),
        sample=np.ones(r, dtype=bool),
        feed_from_row=i32(np.arange(r)),
        temperature=np.ones(r, dtype=np.float32),
        top_k=i32(np.zeros(r)),
        top_p=np.ones(r, dtype=np.float32),
        min_p=np.zeros(r, dtype=np.float32),
        repetition_penalty=np.ones(r, dtype=np.float32),
        presence_penalty=np.zeros(r, dtype=np.float32),
        frequency_penalty=np.zeros(r, dtype=np.float32),
        seeds=np.arange(r, dtype=np.int64),
        mask_kind=np.zeros(r, dtype=np.uint8),
        force_token=i32(np.zeros(r)),
        ban_ids=i32(np.zeros((r, 0))),
        num_logprobs=i32(np.full(r, -1)),
        hist_tokens=i32(np.zeros(0)),
        hist_start=i32(np.zeros(r + 1)),
        hist_prompt_len=i32(np.zeros(r)),
    )


def round_trips(spin_us: float, n: int, rows: int, blocks: int) -> dict:
    """Median/p99 of n round trips (µs) and the worker's idle fraction, with this spin on both sides."""
    geometry = RingGeometry(num_slots=4, max_tokens=1024, max_rows=max(rows, 8), max_blocks_per_row=blocks)
    here = os.path.dirname(os.path.abspath(__file__))
    device = WorkerDevice.spawn(
        geometry,
        factory="bench_ipc:EmptyRunner",
        runner_kwargs={"rows": rows},
        env={"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))},
        spin_us=spin_us,
        worker_spin_us=spin_us,
        ready_timeout_s=60,
    )
    try:
        plan = decode_plan(rows, blocks)
        for _ in range(min(200, n)):
            device.await_result(device.launch(plan))
        before = device.worker_stats()
        lat = np.empty(n, dtype=np.int64)
        for i in range(n):
            t0 = time.perf_counter_ns()
            device.await_result(device.launch(plan))
            lat[i] = time.perf_counter_ns() - t0
        stats = device.worker_stats().since(before)
    finally:
        device.close()
    return {
        "median_us": round(float(np.median(lat)) / 1e3, 1),
        "p99_us": round(float(np.percentile(lat, 99)) / 1e3, 1),
        "worker_idle_fraction": round(stats.idle_fraction, 3),
    }


def main() -> None:
    """Run both configurations and print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--round-trips", type=int, default=5000)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=16, help="block-table width per row")
    ap.add_argument("--spin-us", type=float, default=100.0)
    args = ap.parse_args()
    spin = round_trips(args.spin_us, args.round_trips, args.rows, args.blocks)
    bell = round_trips(0.0, args.round_trips, args.rows, args.blocks)
    print(
        json.dumps(
            {
                "bench": "ipc_round_trip",
                "round_trips": args.round_trips,
                "rows": args.rows,
                "spin_us": args.spin_us,
                "spin_median_us": spin["median_us"],
                "spin_p99_us": spin["p99_us"],
                "doorbell_median_us": bell["median_us"],
                "doorbell_p99_us": bell["p99_us"],
                "spin_worker_idle_fraction": spin["worker_idle_fraction"],
                "doorbell_vs_spin_median": round(bell["median_us"] / spin["median_us"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
