"""Tensor parallel on a CPU: two ranks on gloo (and the shared-memory all-reduce) give the tokens of one.

Every family's tiny model runs a fixed schedule (greedy and seeded rows, prefill then device-fed decode) on a
group of two worker ranks and on a plain runner; float32 tokens must be identical, bfloat16 agreement is
reported. Then the same through metrale.LLM(tensor_parallel_size=2), whose ranks are worker processes on a
ticket ring, and the group's faults: a rank that dies takes the group down at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from metrale import LLM, SamplingParams
from metrale.ipc import worker_group

import tp_ranks

HERE = os.path.dirname(__file__)
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
HF_KINDS = ("gemma2", "gemma3", "phi3", "olmo2", "qwen3_moe", "mixtral")


def _run_group(models: list[tuple[str, str]], tmp_path, all_reduce: str = "auto", size: int = 2) -> dict:
    """Run tp_ranks.py's schedule on every (model, dtype) in a group of `size` rank processes; rank 0's output."""
    out = tmp_path / f"tp-{all_reduce}.json"
    job = json.dumps({"models": [[str(p), d] for p, d in models], "out": str(out)})
    specs = worker_group.group_specs(size, all_reduce=all_reduce, timeout_s=120.0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "tp_ranks.py"), worker_group.encode(s), job],
                              env=env, cwd=HERE) for s in specs]
    try:
        for p in procs:
            assert p.wait(300) == 0, "a rank failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def family_models(tiny_model_dir, hf_model_dir):
    """Every family's tiny model: (name, folder)."""
    models = [(arch, tiny_model_dir(arch)) for arch in TINY_ARCHS]
    return models + [(kind, hf_model_dir(kind)) for kind in HF_KINDS]


def test_every_family_tp2_is_token_identical_to_tp1_in_float32(family_models, tmp_path):
    """Each family (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo 2, Qwen3-MoE, Mixtral) on two ranks over the
    shared-memory all-reduce: the same greedy and seeded tokens as one rank; bfloat16 agreement reported."""
    from metrale.gpu_worker.model_runner import ModelRunner

    runs = [(path, dtype) for dtype in ("float32", "bfloat16") for _, path in family_models]
    got = _run_group(runs, tmp_path)
    assert got["all_reduce"] == "shm", "auto picks the shared-memory all-reduce on one CPU host"
    report = []
    for i, ((name, path), dtype) in enumerate((m, d) for d in ("float32", "bfloat16") for m in family_models):
        want = tp_ranks.run_schedule(ModelRunner(path, dtype=dtype, device="cpu", num_kv_blocks=256, show_progress=False))
        if dtype == "float32":
            assert got["runs"][i] == want, f"{name}: TP=2 float32 tokens differ from TP=1"
            continue
        # Free-running rows: the first differing token (a rounding tie in bf16) changes the rest of its row.
        same = sum(_common_prefix(x, y) for x, y in zip(got["runs"][i], want))
        report.append((name, same, sum(len(x) for x in want)))
    agree, total = sum(r[1] for r in report), sum(r[2] for r in report)
    print("bfloat16 TP=2 vs TP=1, tokens before the first difference per row:",
          ", ".join(f"{name} {a}/{t}" for name, a, t in report), f"(all: {agree}/{total})")
    assert agree / total >= 0.75, f"bfloat16 TP=2 vs TP=1 agreement {agree}/{total}: the bf16 path is broken"


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two rows share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_broadcast_plan_keeps_every_field():
    """What rank 0 packs for the off-host ranks unpacks to the plan bit for bit, grammar bitmask rows, drafts and
    state slots included (the header's counts fit its int64s)."""
    import numpy as np

    from metrale.gpu_worker import plan_broadcast
    from test_tickets import assert_plans_equal, random_plan

    rng = np.random.default_rng(4)
    for state in (False, True):
        plan = random_plan(rng, 9, 4, 3, 2, 5, state=state)
        plan.grammar_bitmask = rng.integers(-(2**31), 2**31, size=(2, 3), dtype=np.int32)
        plan.num_drafts = np.array([0, 2, 0, 1], dtype=np.int32)
        plan.prompt_lp_n, plan.prompt_lp_count = np.array([3, -1, 0, -1], np.int32), np.array([2, 0, 1, 0], np.int32)
        plan.prompt_lp_next = np.array([17, -1, -1, -1], np.int32)
        counts = plan_broadcast.counts_of(plan)
        assert len(counts) == len(plan_broadcast.PLAN_COUNTS) and 4 + len(counts) <= plan_broadcast._HEADER
        _, nbytes = plan_broadcast._layout(counts)
        raw = np.zeros(nbytes, dtype=np.uint8)
        plan_broadcast.pack(plan, counts, raw)
        assert_plans_equal(plan_broadcast.unpack(counts, raw), plan)


def test_gloo_all_reduce_gives_the_same_tokens(tiny_model_dir, tmp_path):
    """The gloo path (the one that spans hosts) sums to the same tokens as the shared-memory one."""
    from metrale.gpu_worker.model_runner import ModelRunner

    path = tiny_model_dir("qwen3")
    got = _run_group([(path, "float32")], tmp_path, all_reduce="gloo")
    assert got["all_reduce"] == "gloo"
    assert got["threads_after_close"] == [], "closing the group left gloo's threads running"
    want = tp_ranks.run_schedule(ModelRunner(path, dtype="float32", device="cpu", num_kv_blocks=256, show_progress=False))
    assert got["runs"][0] == want


N = 8
PROMPTS = [f"def g{i}(y):\n    return y - {i} * " for i in range(N)]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=300 + i, ignore_eos=True)


GRAMMAR = r"[0-9]{2,4}-(ab|cd)"


@pytest.mark.parametrize("arch", ["llama"])
def test_llm_with_two_ranks_matches_one(arch, tiny_model_dir, hf_model_dir):
    """metrale.LLM(tensor_parallel_size=2): two worker processes on a ticket ring, the tokens of LLM() alone,
    grammar rows among them (greedy and seeded: the plan's bitmask reaches every rank through the ring, and rank
    0's picks, which the host commits, hold the grammar and equal one rank's) and a request's prompt logprobs (the
    ring's prompt regions); closing it leaves no process behind."""
    from metrale.ipc.sampling import StructuredOutputs

    path = tiny_model_dir(arch) if arch in TINY_ARCHS else hf_model_dir(arch)
    so = StructuredOutputs(regex=GRAMMAR)
    params = [_params(i) for i in range(N)] + [
        SamplingParams(max_tokens=24, temperature=0.0 if i else 0.8, seed=7, structured_outputs=so) for i in range(2)
    ] + [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)]
    prompts = PROMPTS + ["Code:", "Id:", PROMPTS[0] * 3]
    with LLM(str(path), show_progress=False) as llm:
        alone = llm.generate(prompts, params)
    want = [r.token_ids for r in alone]
    llm = LLM(str(path), show_progress=False, tensor_parallel_size=2)
    procs = llm.device.processes
    try:
        assert len(procs) == 2 and llm.device.pids == [p.pid for p in procs]
        outs = llm.generate(prompts, params)
    finally:
        llm.close()
    assert [r.token_ids for r in outs] == want
    got_lp, want_lp = outs[-1].prompt_logprobs, alone[-1].prompt_logprobs
    assert len(got_lp) == len(want_lp) == len(outs[-1].prompt_token_ids) and got_lp[0] is None
    assert [(e.token_id, e.top_ids) for e in got_lp[1:]] == [(e.token_id, e.top_ids) for e in want_lp[1:]]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got_lp[1:], want_lp[1:])) < 1e-4
    for r in outs[N:N + 2]:
        assert r.finish_reason == "stop" and re.fullmatch(GRAMMAR, r.text), r.text
    assert all(p.poll() is not None for p in procs), "closing the LLM stops its ranks"


def test_a_killed_rank_takes_its_group_down(tiny_model_dir):
    """SIGKILL rank 1 of a running group: the device is lost at once (not a hang), and rank 0, whose collective
    can never finish, exits on its own."""
    from metrale.engine_core.worker_device import WorkerDevice
    from metrale.ipc.plan import DeviceLost
    from metrale.ipc.tickets import RingGeometry

    from conftest import Row, make_plan

    path = tiny_model_dir("llama")
    device = WorkerDevice.spawn(RingGeometry(), runner_kwargs={"model_dir": str(path), "num_kv_blocks": 64,
                                                               "show_progress": False},
                                env={"OMP_NUM_THREADS": "1"}, tensor_parallel_size=2)
    try:
        rank0, rank1 = device.processes
        plan = make_plan([Row([5, 6, 7], 0, [1])])
        assert device.await_result(device.launch(plan)).tokens[0] >= 0
        os.kill(rank1.pid, signal.SIGKILL)
        ticket = device.launch(make_plan([Row([5, 6, 7], 0, [2])]))
        with pytest.raises(DeviceLost, match="worker rank"):
            device.await_result(ticket)
        assert rank0.wait(30) != 0, "rank 0 left its broken group with an error"
    finally:
        device.close()
    assert all(p.poll() is not None for p in (rank0, rank1))
    assert not psutil.pid_exists(rank1.pid) or psutil.Process(rank1.pid).status() == psutil.STATUS_ZOMBIE
