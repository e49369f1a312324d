"""metrale.LLM as vLLM users call it: LLM(model=...), SamplingParams(n=...), RequestOutput.outputs[i].text /
.token_ids / .finish_reason, .prompt / .prompt_token_ids, LLM.chat(messages); today's fields kept beside them."""

from __future__ import annotations

import json
import shutil

import pytest

from metrale import LLM, SamplingParams
from metrale.frontend.chat import ChatTemplate
from metrale.frontend.client import RequestError

from test_frontend_server import running_stack

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(model=str(tiny_model_dir("llama")), show_progress=False, seed=0) as engine:
        yield engine


def test_outputs_read_as_vllms_and_todays_fields_agree(llm):
    out, = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    first, = out.outputs
    assert first.index == 0 and len(first.token_ids) == 6 and first.finish_reason == "length"
    assert first.text == llm.tokenizer.decode(first.token_ids)
    assert (out.token_ids, out.text, out.finish_reason) == (first.token_ids, first.text, first.finish_reason)
    assert out.finished
    by_ids, = llm.generate({"prompt_token_ids": out.prompt_token_ids}, sampling_params=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True))
    assert by_ids.prompt is None and by_ids.token_ids == out.token_ids
    by_dict, = llm.generate([{"prompt": PROMPT}], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert by_dict.prompt == PROMPT and by_dict.token_ids == out.token_ids


def test_n_seeded_samples_differ_and_each_is_seed_plus_j(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123, n=3, ignore_eos=True)
    out, = llm.generate(PROMPT, params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    ids = [o.token_ids for o in out.outputs]
    assert len({tuple(i) for i in ids}) == 3, "seeded samples differ"
    for j in range(3):
        single, = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=123 + j, ignore_eos=True))
        assert single.token_ids == ids[j], f"sample {j} runs with seed + {j}"


def test_n_greedy_samples_are_copies_and_unseeded_ones_differ(llm):
    greedy, = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, n=3, ignore_eos=True))
    one, = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in greedy.outputs] == [one.token_ids] * 3
    free, = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, n=2, ignore_eos=True))
    assert free.outputs[0].token_ids != free.outputs[1].token_ids


def test_n_with_several_prompts_keeps_prompt_order(llm):
    prompts = [PROMPT, "Once upon a time"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, n=2, ignore_eos=True))
    assert [o.prompt for o in outs] == prompts and all(len(o.outputs) == 2 for o in outs)
    for o in outs:
        alone, = llm.generate(o.prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert o.outputs[1].token_ids == alone.token_ids


def test_chat_renders_the_models_template_for_one_conversation_or_many(llm):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out, = llm.chat(CHAT, params)
    text = ChatTemplate.load(llm.model_dir, llm.tokenizer).render(CHAT, add_generation_prompt=True)
    assert out.prompt == text
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    direct, = llm.generate([out.prompt_token_ids], params)
    assert out.token_ids == direct.token_ids
    two = llm.chat([CHAT, CHAT[1:]], params)
    assert [o.token_ids for o in two][0] == out.token_ids and two[1].prompt != out.prompt
    bare, = llm.chat(CHAT, params, add_generation_prompt=False)
    assert bare.prompt == ChatTemplate.load(llm.model_dir, llm.tokenizer).render(CHAT, add_generation_prompt=False)
    assert bare.prompt != out.prompt


def test_chat_with_a_template_of_ones_own(llm):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    out, = llm.chat(CHAT, SamplingParams(max_tokens=2, temperature=0.0), chat_template=template)
    assert out.prompt == "<system>Be brief.<user>Hello<bot>"


def test_default_params_come_from_the_generation_config(tiny_model_dir, tmp_path):
    folder = tmp_path / "gen"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7}))
    with LLM(model=str(folder), show_progress=False) as engine:
        assert (engine.get_default_sampling_params().temperature, engine.get_default_sampling_params().top_k) == (0.0, 7)
        a, b = engine.generate([PROMPT, PROMPT])  # greedy by the model's default: equal
        assert a.token_ids == b.token_ids
    with LLM(model=str(folder), show_progress=False, generation_config="vllm") as engine:
        assert engine.get_default_sampling_params() == SamplingParams()


def test_bad_n_is_refused_offline_and_over_zmq(llm, tiny_model_dir):
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        llm.generate(PROMPT, SamplingParams(n=0))
    with running_stack(tiny_model_dir("llama")) as s:
        with pytest.raises(RequestError, match="sampling.n must be 1 over ZMQ"):
            s.client.complete("Once", params=SamplingParams(max_tokens=2, n=2))
