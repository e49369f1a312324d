"""Shared fixtures: tiny model folders, and StepPlans built by hand (what the engine core would build).

torch is not imported here (tests of the engine core and frontend must be able to check that they
never import it); the fixtures that need it import it.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from metrale.ipc.plan import FEED_HOST, MASK_NONE, StepPlan

# One intra-op thread: on tiny models a second thread buys nothing, and on shared cores OpenMP
# threads spinning against other processes' slow every step down several-fold. torch reads this
# when it is first imported; _torch_threads() covers a torch imported earlier.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every quantized product on the forced (or the process's) kernel class, not the one a start-up measurement picks:
# a test that forces a path runs that path (tests/test_kernel_choice.py measures on purpose).
os.environ.setdefault("METRALE_KERNEL_DISPATCH", "rank")


def pytest_sessionstart(session) -> None:
    """Compile every kernel class this CPU runs two at a time in a process of its own, while the first tests run:
    the tests would each build theirs on first use, one compiler at a time, the box's other core idle. A test that
    needs a class still building waits on the build's lock (cpu_kernels._build); the process is stopped at the
    session's end."""
    if os.environ.get("METRALE_CPU_KERNELS", "").strip().lower() == "torch":
        return
    session.config._kernel_prebuild = subprocess.Popen(
        [sys.executable, "-m", "metrale.gpu_worker.layers.cpu_kernels", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def pytest_sessionfinish(session) -> None:
    builder = getattr(session.config, "_kernel_prebuild", None)
    if builder is None or builder.poll() is not None:
        return
    os.killpg(builder.pid, signal.SIGTERM)  # a short session: its compilers stop, no further build starts
    try:
        builder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(builder.pid, signal.SIGKILL)
        builder.wait()


def _torch_threads() -> None:
    """Limit torch to one intra-op thread (see OMP_NUM_THREADS above)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """make_model(arch="llama", **kw) -> Path: a tiny random HF folder, built once per session per arguments."""
    from metrale.gpu_worker.tiny_model import make_tiny_model

    _torch_threads()
    built: dict[tuple, pathlib.Path] = {}

    def make_model(arch: str = "llama", **kw) -> pathlib.Path:
        key = (arch, repr(sorted(kw.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(out, arch, **kw)
        return built[key]

    return make_model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """make_model(kind, **config) -> Path: a tiny random model saved by transformers (tests/hf_models.py), built
    once per session per arguments."""
    from hf_models import make_hf_model

    from metrale.gpu_worker.tiny_model import train_tokenizer

    _torch_threads()
    built: dict[tuple, pathlib.Path] = {}
    tokenizer = []

    def make_model(kind: str, **kw) -> pathlib.Path:
        key = (kind, repr(sorted(kw.items())))
        if key not in built:
            if not tokenizer:
                tokenizer.append(train_tokenizer())
            built[key] = make_hf_model(tmp_path_factory.mktemp(f"hf-{kind}"), kind, tokenizer=tokenizer[0], **kw)
        return built[key]

    return make_model


@pytest.fixture(scope="session")
def default_model(tmp_path_factory) -> pathlib.Path:
    """The "default" preset (the demo model), built in a session temp dir, not the user's cache."""
    from metrale.gpu_worker.tiny_model import make_tiny_model

    _torch_threads()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-default"), "llama", preset="default")


@dataclass
class Row:
    """One row of a hand-built step: the tokens it runs now after `context` cached tokens, in `blocks`."""

    tokens: list[int]  # this step's input tokens (for a fed row: a placeholder, the device feeds it)
    context: int  # tokens of the sequence already in the KV cache
    blocks: list[int]  # the sequence's block table
    sample: bool = True
    feed_from_row: int = FEED_HOST
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_logprobs: int = -1
    hist: list[int] = field(default_factory=list)
    state_slot: int = -1  # its recurrent state slot (a recurrent model's rows need one; -1: none)


def make_plan(rows: list[Row], *, block_size: int = 16) -> StepPlan:
    """A StepPlan for the rows, laid out as the engine core lays it out."""
    q_lens = np.array([len(r.tokens) for r in rows], dtype=np.int32)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(r.context, r.context + len(r.tokens)) for r in rows]).astype(np.int32)
    slots = []
    for r in rows:
        for pos in range(r.context, r.context + len(r.tokens)):
            slots.append(r.blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(r.blocks) for r in rows)
    tables = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        tables[i, : len(r.blocks)] = r.blocks
    n = len(rows)
    hist = [np.asarray(r.hist, dtype=np.int32) for r in rows]
    return StepPlan(
        input_ids=np.concatenate([np.asarray(r.tokens, dtype=np.int32) for r in rows]),
        positions=positions,
        slot_mapping=np.asarray(slots, dtype=np.int64),
        query_start=query_start,
        seq_lens=np.array([r.context + len(r.tokens) for r in rows], dtype=np.int32),
        block_tables=tables,
        sample=np.array([r.sample for r in rows], dtype=bool),
        feed_from_row=np.array([r.feed_from_row for r in rows], dtype=np.int32),
        temperature=np.array([r.temperature for r in rows], dtype=np.float32),
        top_k=np.array([r.top_k for r in rows], dtype=np.int32),
        top_p=np.array([r.top_p for r in rows], dtype=np.float32),
        min_p=np.zeros(n, dtype=np.float32),
        repetition_penalty=np.ones(n, dtype=np.float32),
        presence_penalty=np.zeros(n, dtype=np.float32),
        frequency_penalty=np.zeros(n, dtype=np.float32),
        seeds=np.array([r.seed for r in rows], dtype=np.int64),
        mask_kind=np.full(n, MASK_NONE, dtype=np.uint8),
        force_token=np.zeros(n, dtype=np.int32),
        ban_ids=np.full((n, 1), -1, dtype=np.int32),
        num_logprobs=np.array([r.num_logprobs for r in rows], dtype=np.int32),
        hist_tokens=np.concatenate(hist) if hist else np.zeros(0, dtype=np.int32),
        hist_start=np.concatenate([[0], np.cumsum([len(h) for h in hist])]).astype(np.int32),
        hist_prompt_len=np.array([len(h) for h in hist], dtype=np.int32),
        state_slots=np.array([r.state_slot for r in rows] if rows[0].state_slot >= 0 else [], dtype=np.int32),
    )


def blocks_for(seq_index: int, max_len: int, block_size: int = 16, num_seqs: int = 32) -> list[int]:
    """A fixed block table for test sequence seq_index: disjoint from the others', scattered over the
    pool (so paging bugs show), never block 0."""
    per_seq = -(-max_len // block_size)
    pool = np.random.default_rng(1234).permutation(per_seq * num_seqs) + 1
    return [int(b) for b in pool[seq_index * per_seq : (seq_index + 1) * per_seq]]


@pytest.fixture(scope="session")
def plans():
    """Helpers for hand-built steps: plans.Row, plans.make_plan(rows, block_size=), plans.blocks_for(i, max_len)."""
    return SimpleNamespace(Row=Row, make_plan=make_plan, blocks_for=blocks_for)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """make_gguf(arch="llama", outtype="f32", **kw) -> Path of a .gguf written from tiny_model_dir(arch, **kw);
    outtype may also be a K-quant (q4_k, q5_k, q6_k: random blocks, see tests/gguf_models.py)."""
    from gguf_models import K_QUANTS, random_k_quant_encoder

    from metrale.gpu_worker.gguf_export import write_gguf

    built: dict[tuple, pathlib.Path] = {}

    def make_gguf(arch: str = "llama", outtype: str = "f32", **kw) -> pathlib.Path:
        key = (arch, outtype, repr(sorted(kw.items())))
        if key not in built:
            src = tiny_model_dir(arch, **kw)
            out = tmp_path_factory.mktemp(f"gguf-{arch}-{outtype}") / f"tiny-{arch}.{outtype}.gguf"
            if outtype in K_QUANTS:
                built[key] = write_gguf(src, out, "f32", encode=random_k_quant_encoder(outtype))
            else:
                built[key] = write_gguf(src, out, outtype)
        return built[key]

    return make_gguf


def _kernel_classes() -> list[str]:
    """The CPU kernel classes this box can run (metrale/cpu_isa.py), unless the torch path is forced."""
    from metrale import cpu_isa

    if os.environ.get("METRALE_CPU_KERNELS", "").strip().lower() == "torch":
        return []
    return cpu_isa.supported()


@pytest.fixture(params=_kernel_classes() or [pytest.param(None, marks=pytest.mark.skip(reason="torch path forced"))])
def kernel_isa(request, monkeypatch) -> str:
    """Each kernel class this CPU can run in turn: cpu_kernels' wrappers call that class's build for the test
    (a test that takes it checks every path the box has, whatever the process's own class is)."""
    return use_kernel_class(request.param, monkeypatch)


def use_kernel_class(cls: str, monkeypatch, unit: str | None = None, op: str | None = None) -> str:
    """Point cpu_kernels' wrappers at class cls's build for one test (skipped when it cannot be built here, or
    when `op` of `unit` did not build, unless METRALE_CPU_KERNELS=native asks for a failure instead)."""
    from metrale.gpu_worker.layers import cpu_kernels

    try:
        ns = cpu_kernels.ops(cls)
    except RuntimeError as exc:
        if cpu_kernels.choice() == "native":
            raise
        pytest.skip(f"{cls} kernels unavailable: {exc}")
    if op is not None and not cpu_kernels.has(op, cls):
        pytest.skip(f"the {cls} {unit} unit is unavailable: {cpu_kernels._errors.get(f'{cls}/{unit}')}")
    monkeypatch.setitem(cpu_kernels._active, "isa", cls)
    monkeypatch.setitem(cpu_kernels._active, "ops", ns)
    return cls


def expected_kernels() -> str:
    """The kernels a CPU worker started from this environment reports (ModelInfo.kernels): the chosen class,
    or "torch" when the native kernels are turned off or cannot be built here."""
    from metrale import cpu_isa
    from metrale.gpu_worker.layers import cpu_kernels

    return cpu_isa.chosen() if cpu_kernels.available() else "torch"
