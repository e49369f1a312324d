"""A worker that dies mid-run loses nothing: requests are requeued and recomputed (FakeDevice)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.ipc.sampling import SamplingParams

from engine_harness import Req, run_workload
from test_decode_lane import workloads


def _streams(pipeline: bool, kill_at: int | None, recover: bool = True, burst: int = 1):
    reqs = [
        Req([5 + i, 9, 11], SamplingParams(max_tokens=20 + i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True))
        for i in range(8)
    ]
    return run_workload(reqs, pipeline=pipeline, kill_at_tick=kill_at, recover=recover, stream_interval=burst, max_burst=burst)


def test_worker_death_mid_stream_changes_no_token():
    """Greedy and seeded streams after a kill equal the fault-free run, in both loops and in bursts."""
    for pipeline, burst in ((False, 1), (True, 1), (True, 4)):
        clean = _streams(pipeline, None, burst=burst)
        killed = _streams(pipeline, kill_at=7, burst=burst)
        assert killed.recoveries == 1
        assert killed.streams == clean.streams
        assert killed.finish == clean.finish


def test_fail_mode_fails_inflight_requests_with_a_clear_error():
    """--on-worker-fault fail: every in-flight request gets one worker_fault error."""
    run = _streams(True, kill_at=7, recover=False)
    # Without recovery the test's device stays dead, so every request ends in the error.
    assert set(run.finish.values()) == {"error"}
    assert set(run.error_codes.values()) == {"worker_fault"}
    assert all(run.errors.values())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads, kill_at=st.integers(0, 40), pipeline=st.booleans(), burst=st.sampled_from([1, 1, 4]))
def test_any_workload_survives_a_kill_unchanged(reqs, kill_at, pipeline, burst):
    """For random workloads, a kill at a random tick changes no stream and leaks no block (bursts included;
    without aborts there, since the interval moves when an abort lands)."""
    if burst > 1:
        reqs = [Req(r.prompt, r.params, r.arrive_tick) for r in reqs]
    clean = run_workload(reqs, pipeline=False)
    killed = run_workload(reqs, pipeline=pipeline, kill_at_tick=kill_at, stream_interval=burst, max_burst=burst)
    assert killed.streams == clean.streams
    assert killed.finish == clean.finish
