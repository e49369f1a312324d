"""One owner per piece of a request's state: every write to a Sequence field (and every call of finish() and
post()) in engine_core/ comes from a module engine_core/sequence.py's WRITERS names for it."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

from metrale.engine_core.sequence import WRITERS, Sequence

ENGINE_CORE = pathlib.Path(__file__).resolve().parents[1] / "engine_core"
FIELDS = {f.name for f in dataclasses.fields(Sequence)}
MUTATORS = {"append", "extend", "clear", "pop", "insert", "remove", "sort"}


def writes(source: str) -> list[tuple[int, str]]:
    """(line, field or "method()") of each write to a Sequence field or call of a writing method in source.

    A write is an assignment (plain, augmented, to an item) or a mutating list call on `x.field`; `self.field`
    counts only in sequence.py (elsewhere `self` is another class's own state)."""
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
            if isinstance(t, ast.Attribute) and t.attr in FIELDS:
                found.append((t.attr, node.lineno, t.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in MUTATORS and isinstance(f.value, ast.Attribute) and f.value.attr in FIELDS:
                found.append((f.value.attr, node.lineno, f.value.value))
            elif f.attr in ("finish", "post"):
                found.append((f.attr + "()", node.lineno, f.value))
    return sorted((line, name) for name, line, obj in found if not (isinstance(obj, ast.Name) and obj.id == "self"))


def strays(root: pathlib.Path) -> list[str]:
    """Every write in root's modules by a module that does not own the field."""
    out = []
    for path in sorted(root.glob("*.py")):
        if path.stem == "sequence":
            continue  # the Sequence's own methods
        for line, name in writes(path.read_text()):
            if path.stem not in WRITERS.get(name, frozenset()):
                out.append(f"{path.name}:{line} writes {name} (owners: {sorted(WRITERS.get(name, [])) or 'none: set at creation'})")
    return out


def test_every_write_to_a_request_s_state_is_its_owner_s():
    assert strays(ENGINE_CORE) == []


def test_a_write_from_another_module_is_caught(tmp_path):
    """The check sees each shape of write: assignment, augmented, item, a list mutation, a finish."""
    (tmp_path / "scheduler.py").write_text("def f(seq):\n    seq.num_computed = 0\n    seq.status = 1\n")
    (tmp_path / "engine.py").write_text(
        "def g(s, xs):\n    s.num_computed += 1\n    xs[0].tokens.append(3)\n    s.block_table[0] = 2\n"
        "    s.pending = []\n    s.finish('stop')\n    self_like = s\n    self_like.seed = 3\n")
    assert [line.split(" (")[0] for line in strays(tmp_path)] == [
        "engine.py:2 writes num_computed", "engine.py:3 writes tokens", "engine.py:4 writes block_table",
        "engine.py:8 writes seed",
    ]


def test_every_field_that_changes_has_an_owner():
    """WRITERS names fields and modules that exist (a renamed field or module would leave a rule that checks
    nothing)."""
    modules = {p.stem for p in ENGINE_CORE.glob("*.py")}
    assert {n for n in WRITERS if not n.endswith("()")} <= FIELDS
    assert set().union(*WRITERS.values()) <= modules
