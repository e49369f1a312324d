"""The chaos soak's CI-sized setting (scripts/soak.py --duration-s 300): faults of every kind under the seeded HTTP
mix, then the fault-free replay. Nothing lost, every greedy or seeded answer equal to the replay, every fault
recovered, nothing left behind. About 12 minutes on 2 cores, so outside README's command: `python -m pytest -m soak`.
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
