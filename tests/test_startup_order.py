"""`metrale serve`'s start-up order: what runs before the worker (the longest child to start) is spawned, and
what the worker does while the engine core is still making its ring."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from metrale.gpu_worker import worker


def test_the_worker_imports_its_runner_before_the_engine_cores_ring_exists(tmp_path, monkeypatch):
    # A runner module that notes its import; no doorbell ever listens at the ring's path.
    (tmp_path / "noted_runner.py").write_text("IMPORTED = True\nclass Runner:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noted_runner", raising=False)
    config = worker.WorkerConfig(ring_name="metrale-0-nosuchring", factory="noted_runner:Runner", runner_kwargs={},
                                 connect_timeout_s=0.0)
    with pytest.raises(TimeoutError):
        worker.run_worker(config)
    assert "noted_runner" in sys.modules  # imported while waiting for the ring, not only once it is attached


def test_a_runner_that_cannot_be_imported_fails_where_the_runner_is_built(monkeypatch):
    # The early import swallows the error: the worker still reaches its doorbell (here: none) first.
    config = worker.WorkerConfig(ring_name="metrale-0-nosuchring", factory="no_such_runner_module:Runner",
                                 runner_kwargs={}, connect_timeout_s=0.0)
    with pytest.raises(TimeoutError):
        worker.run_worker(config)


def test_the_supervisor_checks_a_model_without_the_engine_or_jinja(tiny_model_dir, tmp_path):
    # The supervisor's checks run before any child starts: importing metrale.llm (the engine) or the chat
    # module (Jinja) there delays every child.
    script = textwrap.dedent(f"""
        import shutil, sys
        from metrale.config import EngineArgs, ServeConfig
        from metrale.supervisor import Supervisor
        sup = Supervisor(ServeConfig(engine=EngineArgs(model={str(tiny_model_dir())!r}), port=0))
        shutil.rmtree(sup.run_dir, ignore_errors=True)
        print(sorted(m for m in ("metrale.llm", "metrale.engine_core.engine", "jinja2", "torch") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
