"""The worker's torch threads on a CPU: --worker-threads, else a policy by core count."""

from __future__ import annotations

from metrale.config import EngineArgs
from metrale.supervisor import _worker_env, default_worker_threads


def test_default_leaves_a_core_only_where_there_are_more_than_two():
    assert [default_worker_threads(c) for c in (1, 2, 3, 4, 16)] == [1, 2, 2, 3, 15]


def test_worker_threads_flag_wins_and_a_gpu_worker_gets_no_thread_setting():
    assert _worker_env(EngineArgs(model="m", worker_threads=3), 1) == {"OMP_NUM_THREADS": "3"}
    assert _worker_env(EngineArgs(model="m", worker_threads=3), 2) == {"OMP_NUM_THREADS": "3"}
    assert _worker_env(EngineArgs(model="m", device="cuda"), 1) == {}
    assert _worker_env(EngineArgs(model="m"), 1)["OMP_NUM_THREADS"].isdigit()


def test_the_ranks_on_a_node_share_the_default_threads():
    """Tensor-parallel ranks on one CPU host split the default threads evenly (at least one each)."""
    one = int(_worker_env(EngineArgs(model="m"), 1)["OMP_NUM_THREADS"])
    assert int(_worker_env(EngineArgs(model="m"), 2)["OMP_NUM_THREADS"]) == max(1, one // 2)
