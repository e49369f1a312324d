"""Drive an EngineCore on a FakeDevice through a scripted workload and record what it streams."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

from metrale.engine_core.engine import EngineCore, EngineOptions
from metrale.testing.fake_device import FakeDevice, FakeFaults
from metrale.engine_core.pipeline import SpecialTokens
from metrale.engine_core.kv_blocks import KvBlockPool
from metrale.ipc.plan import FedAheadPolicy
from metrale.ipc.sampling import SamplingParams
from metrale.testing.invariants import check_pool, check_state_slots

THINK_START, THINK_END = 2, 3
CODE_FENCE, TOOL_START, TOOL_END = 46, 45, 44  # ordinary ids the toy model also picks: adaptive masks change
TOKS = SpecialTokens(think_start=THINK_START, think_end=THINK_END, code_fence=CODE_FENCE,
                     tool_call_start=TOOL_START, tool_call_end=TOOL_END)


@dataclass
class Req:
    """One scripted request: when it arrives, what it asks, and when (by streamed tokens) it is aborted."""

    prompt: list[int]
    params: SamplingParams
    arrive_tick: int = 0
    abort_after: int | None = None
    grammar: object = None  # a GrammarBlob, with params.structured_outputs (tests/fake_grammars.py)


@dataclass
class Run:
    streams: dict[str, list[int]] = field(default_factory=dict)
    delta_sizes: dict[str, list[int]] = field(default_factory=dict)  # tokens per delta, as reported
    logprobs: dict[str, list] = field(default_factory=dict)  # TokenLogprobs, as reported (requests that ask)
    finish: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    error_codes: dict[str, str] = field(default_factory=dict)
    failures: int = 0  # ticks that raised and were contained
    effects: Counter = field(default_factory=Counter)  # calls of the lane's effects, by name (count_effects=True)
    ticks: int = 0
    recoveries: int = 0
    engine: EngineCore | None = None
    device: FakeDevice | None = None


def run_workload(
    reqs: list[Req],
    *,
    pipeline: bool,
    num_kv_blocks: int = 512,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    policy: FedAheadPolicy = FedAheadPolicy.REWIND,
    count_effects: bool = False,
    device_faults: FakeFaults | None = None,
    prefix_caching: bool = True,
    max_ticks: int = 20_000,
    max_model_len: int = 1024,
    kill_at_tick: int | None = None,
    preemption_mode: str = "recompute",
    num_swap_blocks: int = 0,
    recover: bool = True,
    stream_interval: int = 1,
    max_burst: int = 1,
    contain_failures: bool = False,
    grammar_vocab=None,
    deferred: bool = False,
    speculative: str | None = None,
    num_speculative_tokens: int = 3,
    speculative_disable_by_batch_size: int | None = None,
    repetitive: bool = False,
    num_state_slots: int = 0,
) -> Run:
    """Run reqs to completion and return the token stream and finish reason of each.

    num_state_slots > 0: the FakeDevice is a recurrent model (RepickOnly, with that many state slots)."""
    if num_state_slots:
        policy = FedAheadPolicy.REPICK_ONLY
    dev = FakeDevice(
        num_kv_blocks=num_kv_blocks, block_size=block_size, policy=policy, faults=device_faults, max_model_len=max_model_len,
        num_swap_blocks=num_swap_blocks, max_burst=max_burst, deferred=deferred, repetitive=repetitive,
        num_state_slots=num_state_slots,
    )
    eng = EngineCore(
        dev,
        EngineOptions(
            pipeline=pipeline,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=prefix_caching,
            recover_from_device_loss=recover,
            preemption_mode=preemption_mode,
            stream_interval=stream_interval,
            speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
            speculative_disable_by_batch_size=speculative_disable_by_batch_size,
        ),
        special_tokens=TOKS,
    )
    if grammar_vocab is not None:
        eng.set_grammar_vocab(grammar_vocab)
    run = Run(engine=eng, device=dev)
    with _counting(run.effects) if count_effects else contextlib.nullcontext():
        _drive(run, reqs, dev, eng, kill_at_tick, max_ticks, contain_failures)
    return run


def _drive(run, reqs, dev, eng, kill_at_tick, max_ticks, contain_failures) -> None:
    """Step the engine through the workload, recording its streams; check nothing leaked at the end."""
    pending = sorted(enumerate(reqs), key=lambda x: x[1].arrive_tick)
    aborted: set[str] = set()
    tick = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][1].arrive_tick <= tick:
            i, r = pending.pop(0)
            run.streams[str(i)] = []
            eng.add_request(str(i), r.prompt, r.params, grammar=r.grammar)
        for i, r in enumerate(reqs):
            rid = str(i)
            if r.abort_after is not None and rid in run.streams and rid not in aborted and rid not in run.finish:
                if len(run.streams[rid]) >= r.abort_after:
                    aborted.add(rid)
                    eng.abort(rid)
        if tick == kill_at_tick:
            dev.kill()  # the worker dies between ticks, with a step in flight
        try:
            deltas = eng.step()
        except ValueError as exc:  # as the engine-core process does (core.py); else a bug stays loud
            if not contain_failures:
                raise
            run.failures += 1
            deltas = eng.contain_failure(exc)
        for d in deltas:
            assert d.request_id not in run.finish, f"request {d.request_id} streamed after its finish"
            run.streams[d.request_id].extend(d.new_token_ids)
            run.delta_sizes.setdefault(d.request_id, []).append(len(d.new_token_ids))
            if d.logprobs:
                run.logprobs.setdefault(d.request_id, []).extend(d.logprobs)
            if d.finish_reason:
                run.finish[d.request_id] = d.finish_reason
                if d.error:
                    run.errors[d.request_id] = d.error
                    run.error_codes[d.request_id] = d.error_code
        check_state_slots(eng.scheduler.state_slots, eng.scheduler.running)
        if eng.device_lost:
            run.recoveries += 1
            dev.revive()  # the supervisor's new worker: empty KV
            eng.recover()
        tick += 1
        assert tick < max_ticks, "the engine did not finish the workload"
    run.ticks = tick
    check_pool(eng.pool)
    assert eng.pool.num_used == 0, "blocks still referenced after every request finished"
    assert dev.in_flight == 0, "a launched step was never awaited"
    assert eng.scheduler.swap.num_free == eng.scheduler.swap.num_blocks, "host swap blocks leaked"
    assert eng.scheduler.state_slots.num_free == eng.scheduler.state_slots.num_slots, "state slots leaked"


@contextlib.contextmanager
def _counting(effects: Counter):
    """Count the lane's effects meanwhile, by name: KV reserved (`allocate`) and given back (`trim`), steps picked
    again by the device (`resample`). The engine keeps no counters of its own: these wrap the product's methods."""
    wrapped = [(KvBlockPool, "allocate"), (KvBlockPool, "trim"), (FakeDevice, "resample")]
    originals = [getattr(cls, name) for cls, name in wrapped]

    def counter(name, method):
        def counted(*args, **kwargs):
            effects[name] += 1
            return method(*args, **kwargs)
        return counted

    for (cls, name), method in zip(wrapped, originals):
        setattr(cls, name, counter(name, method))
    try:
        yield
    finally:
        for (cls, name), method in zip(wrapped, originals):
            setattr(cls, name, method)
