"""The frontend's CPU per engine tick: recorded EngineOutputs frames through a real frontend process, no engine.

A frontend process (metrale.frontend.server.main, as `metrale serve` starts it) serves a weightless model folder;
this script plays both its engine core (the two ipc:// sockets: EngineReady, then one EngineOutputs frame per
tick) and its ZMQ clients (raw DEALER sockets, the requests spread over them in turn). It admits `--streams`
requests, then sends `--ticks` frames, each with one RequestOutputDelta per request (`--tokens` new ids each, the
simulated device's toy tokens), waiting after each frame until the clients hold every request's Delta (so the
frontend works one tick at a time, as behind a device step). The last frame finishes every request ("length").

The frontend's CPU (user + system, from its process) is read before the first frame and after the last, so what
the clients and this script spend is not counted, and a busy box changes the figure far less than it changes
wall-clock times: frontend_cpu_us_per_frame is that CPU ÷ frames, frontend_cpu_us_per_token ÷ output tokens,
event_loop_cpu_us_per_frame the event loop's thread's alone (the rest is libzmq's I/O thread), and
handler_cpu_us_p50 / _p10 the median and 10th percentile of the CPU the frontend's engine-message handler took per
message, read inside the frontend (thread CPU time around each call: decode, rows, sends), the figure least moved by
other processes; admit_cpu_us_per_request is its CPU from the first Generate sent to the last AddRequest received
÷ requests. It
covers the receive loop, the frame's decode, each request's state and detokenizer, and building and sending each
client's frame — the per-tick path of `bench_sim.py`'s frontend at N streams, without admissions.

    python scripts/bench_frontend.py [--streams 1024] [--ticks 200] [--tokens 1] [--clients 64] [--reps 3]
                                     [--stop] [--logprobs] [--profile OUT.txt]

--stop gives every request two stop strings that never match (the stop-string scan runs); --logprobs asks for one
alternative per token (the frames carry TokenLogprobs). --profile samples the frontend with py-spy while the frames
of the last repetition stream, its collapsed stacks written to OUT.txt (py-spy's raw format: flamegraph.pl or
speedscope read it). Prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import psutil
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import FIRST_PLAIN_TOKEN, LoadMeter, emit, git_commit, note  # noqa: E402

WAIT_S = 60.0  # a frame's Deltas not all back in this long: the frontend is broken, stop


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=1024, help="live requests, each with a row in every frame")
    ap.add_argument("--ticks", type=int, default=200, help="EngineOutputs frames per repetition")
    ap.add_argument("--tokens", type=int, default=1, help="new ids per row per frame")
    ap.add_argument("--clients", type=int, default=64, help="DEALER sockets the requests are spread over")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (fresh requests each); medians reported")
    ap.add_argument("--preset", default="bench-small", help="tiny_model preset of the weightless folder")
    ap.add_argument("--stop", action="store_true", help="every request has stop strings (that never match)")
    ap.add_argument("--logprobs", action="store_true", help="every request asks for 1 logprob alternative")
    ap.add_argument("--profile", default=None, help="py-spy's collapsed stacks of the last repetition, to this file")
    return ap.parse_args(argv)


def _frontend(model_dir: str, addresses: tuple[str, str, str], handled) -> None:
    """The frontend process; `handled` (a shared array: a count, then CPU ns per message) gets its event loop's CPU
    for each engine message it handles (time.thread_time_ns around FrontendServer's handler, decode included)."""
    from metrale.frontend import server as server_module
    from metrale.frontend.server import FrontendConfig, main

    serve_frames = server_module.serve_frames

    async def timed_serve_frames(recv, handle, *rest):
        if getattr(recv, "__self__", None) is None or not hasattr(recv.__self__, "new_request_id"):
            return await serve_frames(recv, handle, *rest)  # not an engine link's receive loop

        def timed(frame) -> None:
            t0 = time.thread_time_ns()
            handle(frame)
            n = int(handled[0])
            if n + 1 < len(handled):
                handled[n + 1] = time.thread_time_ns() - t0
                handled[0] = n + 1
        return await serve_frames(recv, timed, *rest)

    server_module.serve_frames = timed_serve_frames
    engine_in, engine_out, client = addresses
    main(FrontendConfig(model_dir=model_dir, engine_input_address=engine_in, engine_output_address=engine_out,
                        client_address=client, http_port=None, heartbeat_s=0))


class Rig:
    """The engine core's and the clients' ends of one frontend process."""

    def __init__(self, model_dir: Path, tmp: Path, clients: int) -> None:
        from metrale.ipc.messages import EngineReady

        self.addresses = (f"ipc://{tmp}/in", f"ipc://{tmp}/out", f"ipc://{tmp}/clients")
        ctx = multiprocessing.get_context("spawn")
        self.handled = ctx.Array("d", 1 << 16, lock=False)  # [count, CPU ns of each engine message handled]
        self.proc = ctx.Process(target=_frontend, args=(str(model_dir), self.addresses, self.handled), daemon=True)
        self.proc.start()
        self.ps = psutil.Process(self.proc.pid)
        self.zctx = zmq.Context()
        self.pull = self.zctx.socket(zmq.PULL)  # AddRequest, AbortRequest, FrontendUp: from the frontend
        self.push = self.zctx.socket(zmq.PUSH)  # EngineReady, EngineOutputs: to the frontend
        self.pull.connect(self.addresses[0])
        self.push.connect(self.addresses[1])
        self.dealers = [self.zctx.socket(zmq.DEALER) for _ in range(clients)]
        for d in self.dealers:
            d.setsockopt(zmq.RCVHWM, 0)
            d.connect(self.addresses[2])
        self.poller = zmq.Poller()
        for d in self.dealers:
            self.poller.register(d, zmq.POLLIN)
        self.push.send(msgspec.msgpack.encode(EngineReady(vocab_size=2048, max_model_len=4096, num_kv_blocks=1 << 16,
                                                          block_size=16)))

    def admit(self, n: int, rep: int, params) -> list[str]:
        """Send n Generates; the engine ids the frontend submitted them under."""
        from metrale.ipc.messages import AddRequest, EngineInput, Generate

        decoder = msgspec.msgpack.Decoder(EngineInput)
        enc = msgspec.msgpack.Encoder()
        rng = np.random.default_rng(rep)
        for i in range(n):
            prompt = rng.integers(FIRST_PLAIN_TOKEN, 2000, size=32).tolist()
            msg = Generate(id=f"r{rep}-{i}", token_ids=prompt, sampling=params)
            self.dealers[i % len(self.dealers)].send(enc.encode(msg))
        engine_ids: list[str] = []
        deadline = time.monotonic() + WAIT_S
        while len(engine_ids) < n:
            if not self.pull.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise RuntimeError(f"the frontend submitted {len(engine_ids)} of {n} requests")
            msg = decoder.decode(self.pull.recv())
            if isinstance(msg, AddRequest):
                engine_ids.append(msg.request_id)
        return engine_ids

    def drain(self, expect: int) -> int:
        """Take frames from the clients until `expect` have come; the bytes taken."""
        got = size = 0
        deadline = time.monotonic() + WAIT_S
        while got < expect:
            events = self.poller.poll(int(max(0.0, deadline - time.monotonic()) * 1000))
            if not events:
                raise RuntimeError(f"the clients got {got} of {expect} frames")
            for sock, _ in events:
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    got += 1
                    size += len(frame)
        return size

    def cpu_s(self) -> tuple[float, float]:
        """The frontend's CPU seconds so far: all its threads, and its main (event-loop) thread alone."""
        t = self.ps.cpu_times()
        main = next((th for th in self.ps.threads() if th.id == self.ps.pid), None)
        return t.user + t.system, (main.user_time + main.system_time) if main is not None else 0.0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(10)
        for s in (self.pull, self.push, *self.dealers):
            s.close(linger=0)
        self.zctx.term()


def frames_for(engine_ids: list[str], ticks: int, tokens: int, logprobs: bool, seed: int) -> list[bytes]:
    """The encoded EngineOutputs of every tick: each request's next `tokens` toy ids, "length" on the last."""
    from metrale.gpu_worker.sim_runner import next_tokens
    from metrale.ipc.messages import EngineOutputs, RequestOutputDelta, TokenLogprob

    n = len(engine_ids)
    rng = np.random.default_rng(seed)
    hist = rng.integers(FIRST_PLAIN_TOKEN, 2000, size=(3, n))
    vocab = 2000
    out = []
    for t in range(ticks):
        ids = np.empty((n, tokens), dtype=np.int64)
        for k in range(tokens):  # the simulated device's toy stream: a hash of the last three ids
            pos = np.full(n, 32 + t * tokens + k)
            nxt = np.maximum(next_tokens(hist[0], hist[1], hist[2], pos, vocab), FIRST_PLAIN_TOKEN)
            ids[:, k] = nxt
            hist = np.stack([hist[1], hist[2], nxt])
        rows = []
        last = t == ticks - 1
        for i, eid in enumerate(engine_ids):
            row_ids = ids[i].tolist()
            lp = [TokenLogprob(token_id=x, logprob=-0.5, top_ids=[x], top_logprobs=[-0.5]) for x in row_ids] \
                if logprobs else None
            rows.append(RequestOutputDelta(request_id=eid, new_token_ids=row_ids, logprobs=lp,
                                           finish_reason="length" if last else None))
        out.append(msgspec.msgpack.encode(EngineOutputs(outputs=rows)))
    return out


def run_once(rig: Rig, args: argparse.Namespace, rep: int, profile: str | None = None) -> dict:
    """One repetition: admit, stream every frame, read the frontend's CPU around the frames."""
    from metrale.ipc.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.ticks * args.tokens, temperature=0.0, ignore_eos=True,
                            stop=["\x00never-1", "\x00never-2"] if args.stop else [],
                            logprobs=1 if args.logprobs else None)
    admit0 = rig.cpu_s()[0]
    engine_ids = rig.admit(args.streams, rep, params)
    admit_us = (rig.cpu_s()[0] - admit0) / args.streams * 1e6
    frames = frames_for(engine_ids, args.ticks, args.tokens, args.logprobs, seed=rep)
    time.sleep(0.2)  # a settle, not synchronisation: the frontend's admissions are all done (every AddRequest came)
    spy = None
    if profile:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(rig.proc.pid), "--rate", "500", "--format", "raw",
                                "-o", profile], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
    first = int(rig.handled[0])
    cpu0, wall0 = rig.cpu_s(), time.perf_counter()
    size = 0
    for frame in frames:
        rig.push.send(frame)
        size += rig.drain(args.streams)
    cpu1, wall1 = rig.cpu_s(), time.perf_counter()
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    tokens = args.streams * args.ticks * args.tokens
    (all0, main0), (all1, main1) = cpu0, cpu1
    per_message = np.array(rig.handled[first + 1 : int(rig.handled[0]) + 1]) / 1e3
    return {
        # the handler's own CPU per engine message, read in the frontend (thread_time): median and 10th percentile
        "handler_cpu_us_p50": round(float(np.median(per_message)), 1) if len(per_message) else None,
        "handler_cpu_us_p10": round(float(np.percentile(per_message, 10)), 1) if len(per_message) else None,
        "frontend_cpu_us_per_frame": round((all1 - all0) / len(frames) * 1e6, 1),
        "frontend_cpu_us_per_token": round((all1 - all0) / tokens * 1e6, 3),
        # the event loop's thread alone; the rest is libzmq's I/O thread writing the client frames out
        "event_loop_cpu_us_per_frame": round((main1 - main0) / len(frames) * 1e6, 1),
        "wall_ms_per_frame": round((wall1 - wall0) / len(frames) * 1e3, 3),
        # admitting one request: its Generate received, checked and submitted (the AddRequest encoded and sent)
        "admit_cpu_us_per_request": round(admit_us, 1),
        "client_bytes_per_frame": size // len(frames),
        "engine_frame_bytes": sum(len(f) for f in frames) // len(frames),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the repetitions, print the JSON line."""
    from metrale.gpu_worker.sim_runner import write_weightless_model

    args = parse_args(argv)
    meter = LoadMeter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="metrale-bench-fe-") as tmp:
        model_dir = write_weightless_model(Path(tmp) / args.preset, args.preset)
        rig = Rig(model_dir, Path(tmp), args.clients)
        try:
            for rep in range(args.reps):
                runs.append(run_once(rig, args, rep, args.profile if rep == args.reps - 1 else None))
                meter.sample()
                note(f"rep {rep}: {runs[-1]}")
        finally:
            rig.close()
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    emit({
        "bench": "frontend",
        "commit": git_commit(),
        "streams": args.streams,
        "ticks": args.ticks,
        "tokens_per_row": args.tokens,
        "clients": args.clients,
        "stop_strings": args.stop,
        "logprobs": args.logprobs,
        "reps": args.reps,
        **med,
        "runs": runs,
        "machine": meter.report(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
