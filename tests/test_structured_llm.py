"""Structured outputs through metrale.LLM on a tiny random model: the real sampler applies the bitmask, outputs
validate, the lane on and off agree, and a grammar that does not compile is a ValueError for that call only.

The weights are random, so what holds here holds for any model: a grammar, not the model, makes the output valid.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from metrale import LLM, SamplingParams
from metrale.ipc.sampling import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]},
    },
    "required": ["name", "age", "tags", "home"],
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), show_progress=False, max_num_seqs=8) as engine:
        yield engine


def _params(so: StructuredOutputs, i: int, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.8, seed=i, structured_outputs=so)


def test_json_schema_outputs_validate(llm):
    """Six requests, greedy and seeded, with nested objects, arrays, enums and required fields: valid JSON.

    (xgrammar's JSON strings admit raw control characters, which a random model picks: strict=False reads them.)"""
    outs = llm.generate([f"Person {i}:" for i in range(6)], [_params(StructuredOutputs(json=SCHEMA), i) for i in range(6)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text, strict=False), SCHEMA)


@pytest.mark.parametrize("so, holds", [
    (StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (StructuredOutputs(choice=["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
    (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t, strict=False), dict)),
    (StructuredOutputs(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"'), lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
])  # fmt: skip
def test_regex_choice_object_and_ebnf_hold(llm, so, holds):
    """Each kind of constraint holds for greedy and seeded picks."""
    max_tokens = 400 if so.json_object else 40  # any object: the random model writes long strings
    outs = llm.generate(["a", "b c", "d e f", "g"], [_params(so, i, max_tokens) for i in range(4)])
    for out in outs:
        if so.json_object and out.finish_reason == "length":
            continue  # an unbounded object may not close in time; what was written is still its prefix
        assert out.finish_reason == "stop" and holds(out.text), out.text


def test_pipelined_equals_synchronous_under_grammars(tiny_model_dir, llm):
    """Grammar rows batched with plain ones, greedy and seeded: the lane on and off give the same tokens."""
    kinds = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex="[a-z]{4,9}"), None]
    params = [SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.7, seed=i, structured_outputs=kinds[i % 3])
              for i in range(6)]
    prompts = [f"prompt number {i}" for i in range(6)]
    piped = llm.generate(prompts, params)
    with LLM(str(tiny_model_dir("llama")), show_progress=False, pipeline=False, max_num_seqs=8) as sync:
        plain = sync.generate(prompts, params)
    assert [o.token_ids for o in piped] == [o.token_ids for o in plain]


def test_an_invalid_grammar_fails_that_call_only(llm):
    """A regex xgrammar rejects is a ValueError naming it; the next call runs."""
    with pytest.raises(ValueError, match="structured_outputs: invalid regex grammar"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="((")))
    assert llm.generate(["x"], SamplingParams(max_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_the_engine_core_matches_grammars_without_torch():
    """The engine core runs grammar rows (FakeDevice) without importing torch: xgrammar is loaded torch-free."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from engine_harness import Req, run_workload\n"
        "from fake_grammars import FAKE_GRAMMAR_VOCAB, compiled\n"
        "from metrale.ipc.sampling import SamplingParams, StructuredOutputs\n"
        "so = StructuredOutputs(regex='[0-9]{2}ab')\n"
        "run = run_workload([Req([5, 6], SamplingParams(max_tokens=9, structured_outputs=so), grammar=compiled(so))],"
        " pipeline=True, grammar_vocab=FAKE_GRAMMAR_VOCAB)\n"
        "assert run.finish['0'] == 'stop', run.finish\n"
        "assert 'torch' not in sys.modules, 'the engine core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
