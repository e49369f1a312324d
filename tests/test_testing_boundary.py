"""The product never imports its test scaffolding: metrale.testing (FakeDevice, FakeClock) is for tests and
benchmark scripts only."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("metrale", "frontend", "engine_core", "gpu_worker", "ipc")
IMPORT = re.compile(r"^\s*(?:from\s+metrale\.testing\b|from\s+metrale\s+import\s+testing\b|import\s+metrale\.testing\b)", re.M)


def test_no_product_module_imports_metrale_testing():
    offenders = []
    for folder in PRODUCT:
        for path in (REPO / folder).rglob("*.py"):
            if path.is_relative_to(REPO / "metrale" / "testing"):
                continue
            if IMPORT.search(path.read_text(encoding="utf-8")):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_the_fake_device_lives_outside_the_engine_core():
    assert not (REPO / "engine_core" / "fake_device.py").exists()
    assert (REPO / "metrale" / "testing" / "fake_device.py").exists()
