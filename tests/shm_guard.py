"""An autouse fixture for test modules that make ticket rings: every test leaves /dev/shm as it found it."""

from __future__ import annotations

import glob
import os

import pytest

from metrale.ipc.segments import SEGMENT_PREFIX, SHM_DIR


def our_segments() -> list[str]:
    """The metrale entries (segments and doorbells) in /dev/shm that this test process owns."""
    return glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def no_segment_left_behind():
    """Every test leaves /dev/shm as it found it."""
    before = set(our_segments())
    yield
    assert set(our_segments()) == before
