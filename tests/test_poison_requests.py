"""A request that makes the engine raise fails alone; the process and every other request go on unchanged."""

from __future__ import annotations

import pytest

from metrale.testing.fake_device import FakeFaults
from metrale.ipc.sampling import SamplingParams

from engine_harness import Req, run_workload


def greedy(n: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0 if seed is None else 0.8, seed=seed, ignore_eos=True)


def workload() -> list[Req]:
    """Seven ordinary requests and one (index 3) that grows into a length the device cannot take."""
    reqs = [Req([5 + i, 6, 7, 8], greedy(20, seed=i if i % 2 else None), arrive_tick=i % 3) for i in range(8)]
    reqs[3] = Req([9] * 40, greedy(20), arrive_tick=1)
    return reqs


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_poison_request_fails_alone_and_the_others_stream_unchanged(pipeline):
    clean = run_workload(workload(), pipeline=False)
    poisoned = run_workload(workload(), pipeline=pipeline, device_faults=FakeFaults(poison_seq_len=45),
                            contain_failures=True)
    assert poisoned.failures == 2  # once with its batch, once alone: then it is failed
    assert poisoned.finish["3"] == "error" and poisoned.error_codes["3"] == "internal"
    assert "failed 2 times" in poisoned.errors["3"]
    got = poisoned.streams["3"]  # what it streamed before the failure stands
    assert got and got == clean.streams["3"][: len(got)]
    for rid in clean.streams:
        if rid != "3":
            assert poisoned.streams[rid] == clean.streams[rid], rid
            assert poisoned.finish[rid] == clean.finish[rid]


def test_an_exception_while_a_step_is_settled_leaves_nothing_in_flight(monkeypatch):
    """The commit raises once while a step launched ahead is in flight: containment awaits that step and every row
    gives its positions back, so the requeued requests recompute from where they stood and stream what a clean
    run streams (one failure each, none failed)."""
    from metrale.engine_core import decode_lane

    reqs = [Req([5 + i, 6, 7, 8], greedy(12)) for i in range(3)]
    clean = run_workload(reqs, pipeline=True)
    commit = decode_lane.commit_tokens
    calls = [0]

    def breaks_once(io, seqs, tokens, result, skip):
        calls[0] += 1
        if calls[0] == 6:  # a decode step, with the next one launched ahead of it
            raise ValueError("a commit that breaks once")  # what the harness contains, as core.py does any error
        return commit(io, seqs, tokens, result, skip)

    monkeypatch.setattr(decode_lane, "commit_tokens", breaks_once)
    run = run_workload(reqs, pipeline=True, contain_failures=True)
    assert run.failures == 1
    assert run.streams == clean.streams and set(run.finish.values()) == {"length"}
