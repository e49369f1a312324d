"""Chat templates and the reasoning split, without a server."""

from __future__ import annotations

import json
import shutil

import pytest

from metrale.frontend.chat import (
    ChatTemplate,
    ChatTemplateError,
    ReasoningSplitter,
    ReasoningTags,
    TagKeepingDecoder,
    split_reasoning,
)
from metrale.frontend.tokenizer import Tokenizer

# A template in the style of the big models': tools as JSON, raise_exception on a bad role order,
# loop controls, a generation block, and the special tokens as variables.
RICH_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "{% if message['role'] == 'function' %}{% continue %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief. Ünïcode ✓"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "function", "content": "never shown"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture()
def rich_model_dir(model_dir, tmp_path):
    """The tiny model with RICH_TEMPLATE in chat_template.jinja (which wins over tokenizer_config.json's)."""
    out = tmp_path / "rich"
    shutil.copytree(model_dir, out)
    (out / "chat_template.jinja").write_text(RICH_TEMPLATE, encoding="utf-8")
    return out


def test_tiny_template_renders_chatml_with_bos(model_dir, tokenizer):
    chat = ChatTemplate.load(model_dir, tokenizer)
    text = chat.render([{"role": "user", "content": "hi"}])
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_rendering_equals_transformers_apply_chat_template(rich_model_dir):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(rich_model_dir))
    ours = ChatTemplate.load(rich_model_dir, Tokenizer.from_dir(rich_model_dir))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "ünï"}}}]
    for kwargs in ({}, {"tools": tools}, {"add_generation_prompt": False}, {"enable_thinking": True}):
        generation = kwargs.get("add_generation_prompt", True)
        extra = {k: v for k, v in kwargs.items() if k not in ("tools", "add_generation_prompt")}
        expected = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=generation,
                                          tools=kwargs.get("tools"), **extra)
        got = ours.render(CONVERSATION, add_generation_prompt=generation, tools=kwargs.get("tools"), extra=extra)
        assert got == expected, kwargs


def test_raise_exception_in_the_template_is_a_chat_template_error(rich_model_dir):
    chat = ChatTemplate.load(rich_model_dir, Tokenizer.from_dir(rich_model_dir))
    with pytest.raises(ChatTemplateError, match="system must come first"):
        chat.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_a_model_without_template_has_none(model_dir, tmp_path):
    out = tmp_path / "plain"
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTemplate.load(out, Tokenizer.from_dir(out)) is None


def test_text_parts_are_joined_and_other_parts_refused(model_dir, tokenizer):
    chat = ChatTemplate.load(model_dir, tokenizer)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert "one\ntwo" in chat.render([{"role": "user", "content": parts}])
    with pytest.raises(ChatTemplateError, match="only text parts"):
        chat.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        chat.render([])
    with pytest.raises(ChatTemplateError, match="string role"):
        chat.render([{"content": "no role"}])


def test_continue_final_message_ends_the_prompt_inside_it(model_dir, tokenizer):
    chat = ChatTemplate.load(model_dir, tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    text = chat.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHel")
    with pytest.raises(ChatTemplateError):
        chat.render(messages, add_generation_prompt=True, continue_final_message=True)


def test_reasoning_tags_of_the_tiny_vocabulary_are_special_tokens(tokenizer):
    tags = ReasoningTags.of(tokenizer, tokenizer.chat_template)
    assert tags is not None
    assert tags.special_ids == {tokenizer.token_id("<think>"), tokenizer.token_id("</think>")}
    assert tags.open_at_end_of("<|im_start|>assistant\n<think>\n")
    assert not tags.open_at_end_of("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tag_keeping_decoder_keeps_only_the_tags(tokenizer):
    tags = ReasoningTags.of(tokenizer, None)
    ids = tokenizer.encode("<think>why</think>because<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids) == "whybecause"
    assert TagKeepingDecoder(tokenizer, tags.special_ids).decode(ids) == "<think>why</think>because"


def test_reasoning_is_split_from_content():
    tags = ReasoningTags()
    assert split_reasoning("<think>I add.</think>The answer is 4.", tags) == ("I add.", "The answer is 4.")
    assert split_reasoning("I add.</think>4", tags, in_reasoning=True) == ("I add.", "4")
    assert split_reasoning("no tags at all", tags) == ("", "no tags at all")
    assert split_reasoning("a < b <thin", tags) == ("", "a < b <thin")  # a partial tag at the end is content


def test_streamed_split_is_the_same_for_every_chunking():
    tags = ReasoningTags()
    text = "<think>step <1> and </thin step 2</think> so: x <</think>/ 4 <thi"
    whole = split_reasoning(text, tags)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            splitter = ReasoningSplitter(tags)
            pieces = [splitter.push(text[:a]), splitter.push(text[a:b]), splitter.push(text[b:]), splitter.flush()]
            got = ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces))
            assert got == whole, (a, b)
    assert whole == ("step <1> and </thin step 2", " so: x </ 4 <thi")
