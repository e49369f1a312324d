"""POST /v1/embeddings through `metrale serve` (a tiny llama with sentence-transformers' mean pooling and Normalize):
the official openai client (base64 by default) and plain HTTP (floats), equal to transformers' pooled hidden states;
generation on the same server; bad requests answered with a 400 naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serve_fixture import http_server, openai_client
from test_embeddings_model import hf_embedding, sentence_transformers_folder
from test_http_api import assert_error, http

MODEL = ""


@pytest.fixture(scope="module")
def folder(tiny_model_dir, tmp_path_factory):
    return sentence_transformers_folder(tiny_model_dir("llama"), tmp_path_factory.mktemp("emb") / "st-mean", "mean", True)


@pytest.fixture(scope="module")
def server(folder):
    global MODEL
    MODEL = folder.name
    with http_server(folder, "--max-num-batched-tokens", "16") as s:
        yield s


@pytest.fixture(scope="module")
def hf(folder):
    import transformers

    return transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def test_openai_client_embeddings_equal_transformers(server, hf):
    """Token-id inputs (1 to 40 tokens, chunked by 16) through client.embeddings.create, batched in one request."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (40, 1, 9)]
    with openai_client(server) as client:
        reply = client.embeddings.create(input=prompts, model=MODEL)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == MODEL
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == 50
    for p, d in zip(prompts, reply.data):
        np.testing.assert_allclose(d.embedding, hf_embedding(hf, p, "mean", True), atol=2e-5)


def test_float_format_text_input_and_generation_beside_it(server, hf):
    """A text input, as floats over plain HTTP, is the embedding of its tokens (/tokenize's); a completion runs on
    the same server."""
    status, tokens = http("POST", server.http + "/tokenize", {"prompt": "hello embeddings"})
    assert status == 200
    status, body = http("POST", server.http + "/v1/embeddings",
                        {"input": "hello embeddings", "model": MODEL, "encoding_format": "float"})
    assert status == 200, body
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    np.testing.assert_allclose(body["data"][0]["embedding"], hf_embedding(hf, tokens["tokens"], "mean", True), atol=2e-5)
    assert body["usage"]["prompt_tokens"] == tokens["count"]
    status, done = http("POST", server.http + "/v1/completions",
                        {"prompt": "hello", "max_tokens": 4, "temperature": 0, "model": MODEL})
    assert status == 200 and done["usage"]["completion_tokens"] >= 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, hf):
    ids = list(range(10, 30))
    status, body = http("POST", server.http + "/v1/embeddings",
                        {"input": [ids], "truncate_prompt_tokens": 5, "encoding_format": "float"})
    assert status == 200, body
    np.testing.assert_allclose(body["data"][0]["embedding"], hf_embedding(hf, ids[-5:], "mean", True), atol=2e-5)
    assert body["usage"]["prompt_tokens"] == 5
    status, models = http("GET", server.http + "/v1/models")
    limit = models["data"][0]["max_model_len"]
    status, body = http("POST", server.http + "/v1/embeddings", {"input": [list(range(3, limit + 40))],
                                                                 "truncate_prompt_tokens": -1})
    assert status == 200 and body["usage"]["prompt_tokens"] == limit, body  # a whole context: no room for output


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[1, 2, 10**7]]}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),  # the model is not Matryoshka
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "messages": []}, None),  # an unknown field is named, never ignored
    ({"input": "x", "model": "other"}, "model"),
])
def test_bad_embedding_requests_are_refused_naming_the_field(server, body, param):
    status, reply = http("POST", server.http + "/v1/embeddings", body)
    assert_error(status, reply, 404 if param == "model" else 400, param=param)
    if param is None:
        assert "messages" in reply["error"]["message"]
