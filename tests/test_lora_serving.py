"""Multi-LoRA through the engine: LLM(enable_lora, lora_modules) and `metrale serve --enable-lora --lora-modules`.
Three PEFT adapters on a tiny llama (fp32): each adapter's greedy tokens equal transformers + peft; a batch mixing
the adapters and the base equals each run alone, pipelined and synchronous; the prefix cache never lends one
adapter's KV to another; a worker SIGKILLed under mixed-adapter streams loses nothing."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import peft
import pytest
import torch

from metrale import LLM, LoRARequest, SamplingParams
from metrale.frontend.client import AsyncClient

from serve_fixture import http_server, openai_client
from test_http_api import assert_error, http
from test_lora_layers import ADAPTERS, _hf_model, _make_adapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
NAMES = list(ADAPTERS)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-serving")
    return {name: str(_make_adapter(base, root / name, 200 + i, **cfg)) for i, (name, (_, cfg)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def prompts(base) -> list[list[int]]:
    rng = np.random.default_rng(8)
    return [rng.integers(3, 200, size=n).tolist() for n in (7, 19, 3, 30)]


def peft_greedy(base, adapter: str | None, prompt: list[int], steps: int = 8) -> list[int]:
    """transformers (+ peft, merged) greedy tokens."""
    model = _hf_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(base, adapters, prompts) -> dict[tuple[str | None, int], list[int]]:
    return {(name, i): peft_greedy(base, adapters.get(name), p) for name in (None, *NAMES) for i, p in enumerate(prompts)}


def modules(adapters) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


@pytest.mark.parametrize("pipeline", [True, False])
def test_mixed_adapters_in_one_batch_equal_transformers_and_peft(base, adapters, prompts, expected, pipeline):
    """Every prompt under the base and each adapter, all in one generate (one batch, chunked by 16 tokens)."""
    with LLM(str(base), dtype="float32", enable_lora=True, lora_modules=modules(adapters), max_loras=3,
             max_lora_rank=8, max_num_batched_tokens=16, pipeline=pipeline) as llm:
        cases = [(name, i) for i in range(len(prompts)) for name in (None, *NAMES)]
        outs = llm.generate([prompts[i] for _, i in cases], GREEDY,
                            lora_request=[LoRARequest(name) if name else None for name, _ in cases])
        for (name, i), out in zip(cases, outs):
            assert out.outputs[0].token_ids == expected[name, i], (name, i)


def test_the_prefix_cache_keeps_adapters_apart(base, adapters, prompts, expected):
    """The same prompt under the base, then an adapter, then the base again (each after the other, so each could
    find the one before in the prefix cache): each is its own model's."""
    with LLM(str(base), dtype="float32", enable_lora=True, lora_modules=modules(adapters), max_loras=3,
             max_lora_rank=8, enable_prefix_caching=True) as llm:
        p = prompts[3]
        for name in (None, NAMES[1], NAMES[1], None, NAMES[0]):
            out = llm.generate([p], GREEDY, lora_request=LoRARequest(name) if name else None)
            assert out[0].outputs[0].token_ids == expected[name, 3], name
        assert llm.engine.pool.stats.hit_tokens > 0  # the repeats did hit their own adapter's blocks


def test_a_lora_request_with_a_path_loads_at_run_time_and_mistakes_are_named(base, adapters, prompts, expected):
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        name = NAMES[2]
        out = llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest(name, 1, adapters[name]))
        assert out[0].outputs[0].token_ids == expected[name, 0]
        with pytest.raises(ValueError, match="not loaded and its lora_path"):
            llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("nope"))
        llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest(NAMES[0], 2, adapters[NAMES[0]]))
        with pytest.raises(ValueError, match="every LoRA slot is taken"):
            llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest(NAMES[1], 3, adapters[NAMES[1]]))
    with LLM(str(base), dtype="float32") as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest(name, 1, adapters[name]))


def test_start_up_mistakes_are_one_line_naming_the_module(base, adapters):
    from metrale.config import EngineArgs

    for kw, message in (
        (dict(lora_modules=[f"a={adapters[NAMES[0]]}"]), "needs enable_lora"),
        (dict(enable_lora=True, lora_modules=["nameonly"]), "expected NAME=PATH"),
        (dict(enable_lora=True, lora_modules=[f"a={adapters[NAMES[1]]}"], max_lora_rank=4), "rank 8 is above"),
        (dict(enable_lora=True, lora_modules=[f"a={adapters[NAMES[0]]}", f"b={adapters[NAMES[2]]}"]), "max_loras is 1"),
        (dict(enable_lora=True, lora_modules=["a=/no/such/folder"]), "lora_modules a:"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(base), **kw).validate()


@pytest.fixture(scope="module")
def server(base, adapters):
    args = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--dtype", "float32",
            "--allow-runtime-lora-updating"]
    for m in modules(adapters):
        args += ["--lora-modules", m]
    with http_server(base, *args) as s:
        yield s


def test_http_requests_name_an_adapter_as_their_model(server, base, prompts, expected):
    """/v1/models lists the adapters (parent: the model); a completion naming one runs with it, and one naming
    nothing served is a 404."""
    status, models = http("GET", server.http + "/v1/models")
    cards = {c["id"]: c for c in models["data"]}
    assert status == 200 and all(cards[name]["parent"] == base.name for name in NAMES)
    with openai_client(server) as client:
        for name in (NAMES[0], NAMES[2], base.name):
            done = client.completions.create(model=name, prompt=prompts[1], max_tokens=8, temperature=0)
            key = None if name == base.name else name
            assert done.choices[0].text == server_text(server, expected[key, 1]) and done.model == name
    status, body = http("POST", server.http + "/v1/completions", {"model": "other", "prompt": "hi", "max_tokens": 2})
    assert_error(status, body, 404, param="model")


def test_an_adapter_loaded_over_http_serves_its_next_request_and_unloads(server, adapters, prompts, expected):
    """POST /v1/load_lora_adapter (vLLM's routes): the adapter takes the free slot and answers the next request naming
    it; loading it twice, a folder that is no adapter, a slot too many and unloading a name not loaded are refused
    naming why; after POST /v1/unload_lora_adapter the name is a 404 again."""
    url, late = server.http, adapters[NAMES[2]]
    status, text = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": late})
    assert status == 200 and "added" in text, text
    with openai_client(server) as client:
        done = client.completions.create(model="late", prompt=prompts[1], max_tokens=8, temperature=0)
    assert done.choices[0].text == server_text(server, expected[NAMES[2], 1])
    status, models = http("GET", url + "/v1/models")
    (card,) = [c for c in models["data"] if c["id"] == "late"]
    assert card["root"] == late and card["parent"] is not None
    status, body = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": late})
    assert_error(status, body, 400, param="lora_name")
    status, body = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/no/such/adapter"})
    assert_error(status, body, 400, param="lora_path")
    status, body = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "fifth", "lora_path": late})
    assert_error(status, body, 400, param="lora_name")
    assert "every LoRA slot is taken" in body["error"]["message"]
    status, text = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert status == 200 and "removed" in text
    status, body = http("POST", url + "/v1/completions", {"model": "late", "prompt": "hi", "max_tokens": 2})
    assert_error(status, body, 404, param="model")
    status, body = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert_error(status, body, 404, param="lora_name")


def test_an_adapter_loaded_at_run_time_outlives_an_engine_core_sigkill(server, adapters, prompts, expected):
    """The engine core (and with it the worker) is SIGKILLed after a runtime load: the fresh one is told to load
    the adapter again before any request naming it is resubmitted, so the name still serves."""
    from test_faults_e2e import wait_recovered

    status, text = http("POST", server.http + "/v1/load_lora_adapter",
                        {"lora_name": "kept", "lora_path": adapters[NAMES[0]]})
    assert status == 200, text
    old = server.children()["engine_core"]
    os.kill(old, signal.SIGKILL)
    wait_recovered(server, "engine_core", old)
    with openai_client(server) as client:
        done = client.completions.create(model="kept", prompt=prompts[3], max_tokens=8, temperature=0)
    assert done.choices[0].text == server_text(server, expected[NAMES[0], 3])
    status, text = http("POST", server.http + "/v1/unload_lora_adapter", {"lora_name": "kept"})
    assert status == 200, text


def server_text(server, ids: list[int]) -> str:
    status, body = http("POST", server.http + "/detokenize", {"tokens": ids})
    assert status == 200
    return body["prompt"]


def test_worker_sigkill_under_mixed_adapter_streams_loses_nothing(server, prompts, expected):
    """16 greedy streams over the base and the three adapters; the worker is SIGKILLed once they are under way: the
    new worker loads the adapters into the same slots and every stream ends as it would have."""
    cases = [((None, *NAMES)[k % 4], k % len(prompts)) for k in range(16)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run():
        seen, started = [0] * len(cases), asyncio.Event()

        async def one(client, k):
            name, i = cases[k]
            ids = []
            async for d in client.generate(token_ids=prompts[i], params=params, lora=name):
                ids += d.token_ids
                seen[k] += len(d.token_ids)
                if sum(seen) >= 8:
                    started.set()
            return ids

        async with AsyncClient("127.0.0.1", server.port, timeout=120) as client:
            tasks = [asyncio.ensure_future(one(client, k)) for k in range(len(cases))]
            await asyncio.wait_for(started.wait(), 60)
            os.kill(server.children()["gpu_worker"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    for (name, i), ids in zip(cases, outs):
        assert ids == expected[name, i], (name, i)


def test_two_tensor_parallel_ranks_shard_the_adapters_as_the_base(base, adapters, prompts, expected):
    """Two worker ranks (gloo), each holding its shard of every adapter: the mixed batch is still each model's."""
    with LLM(str(base), dtype="float32", tensor_parallel_size=2, enable_lora=True, lora_modules=modules(adapters),
             max_loras=3, max_lora_rank=8) as llm:
        cases = [(name, i) for i in (0, 1) for name in (None, *NAMES)]
        outs = llm.generate([prompts[i] for _, i in cases], GREEDY,
                            lora_request=[LoRARequest(name) if name else None for name, _ in cases])
        for (name, i), out in zip(cases, outs):
            assert out.outputs[0].token_ids == expected[name, i], (name, i)


def test_an_adapter_loaded_at_run_time_is_loaded_again_by_a_new_worker(base, adapters, prompts, expected):
    """Through the ticket ring (two tensor-parallel ranks): a LoRARequest's adapter is loaded by a LoRA ticket and
    serves its request; after the worker group is replaced it still does (the new ranks load it again)."""
    name = NAMES[1]
    with LLM(str(base), dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=2,
             max_lora_rank=8) as llm:
        out = llm.generate([prompts[2]], GREEDY, lora_request=LoRARequest(name, 1, adapters[name]))
        assert out[0].outputs[0].token_ids == expected[name, 2]
        llm.device.respawn()
        llm.engine.recover()
        out = llm.generate([prompts[2], prompts[0]], GREEDY, lora_request=[LoRARequest(name), None])
        assert [o.outputs[0].token_ids for o in out] == [expected[name, 2], expected[None, 0]]


def test_engine_load_and_unload_name_what_they_refuse():
    """EngineCore.load_lora / unload_lora on FakeDevice: free slots are reused, a name in use cannot be unloaded,
    and a slot refilled with another adapter starts a fresh prefix-cache chain."""
    from metrale.engine_core.engine import EngineCore, EngineOptions
    from metrale.testing.fake_device import FakeDevice
    from metrale.ipc.errors import Refused

    device = FakeDevice(vocab_size=512, num_kv_blocks=64, block_size=4, max_loras=2)
    engine = EngineCore(device, EngineOptions())
    assert engine.load_lora("a", "/a") == 0 and engine.load_lora("b", "/b") == 1
    with pytest.raises(Refused, match="every LoRA slot is taken"):
        engine.load_lora("c", "/c")
    with pytest.raises(Refused, match="already loaded"):
        engine.load_lora("a", "/a2")
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4), lora="a")
    with pytest.raises(Refused, match="runs 1 requests"):
        engine.unload_lora("a")
    key_a = engine.requests["r"].req.lora_key
    while engine.has_unfinished():
        engine.step()
    engine.unload_lora("a")
    assert device.loras == {1: "/b"}
    assert engine.load_lora("c", "/c") == 0 and device.loras == {0: "/c", 1: "/b"}
    engine.add_request("s", [5, 6, 7], SamplingParams(max_tokens=4), lora="c")
    assert engine.requests["s"].req.lora_slot == 0 and engine.requests["s"].req.lora_key != key_a
    with pytest.raises(Refused, match="is not loaded"):
        engine.add_request("t", [5], SamplingParams(), lora="a")
    with pytest.raises(Refused, match="serves no LoRA"):
        EngineCore(FakeDevice(vocab_size=512, num_kv_blocks=64, block_size=4), EngineOptions()).load_lora("x", "/x")
