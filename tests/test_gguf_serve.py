"""`metrale serve --model SmolLM2-135M-Instruct.Q4_1.gguf`: the real model, served as a user would, answers
through the official `openai` client (its chat template, tokenizer and weights all read from the GGUF)."""

from __future__ import annotations

import openai
import pytest
from gguf_models import smollm2_path
from serve_fixture import free_port, running_server

pytestmark = pytest.mark.slow

# A short system prompt keeps this 135M model's first token decisive (without it the top two first tokens of
# "What is the capital of France?" are within a few percent of each other).
QUESTION = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def api():
    path = smollm2_path()
    port = free_port()
    with running_server(path, "--http-port", str(port)) as server:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client


def test_the_chat_route_answers_a_factual_question(api):
    reply = api.chat.completions.create(model=smollm2_path().name, messages=QUESTION, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # it ends its answer with <|im_end|>, the file's eos
    assert reply.usage.prompt_tokens > 20  # the template's system turn and ChatML markers are in the prompt


def test_a_streamed_answer_is_the_same_text(api):
    whole = api.chat.completions.create(model=smollm2_path().name, messages=QUESTION, temperature=0, max_tokens=24)
    stream = api.chat.completions.create(model=smollm2_path().name, messages=QUESTION, temperature=0, max_tokens=24, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_the_model_is_listed_under_the_files_name(api):
    assert [m.id for m in api.models.list().data] == [smollm2_path().name]
