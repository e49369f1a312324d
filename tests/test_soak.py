"""The chaos soak's CI-sized setting (scripts/soak.py --duration-s 300): faults of every kind under the seeded HTTP
mix, then the fault-free replay. Nothing lost, every greedy or seeded answer equal to the replay, every fault
recovered, nothing left behind. About 12 minutes on 2 cores, so outside README's command: `python -m pytest -m soak`.

And a minute of its simulated-device mode (--simulate): 128 closed-loop ZMQ streams through a replica kill, a frontend
SIGKILL, a frontend SIGSTOP (never continued: the supervisor's hang watch replaces it, and kills no frontend it was not
told to) and two closed clients; every stream equal to the tokens the simulated device gives its prompt, nothing lost
or left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.soak

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


def test_a_five_minute_soak_loses_nothing_and_leaves_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--duration-s", "300", "--faults", "12", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    assert (tmp_path / "soak.json").exists(), proc.stderr[-3000:]
    r = json.loads((tmp_path / "soak.json").read_text())
    assert r["lost"] == 0, r["lost_examples"]
    assert r["equal_to_replay"] == r["greedy_or_seeded_compared"] > 0, r["mismatched"]
    assert not r["failed_typed"], r["failed_typed"]
    assert r["faults_recovered"] == r["faults_injected"] >= 8, r["faults"]
    assert r["left_after_shutdown"] == [] and r["shm_after_shutdown"] == []
    assert r["shm_at_end"] == r["shm_at_start"]
    assert proc.returncode == 0


def test_a_minute_on_the_simulated_device_with_frontend_faults_loses_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--simulate", "3,0.003,0.002", "--concurrency", "128",
                           "--duration-s", "45", "--faults", "4", "--min-gap-s", "8", "--seed", "0",
                           "--baseline-s", "0", "--hang-timeout-s", "2", "--warmup-s", "5", "--deadline-s", "60",
                           "--frontend-hang-timeout-s", "3",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert (tmp_path / "soak.json").exists(), proc.stderr[-3000:]
    r = json.loads((tmp_path / "soak.json").read_text())
    assert {f["kind"] for f in r["faults"]} >= {"frontend_kill", "frontend_stop", "replica_kill", "client_reset"}
    assert r["lost"] == 0 and not r["failed"], (r["lost_examples"], r["failed"])
    assert r["equal_to_expected"] == r["read_to_end"] > 0, r["not_equal_examples"]
    assert r["aborted_prefix_equal"] == r["aborted_by_clients"], r["not_equal_examples"]
    assert r["faults_recovered"] == r["faults_injected"] == 4, r["faults"]
    assert r["frontend_hang_kills"] == r["fault_kinds"]["frontend_stop"], r["faults"]
    assert r["left_after_shutdown"] == [] and r["shm_after_shutdown"] == []
    assert proc.returncode == 0
