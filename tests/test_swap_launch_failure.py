"""Swap copies survive a launch that fails after the builder took them (issue 27's note): they ride the next plan."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.engine_core.swap import SwapSpace
from metrale.ipc.plan import FEED_HOST, DeviceError
from metrale.ipc.sampling import SamplingParams
from metrale.testing.fake_device import FakeDevice

from engine_harness import Req, run_workload

REQS = [Req([4 + i, 5, 6], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(32)]
TIGHT = dict(pipeline=True, num_kv_blocks=8 * 11, max_num_seqs=32, preemption_mode="swap", num_swap_blocks=400)


def carries_copies(plan) -> bool:
    return len(plan.swap_out) > 0 or len(plan.swap_in) > 0


@pytest.fixture
def declining(monkeypatch):
    """FakeDevice declines (DeviceError at launch) the plans chosen by `declining.rule(plan)`, once each; the
    declined plans are counted by what they carried."""
    launch = FakeDevice.launch
    state = {"rule": lambda plan: False, "declined": [], "copies_run": 0}

    def declining_launch(self, plan, *args, **kw):
        if carries_copies(plan) and state["rule"](plan):
            fed = bool((plan.feed_from_row != FEED_HOST).any())
            state["declined"].append((len(plan.swap_out), len(plan.swap_in), fed))
            raise DeviceError("declined by the test")
        state["copies_run"] += len(plan.swap_out) + len(plan.swap_in)
        return launch(self, plan, *args, **kw)

    monkeypatch.setattr(FakeDevice, "launch", declining_launch)
    return state


def test_a_declined_step_launched_ahead_gives_its_swap_copies_to_the_next_plan(declining):
    """Every step launched ahead that carries swap copies is declined: the lane settles and launches again, and
    the copies go with that plan. Streams equal a roomy run's, every host block comes back."""
    roomy = run_workload(REQS, pipeline=True, num_kv_blocks=1024, max_num_seqs=32)
    declining["rule"] = lambda plan: bool((plan.feed_from_row != FEED_HOST).any())
    tight = run_workload(REQS, **TIGHT)
    assert declining["declined"], "some step launched ahead carried swap copies"
    stats = tight.engine.stats()
    assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
    assert declining["copies_run"] == stats.swapped_out_blocks + stats.swapped_in_blocks, "no copy lost"
    assert tight.streams == roomy.streams
    assert tight.engine.scheduler.swap.num_free == 400


def test_a_failed_step_keeps_the_swap_outs_of_sequences_it_did_not_run(declining):
    """A host-fed step that carries swap-outs fails: its own rows end with the error, the sequences parked on the
    host meanwhile still get their copies and stream exactly what they would have."""
    roomy = run_workload(REQS, pipeline=True, num_kv_blocks=1024, max_num_seqs=32)
    declining["rule"] = lambda plan: len(plan.swap_out) > 0 and not declining["declined"]  # the first such step
    tight = run_workload(REQS, **TIGHT)
    assert len(declining["declined"]) == 1
    failed = {rid for rid, reason in tight.finish.items() if reason == "error"}
    assert failed and len(failed) < len(REQS)
    assert {rid: s for rid, s in tight.streams.items() if rid not in failed} == \
        {rid: s for rid, s in roomy.streams.items() if rid not in failed}
    assert tight.engine.scheduler.swap.num_free == 400


def test_put_back_queues_the_copies_first_and_holds_their_host_blocks_again():
    swap = SwapSpace(4)
    out_hosts, in_hosts = swap.take(2), swap.take(1)
    swap.queue_out([10, 11], out_hosts)
    swap.queue_in(in_hosts, [20])
    out, into = swap.take_copies()
    assert swap.num_free == 2  # the swapped-in host block is free once a plan carries its copy
    swap.put_back(out, into)  # ... but that plan was never launched
    assert swap.num_free == 1
    swap.queue_out([12], swap.take(1))  # a later preemption's copy goes after them
    out2, into2 = swap.take_copies()
    assert out2.tolist() == [[10, out_hosts[0]], [11, out_hosts[1]], [12, out2[2, 1]]]
    assert into2.tolist() == [[in_hosts[0], 20]] and swap.num_free == 1
    swap.put_back(np.zeros((0, 2), np.int32), into2[:0])  # rows that failed: their host blocks stay free
    assert swap.num_free == 1 and not swap.swap_in and not swap.swap_out
