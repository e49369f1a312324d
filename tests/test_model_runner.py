"""The model runner and LocalDevice: feeds, sampling rows, logprobs, logits, KV sizing, loading, threading."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale.gpu_worker.layers.kv_cache import PagedKVCache
from metrale.gpu_worker.local_device import LocalDevice
from metrale.gpu_worker.model_runner import ModelRunner
from metrale.ipc.plan import MASK_BAN, DeviceError, FedAheadPolicy

PROMPT_LENS = (5, 17, 9, 30)
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture
def runner(model_path):
    return ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)


def _prompts(vocab, lens=PROMPT_LENS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(16, vocab, size=n).tolist() for n in lens]


def _prefill_plan(plans, prompts, **row_kw):
    return plans.make_plan([plans.Row(p, 0, plans.blocks_for(i, MAX_LEN), **row_kw) for i, p in enumerate(prompts)])


def _decode_plan(plans, prompts, step, tokens=None, **row_kw):
    """Decode step `step` (0-based) for every prompt: fed from the previous step, or host-fed with tokens."""
    rows = []
    for i, p in enumerate(prompts):
        token, feed = ([0], i) if tokens is None else ([int(tokens[i])], -1)
        rows.append(plans.Row(token, len(p) + step, plans.blocks_for(i, MAX_LEN), feed_from_row=feed, **row_kw))
    return plans.make_plan(rows)


def _generate(runner, plans, prompts, steps, *, fed):
    out = [runner.execute(_prefill_plan(plans, prompts)).tokens]
    for k in range(steps):
        out.append(runner.execute(_decode_plan(plans, prompts, k, None if fed else out[-1])).tokens)
    return np.stack(out, axis=1)


def test_info_comes_from_config_and_generation_config(runner):
    info = runner.info
    assert info.vocab_size == 2048
    assert info.max_model_len == 512
    assert info.eos_token_ids == (2, 4)  # </s> and <|im_end|>, from generation_config.json
    assert (info.num_kv_blocks, info.block_size) == (256, 16)
    assert info.dtype == "float32"
    assert info.fed_ahead_policy is FedAheadPolicy.REWIND


def test_kv_cache_memory_budget_sets_the_block_count(model_path):
    cfg = ModelRunner(model_path, device="cpu", num_kv_blocks=1, show_progress=False).model.kv_shape
    per_block = PagedKVCache.bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    runner = ModelRunner(model_path, device="cpu", kv_cache_memory=100 * per_block + 5, show_progress=False)
    assert runner.info.num_kv_blocks == 100
    assert runner.kv_cache.k[0].shape == (100, 16, cfg.num_kv_heads, cfg.head_dim)


def test_unsupported_architecture_raises_value_error_naming_it(model_path, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(model_path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelRunner(bad, device="cpu", num_kv_blocks=8, show_progress=False)


def test_sharded_checkpoint_with_index_loads_like_a_single_file(model_path, tmp_path, plans):
    sharded = tmp_path / "sharded"
    shutil.copytree(model_path, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file))
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    b = ModelRunner(sharded, device="cpu", num_kv_blocks=256, show_progress=False)
    plan = _prefill_plan(plans, _prompts(2048))
    assert np.array_equal(a.forward_only(plan).numpy(), b.forward_only(plan).numpy())


def test_loads_a_folder_saved_by_transformers_5(tiny_model_dir, tmp_path, plans):
    """transformers 5 writes `rope_parameters` and `dtype` instead of `rope_scaling` and `torch_dtype`."""
    transformers = pytest.importorskip("transformers")
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    ours = tiny_model_dir("llama", rope_scaling=rope, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_pretrained(ours).save_pretrained(tmp_path / "saved")
    a = ModelRunner(ours, device="cpu", num_kv_blocks=256, show_progress=False)
    b = ModelRunner(tmp_path / "saved", device="cpu", num_kv_blocks=256, show_progress=False)
    assert [r.cfg for r in b.model.rotaries] == [r.cfg for r in a.model.rotaries]
    plan = _prefill_plan(plans, _prompts(2048))
    assert np.array_equal(a.forward_only(plan).numpy(), b.forward_only(plan).numpy())


def test_dtype_auto_follows_the_checkpoint(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir("qwen3", dtype="bfloat16"), device="cpu", num_kv_blocks=8, show_progress=False)
    assert runner.info.dtype == "bfloat16"
    assert runner.kv_cache.k[0].dtype == torch.bfloat16


def test_device_feed_gives_the_same_tokens_as_host_feed(model_path, plans):
    # max_num_seqs=2 < 4 rows: the device-side token buffer grows without losing the feed.
    fed_runner = ModelRunner(model_path, device="cpu", num_kv_blocks=256, max_num_seqs=2, show_progress=False)
    fed = _generate(fed_runner, plans, _prompts(2048), 12, fed=True)
    host_runner = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    host = _generate(host_runner, plans, _prompts(2048), 12, fed=False)
    assert np.array_equal(fed, host)


def _penalised(plan, hists, prompt_lens):
    """plan with penalties over each row's history hists[r]: negative frequency and presence penalties, which
    favour repeating an output token (the fed one among them), so a token they missed changes the picks."""
    plan.hist_tokens = np.concatenate([np.asarray(h, dtype=np.int32) for h in hists])
    plan.hist_start = np.concatenate([[0], np.cumsum([len(h) for h in hists])]).astype(np.int32)
    plan.hist_prompt_len = np.asarray(prompt_lens, dtype=np.int32)
    plan.repetition_penalty[:] = 1.0
    plan.frequency_penalty[:] = -30.0
    plan.presence_penalty[:] = -5.0
    return plan


def _generate_penalised(runner, plans, prompts, steps, *, fed, penalties=True):
    """Greedy steps under penalties; a fed row's history ends with the -1 slot the runner fills with its fed token."""
    lens = [len(p) for p in prompts]
    first = _prefill_plan(plans, prompts)
    outputs = [[int(t)] for t in runner.execute(_penalised(first, prompts, lens) if penalties else first).tokens]
    for k in range(steps):
        plan = _decode_plan(plans, prompts, k, None if fed else [o[-1] for o in outputs])
        if penalties:
            plan = _penalised(plan, [p + o[:-1] + [-1 if fed else o[-1]] for p, o in zip(prompts, outputs)], lens)
        for o, t in zip(outputs, runner.execute(plan).tokens):
            o.append(int(t))
    return outputs


def test_a_penalised_row_fed_ahead_picks_what_a_host_fed_one_picks(model_path, plans):
    """A penalised row fed from the previous step (launched ahead, so the host has not committed its input) has
    the runner write that token into its history's last slot: its penalties, and so its picks, are a host-fed
    step's."""
    prompts = _prompts(2048, lens=(5, 9, 3, 7), seed=3)
    fed = _generate_penalised(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False),
                              plans, prompts, 10, fed=True)
    host = _generate_penalised(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False),
                               plans, prompts, 10, fed=False)
    free = _generate_penalised(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False),
                               plans, prompts, 10, fed=False, penalties=False)
    assert fed == host
    assert free != host  # the penalties change the picks, so a fed token they missed would show


def test_rows_that_do_not_sample_get_minus_one(runner, plans):
    plan = _prefill_plan(plans, _prompts(2048))
    plan.sample[[0, 2]] = False
    result = runner.execute(plan)
    assert result.tokens.dtype == np.int32
    assert result.tokens[0] == -1 and result.tokens[2] == -1
    assert result.tokens[1] >= 0 and result.tokens[3] >= 0
    assert result.logprobs is None and result.top_ids is None
    logits = runner.read_logits()
    assert logits.shape == (4, 2048) and not logits[0].any()


def test_logprobs_are_returned_when_a_row_asks(runner, plans):
    plan = _prefill_plan(plans, _prompts(2048))
    plan.num_logprobs[:] = [-1, 3, 0, -1]
    result = runner.execute(plan)
    logits = torch.from_numpy(runner.read_logits())
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs.shape == (4,)
    assert result.top_ids.shape == result.top_logprobs.shape == (4, 3)
    assert result.logprobs[1] == pytest.approx(float(raw[1, result.tokens[1]]), abs=1e-5)
    top = raw[1].topk(3)
    assert result.top_ids[1].tolist() == top.indices.tolist()
    assert np.allclose(result.top_logprobs[1], top.values.numpy(), atol=1e-5)


def test_forward_only_gives_execute_logits_and_leaves_feeds_alone(runner, plans):
    prompts = _prompts(2048)
    first = runner.execute(_prefill_plan(plans, prompts))
    ref = runner.read_logits()
    floor = runner.forward_only(_prefill_plan(plans, prompts))
    assert np.array_equal(floor.numpy(), ref)
    # The fed step still reads the tokens execute sampled, not anything forward_only did.
    fed = runner.execute(_decode_plan(plans, prompts, 0))
    fed_logits = runner.read_logits()
    host = runner.execute(_decode_plan(plans, prompts, 0, first.tokens))
    assert np.array_equal(fed.tokens, host.tokens)
    assert np.array_equal(fed_logits, runner.read_logits())


def test_feeding_from_a_row_that_did_not_sample_is_an_error(runner, plans):
    prompts = _prompts(2048)
    plan = _prefill_plan(plans, prompts)
    plan.sample[1] = False
    runner.execute(plan)
    with pytest.raises(ValueError, match="fed from"):
        runner.execute(_decode_plan(plans, prompts, 0))


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(model_path, plans):
    prompts = _prompts(2048)
    alone = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    batch = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    row = plans.Row(prompts[2], 0, plans.blocks_for(2, MAX_LEN), temperature=1.0, seed=7)
    one = alone.execute(plans.make_plan([row]))
    many = batch.execute(_prefill_plan(plans, prompts, temperature=1.0, seed=7))
    assert one.tokens[0] == many.tokens[2]


def test_local_device_launching_ahead_matches_synchronous_steps(model_path, plans):
    prompts = _prompts(2048)
    def new_runner():
        return ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)

    sync_device = LocalDevice(new_runner(), threaded=False)
    with LocalDevice(new_runner()) as device:
        sync = [sync_device.await_result(sync_device.launch(_prefill_plan(plans, prompts))).tokens]
        for k in range(8):
            sync.append(sync_device.await_result(sync_device.launch(_decode_plan(plans, prompts, k))).tokens)
        # Pipelined: launch step k+1 (fed on the device) before settling step k.
        tickets = [device.launch(_prefill_plan(plans, prompts))]
        for k in range(8):
            tickets.append(device.launch(_decode_plan(plans, prompts, k)))
        piped = [device.await_result(t).tokens for t in tickets]
        assert device.model() is device.runner.info
    sync_device.close()
    assert np.array_equal(np.stack(sync), np.stack(piped))


def test_a_resample_picks_again_from_the_kept_logits_as_a_step_would(model_path, plans):
    """A RepickOnly repair on the device: a settled step's picks made again from the logits the runner kept, under
    the same sampling arrays, are its picks and logprobs bit for bit; with a row's pick banned, they are the picks of
    the step run again with that ban. A resample for other rows, or of logits no longer kept, is a DeviceError."""
    prompts = _prompts(2048)
    plan = lambda: _prefill_plan(plans, prompts, temperature=0.9, seed=5, num_logprobs=2)  # noqa: E731
    with LocalDevice(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)) as device:
        ticket = device.launch(plan())
        step = device.await_result(ticket)
        same = device.resample(ticket, plan())
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            assert getattr(same, name).tobytes() == getattr(step, name).tobytes(), name
        banned = plan()
        banned.mask_kind[1], banned.ban_ids[1, 0] = MASK_BAN, step.tokens[1]
        again = device.resample(ticket, banned)
        rerun = device.await_result(device.launch(banned))  # the same forward (its KV rewritten alike), banned
        assert again.tokens[1] != step.tokens[1]
        assert again.tokens.tolist() == rerun.tokens.tolist() and again.logprobs.tobytes() == rerun.logprobs.tobytes()
        fewer = plan()
        fewer.sample[2] = False
        with pytest.raises(DeviceError, match="other rows"):
            device.resample(ticket, fewer)
        for _ in range(2):
            device.await_result(device.launch(plan()))
        with pytest.raises(DeviceError, match="no longer kept"):
            device.resample(ticket, plan())


class _HeldRunner:
    """A ModelRunner whose launched steps look in flight (not ready) while `hold` is set, until a later step is
    launched: a device running behind the host, on a CPU. Counts launches made while an earlier step was in flight."""

    def __init__(self, runner):
        self.runner, self.hold, self.launches, self.ahead, self._open = runner, False, 0, 0, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, plan):
        self.ahead += self._open > 0
        self.launches += 1
        pending, held, launched = self.runner.launch(plan), self, self.launches
        self._open += 1

        class Held:
            def ready(self):
                return not held.hold or held.launches > launched

            def result(self):
                held._open -= 1
                return pending.result()

        return Held()


def test_local_device_launches_the_next_step_while_the_last_is_in_flight(model_path, plans):
    prompts = _prompts(2048)
    want = _generate(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False), plans, prompts, 2, fed=True)
    held = _HeldRunner(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False))
    with LocalDevice(held) as device:
        got = [device.await_result(device.launch(_prefill_plan(plans, prompts))).tokens]
        held.hold = True
        first, second = device.launch(_decode_plan(plans, prompts, 0)), device.launch(_decode_plan(plans, prompts, 1))
        got.append(device.await_result(first).tokens)  # lands only once the second is launched
        held.hold = False
        got.append(device.await_result(second).tokens)
    assert held.ahead >= 1
    np.testing.assert_array_equal(np.stack(got, axis=1), want)


def test_local_device_reports_a_failed_step_as_device_error_and_keeps_serving(model_path, plans):
    prompts = _prompts(2048)
    with LocalDevice(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)) as device:
        bad = _prefill_plan(plans, prompts)
        bad.slot_mapping[:] = 10**9  # outside the cache
        t_bad = device.launch(bad)
        t_fed = device.launch(_decode_plan(plans, prompts, 0))  # fed from the failed step
        t_good = device.launch(_prefill_plan(plans, prompts))
        with pytest.raises(DeviceError):
            device.await_result(t_bad)
        with pytest.raises(DeviceError):
            device.await_result(t_fed)
        assert (device.await_result(t_good).tokens >= 0).all()
        with pytest.raises(DeviceError, match="already awaited"):
            device.await_result(t_good)


def test_local_device_close_stops_its_thread(model_path):
    device = LocalDevice(ModelRunner(model_path, device="cpu", num_kv_blocks=8, show_progress=False))
    thread = device._thread
    device.close()
    assert not thread.is_alive()
    with pytest.raises(DeviceError):
        device.launch(None)


def test_launching_steps_before_reading_their_results_gives_the_same_tokens(model_path, plans):
    # The worker launches step t+1 (fed on the device from t) before t's tokens reach the host; t's copy-back
    # must hold t's tokens, not t+1's (which overwrite the kept tokens in place).
    prompts = _prompts(2048)
    want = _generate(ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False), plans, prompts, 4, fed=True)
    runner = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    pending = [runner.launch(_prefill_plan(plans, prompts))]
    for k in range(4):
        pending.append(runner.launch(_decode_plan(plans, prompts, k)))
    assert all(p.ready() for p in pending)  # a CPU's event has fired when launch returns
    np.testing.assert_array_equal(np.stack([p.result().tokens for p in pending], axis=1), want)


def test_a_verify_step_keeps_each_rows_picks_up_to_its_first_rejected_draft(model_path, plans):
    """A verify step is the one executor's step at k positions a row: drafts that are the greedy continuation are all
    kept, with the pick after them; a wrong first draft keeps only the pick that corrects it; a row without drafts
    picks once. The device's accepted counts cut each row's picks."""
    prompts = _prompts(2048, lens=(5, 17, 9))
    plain = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    greedy = [plain.execute(_prefill_plan(plans, prompts)).tokens]
    for k in range(3):
        greedy.append(plain.execute(_decode_plan(plans, prompts, k, greedy[-1])).tokens)
    g = np.stack(greedy, axis=1)  # row i: its greedy picks t0, t1, t2, t3
    runner = ModelRunner(model_path, device="cpu", num_kv_blocks=256, show_progress=False)
    runner.execute(_prefill_plan(plans, prompts))
    wrong = (int(g[1, 1]) + 1) % 2048
    inputs = [[g[0, 0], g[0, 1], g[0, 2]], [g[1, 0], wrong, g[1, 2]], [g[2, 0]]]
    rows = [plans.Row([int(t) for t in ids], len(p), plans.blocks_for(i, MAX_LEN))
            for i, (p, ids) in enumerate(zip(prompts, inputs))]
    plan = plans.make_plan(rows)
    plan.num_drafts = np.array([2, 2, 0], dtype=np.int32)
    results = runner.execute_verify(plan)
    picks = np.stack([r.tokens for r in results])  # [pick index, row]
    assert picks[:, 0].tolist() == g[0, 1:4].tolist()
    assert picks[:, 1].tolist() == [g[1, 1], -1, -1]
    assert picks[:, 2].tolist() == [g[2, 1], -1, -1]
