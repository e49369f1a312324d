"""One owner per type of a request's state: every write to a field of Request, Sequence, KvPlacement, Output or
RowState (and every call of finish() and post()) in an engine_core module that uses those types (imports them
from .sequence) comes from a module OWNERS names for its type."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

from metrale.engine_core.sequence import KvPlacement, Output, Request, RowState, Sequence
from metrale.ipc.sampling import SamplingParams

ENGINE_CORE = pathlib.Path(__file__).resolve().parents[1] / "engine_core"

# The modules that write each type (sequence.py's own methods aside).
OWNERS: dict[type, frozenset[str]] = {
    Request: frozenset(),  # frozen: made once by the engine (Sequence.of)
    Sequence: frozenset({"scheduler", "decode_lane"}),  # progress: the lane settles it, the scheduler moves it
    KvPlacement: frozenset({"kv_blocks"}),  # its block table is a row of the block pool's table
    # the commit appends tokens and fills the outbox, the engine takes it; a beam search sets its rows' tokens to
    # the beams it picks (beam_groups.py)
    Output: frozenset({"commit", "engine", "beam_groups"}),
    RowState: frozenset({"pipeline"}),  # the state behind row masks
}
# Who may end a request: the commit's stops, the lane's device errors, the engine's aborts and failures, the
# scheduler's KV refusals, a beam search ending its rows; and who files it in the outbox.
CALLS: dict[str, frozenset[str]] = {
    "finish()": frozenset({"commit", "decode_lane", "engine", "scheduler", "beam_groups"}),
    "post()": frozenset({"commit"}),
}
TYPE_OF = {f.name: t for t in OWNERS for f in dataclasses.fields(t)}
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove", "sort", "fill"}


def writes(source: str) -> list[tuple[int, str]]:
    """(line, field or "method()") of each write to a state field or call of a writing method in source.

    A write is an assignment (plain, augmented, to an item) or a mutating call on `x.field`; `self.field` does not
    count (outside sequence.py, `self` is another class's own state)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]:
            t = t.value if isinstance(t, ast.Subscript) else t
            if isinstance(t, ast.Attribute) and t.attr in TYPE_OF:
                found.append((t.attr, node.lineno, t.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in MUTATORS and isinstance(f.value, ast.Attribute) and f.value.attr in TYPE_OF:
                found.append((f.value.attr, node.lineno, f.value.value))
            elif f.attr in ("finish", "post"):
                found.append((f.attr + "()", node.lineno, f.value))
    return sorted((line, name) for name, line, obj in found if not (isinstance(obj, ast.Name) and obj.id == "self"))


def owners(name: str) -> frozenset[str]:
    return CALLS[name] if name in CALLS else OWNERS[TYPE_OF[name]]


def strays(root: pathlib.Path) -> list[str]:
    """Every write in root's modules by a module that does not own the field's type."""
    out = []
    for path in sorted(root.glob("*.py")):
        source = path.read_text()
        if path.stem == "sequence" or "from .sequence import" not in source:
            continue  # the types' own methods; a module that never sees them (its fields are others')
        for line, name in writes(source):
            if path.stem not in owners(name):
                kind = name if name in CALLS else f"{TYPE_OF[name].__name__}.{name}"
                out.append(f"{path.name}:{line} writes {kind} (owners: {sorted(owners(name)) or 'none: frozen'})")
    return out


def test_every_write_to_a_request_s_state_is_its_type_s_owner_s():
    assert strays(ENGINE_CORE) == []


def test_a_write_from_another_module_is_caught(tmp_path):
    """The check sees each shape of write: assignment, augmented, item, a list mutation, a finish; on each type."""
    (tmp_path / "scheduler.py").write_text("from .sequence import Sequence\ndef f(seq):\n    seq.num_computed = 0\n"
                                          "    seq.status = 1\n")
    (tmp_path / "engine.py").write_text(
        "from .sequence import Sequence\ndef g(s, xs):\n    s.num_computed += 1\n    xs[0].out.tokens.append(3)\n    s.kv.num_blocks = 2\n"
        "    s.out.reported = 0\n    s.finish('stop')\n    s.row_state.in_think = True\n    s.req.seed = 3\n")
    assert [line.split(" (")[0] for line in strays(tmp_path)] == [
        "engine.py:3 writes Sequence.num_computed", "engine.py:5 writes KvPlacement.num_blocks",
        "engine.py:8 writes RowState.in_think", "engine.py:9 writes Request.seed",
    ]


def test_every_field_belongs_to_one_type_and_every_owner_exists():
    """A field name names one type (the check finds a write's type by it), and OWNERS names modules that exist."""
    names = [f.name for t in OWNERS for f in dataclasses.fields(t)]
    assert len(names) == len(set(names))
    modules = {p.stem for p in ENGINE_CORE.glob("*.py")}
    assert set().union(*OWNERS.values(), *CALLS.values()) <= modules


def test_the_request_is_frozen_and_a_sequence_is_small():
    seq = Sequence.of("r", SamplingParams(), 0, [1, 2], 2, 0)
    try:
        seq.req.seed = 1
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("Request is writable")
    assert len(dataclasses.fields(Sequence)) <= 20


def test_block_table_tokens_and_sampling_params_are_each_held_once():
    """Across the state types one field holds the tokens (Output.tokens, the prompt then the output), one the
    sampling params (Request.params) and none a block table (KvPlacement points at a row of the pool's table); the
    plan builder reads a sequence's tokens and blocks where they are, so what it builds follows every change."""
    fields = [(t.__name__, f.name, str(f.type)) for t in OWNERS for f in dataclasses.fields(t)]
    assert [(t, n) for t, n, ty in fields if "SamplingParams" in ty] == [("Request", "params")]
    assert [(t, n) for t, n, _ in fields if "token" in n and "think" not in n and "cached" not in n] == [("Output", "tokens")]
    assert not [(t, n) for t, n, ty in fields if "block" in n and "list" in ty and n != "host_blocks"]

    from metrale.engine_core.kv_blocks import KvBlockPool
    from metrale.engine_core.pipeline import NO_MASK
    from metrale.engine_core.step_builder import StepBuilder

    pool = KvBlockPool(8, 4)
    builder = StepBuilder(pool, max_tokens=16, max_rows=2, max_model_len=32)
    seq = Sequence.of("r", SamplingParams(repetition_penalty=1.2), 0, [5, 6, 7], 3, 0)
    assert pool.allocate(seq, 3)
    first = builder.build([seq], [3], [NO_MASK])
    assert first.block_tables.tolist() == [pool.blocks(seq)] and first.hist_tokens.tolist() == [5, 6, 7]
    seq.num_computed = 3
    seq.out.tokens.append(8)
    pool.free(seq)  # and taken again: other blocks, maybe another row
    assert pool.allocate(seq, 4)
    second = builder.build([seq], [1], [NO_MASK])
    assert second.block_tables.tolist() == [pool.blocks(seq)] and second.hist_tokens.tolist() == [5, 6, 7, 8]
