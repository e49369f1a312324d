"""The host sampler picks what the device sampler picks (a RepickOnly repair must equal the device's pick)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale.testing.host_sampler import SamplingRow, exp_weights, gumbel_noise, log32, sample_row
from metrale.engine_core.pipeline import RowMask
from metrale.engine_core.kv_blocks import KvBlockPool
from metrale.engine_core.sequence import Sequence
from metrale.gpu_worker import sampler as device_sampler
from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.sampler import Sampler, row_keys
from metrale.ipc.plan import MASK_BAN, MASK_FORCE, MASK_GRAMMAR, MASK_GREEDY, StepPlan
from metrale.ipc.sampling import SamplingParams
from test_sampler import device_path  # noqa: F401 (a fixture: the torch path, then each native class)

VOCAB = 512


def _random_plan(rng: np.random.Generator, rows: int, vocab: int) -> StepPlan:
    """A decode plan of `rows` rows whose sampling parameters cover every stage and their mixes."""
    pick = lambda values, dtype: np.array(rng.choice(values, size=rows), dtype=dtype)  # noqa: E731
    mask = pick([0, 0, 0, MASK_BAN, MASK_GREEDY, MASK_FORCE, MASK_BAN | MASK_GREEDY], np.uint8)
    ban = np.full((rows, 6), -1, dtype=np.int32)
    for r in range(rows):
        n = int(rng.integers(0, 7))
        ban[r, :n] = rng.integers(0, vocab, size=n)
    penalised = rng.random(rows) < 0.3
    hists = [rng.integers(0, vocab, size=int(rng.integers(1, 40))).astype(np.int32) if p else np.zeros(0, np.int32) for p in penalised]
    return StepPlan(
        input_ids=np.zeros(rows, np.int32),
        positions=np.zeros(rows, np.int32),
        slot_mapping=np.zeros(rows, np.int64),
        query_start=np.arange(rows + 1, dtype=np.int32),
        seq_lens=rng.integers(1, 5000, size=rows).astype(np.int32),
        block_tables=np.zeros((rows, 1), np.int32),
        sample=np.ones(rows, bool),
        feed_from_row=np.full(rows, -1, np.int32),
        temperature=pick([0.0, 0.3, 0.7, 1.0, 1.0, 1.6], np.float32),
        top_k=pick([0, 0, 1, 5, 40, vocab + 3], np.int32),
        top_p=pick([1.0, 1.0, 0.95, 0.7, 0.3], np.float32),
        min_p=pick([0.0, 0.0, 0.05, 0.3], np.float32),
        repetition_penalty=np.where(penalised, rng.choice([1.0, 1.3, 0.8], size=rows), 1.0).astype(np.float32),
        presence_penalty=np.where(penalised, rng.choice([0.0, 0.6, -0.4], size=rows), 0.0).astype(np.float32),
        frequency_penalty=np.where(penalised, rng.choice([0.0, 0.3], size=rows), 0.0).astype(np.float32),
        seeds=rng.integers(0, 2**63 - 1, size=rows, dtype=np.int64),
        mask_kind=mask,
        force_token=rng.integers(0, vocab, size=rows).astype(np.int32),
        ban_ids=ban,
        num_logprobs=np.full(rows, -1, np.int32),
        hist_tokens=np.concatenate(hists).astype(np.int32),
        hist_start=np.concatenate([[0], np.cumsum([len(h) for h in hists])]).astype(np.int32),
        hist_prompt_len=np.array([int(rng.integers(0, len(h) + 1)) for h in hists], np.int32),
    )


def _random_logits(rng: np.random.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Logits of every spread; a third rounded through bfloat16, so ties (at the top-k cutoff too) abound."""
    scale = rng.choice([0.5, 2.0, 8.0], size=(rows, 1))
    logits = torch.from_numpy((rng.standard_normal((rows, vocab)) * scale).astype(np.float32))
    tied = torch.from_numpy(rng.random(rows) < 0.33)
    logits[tied] = logits[tied].bfloat16().float()
    return logits


def test_host_picks_equal_the_device_sampler_on_random_logits_and_parameters(device_path):
    """Greedy, temperature, top-k, top-p, min-p, penalties, bans, forced and greedy masks and their mixes, with
    seeded noise: 40 batches of 48 rows, every host pick equal to the device's."""
    rng = np.random.default_rng(2024)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    rows = 48
    for _ in range(40):
        plan = _random_plan(rng, rows, VOCAB)
        logits = _random_logits(rng, rows, VOCAB)
        device = sampler(logits, plan, torch.arange(rows)).tokens.numpy()
        host = [sample_row(logits[r].numpy(), SamplingRow.of_plan(plan, r)) for r in range(rows)]
        assert host == device.tolist()


def test_host_picks_equal_the_device_sampler_with_grammar_rows(device_path):
    """Grammar rows (a packed bitmask each, in row order) among rows of every other kind: the host applies the
    bitmask where the device does (after penalties, before bans and the pick), so every pick is equal and every
    grammar row's unforced pick is a token its bitmask allows."""
    rng = np.random.default_rng(2025)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    rows, words = 32, VOCAB // 32
    for _ in range(20):
        plan = _random_plan(rng, rows, VOCAB)
        grammar = rng.random(rows) < 0.5
        plan.mask_kind = np.where(grammar, (plan.mask_kind & np.uint8(0xFF ^ MASK_BAN)) | MASK_GRAMMAR, plan.mask_kind).astype(np.uint8)
        allowed = rng.random((int(grammar.sum()), VOCAB)) < 0.2
        allowed[:, rng.integers(0, VOCAB)] = True
        plan.grammar_bitmask = np.packbits(allowed, axis=1, bitorder="little").view(np.int32).reshape(-1, words)
        logits = _random_logits(rng, rows, VOCAB)
        device = sampler(logits, plan, torch.arange(rows)).tokens.numpy()
        host = [sample_row(logits[r].numpy(), SamplingRow.of_plan(plan, r)) for r in range(rows)]
        assert host == device.tolist()
        for g, r in enumerate(np.flatnonzero(grammar)):
            if not plan.mask_kind[r] & MASK_FORCE:
                assert allowed[g, host[r]]


def test_host_noise_is_the_device_noise(device_path):
    """The same splitmix64 bits and Gumbel transform, bit for bit: log32 is + - * / in one order everywhere (torch's
    own log rounds differently by vector unit, which broke this on AVX2 machines)."""
    vocab = 4099  # odd: vector tails too
    sampler = Sampler(vocab, torch.device("cpu"))
    seeds = np.array([0, 1, 2**62 + 7, 12345, 99, 2**63 - 1], dtype=np.int64)
    positions = np.array([1, 77, 4095, 3, 100000, 2], dtype=np.int32)
    device = sampler.noise(seeds, positions).numpy()
    host = np.stack([gumbel_noise(int(s), int(p), vocab) for s, p in zip(seeds, positions)])
    assert np.array_equal(host.view(np.int32), device.view(np.int32))


def _every_uniform() -> np.ndarray:
    """All 2^23 uniform draws (k + 0.5) / 2^23 the noise can start from."""
    return (np.arange(1 << 23, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0**-23)


def test_log32_is_within_an_ulp_of_the_true_log():
    """Over every uniform draw and every inner value -log32(u) the noise takes its second log of."""
    u = _every_uniform()
    for x in (u, -log32(u)):
        true = np.log(x.astype(np.float64))
        ulp = np.spacing(np.abs(true).astype(np.float32)).astype(np.float64)
        assert (np.abs(log32(x) - true) / ulp).max() <= 1.0


def test_exp_weights_are_e_to_the_t_in_units_of_2_to_the_minus_30():
    t = np.concatenate([-np.abs(np.random.default_rng(3).standard_normal(1 << 20)).astype(np.float32) * 8,
                        np.array([0.0, -np.inf, -64.0, -100.0], np.float32)])
    w = exp_weights(t)
    assert w[-4] == 1 << 30 and w[-3] == 0 and w[-1] == 0
    assert np.abs(w - np.exp(t.astype(np.float64)) * 2.0**30).max() <= 64  # about an ulp of e^t


def test_the_shared_rules_are_the_same_bits_on_the_device(device_path):
    """log32 and exp_weights in torch (every device's path) and in the native kernels (each class, vectors and
    tails) equal the host's numpy, bit for bit."""
    u = _every_uniform()
    inner = -log32(u)
    t = np.concatenate([-inner, -inner * 4, np.array([0.0, -np.inf, -64.0, -1e30], np.float32)])
    for x in (u, inner):
        if device_path is None:
            got = torch.from_numpy(x.copy())
            device_sampler._log32_(got, tuple(torch.empty_like(got) for _ in range(5)))
        else:
            got = torch.empty(len(x))
            cpu_kernels.ops().shared_rule(torch.from_numpy(x), got)
        assert np.array_equal(got.numpy().view(np.int32), log32(x).view(np.int32))
    if device_path is None:
        weights = device_sampler._exp_weights(torch.from_numpy(t))
    else:
        weights = torch.empty(len(t), dtype=torch.int32)
        cpu_kernels.ops().shared_rule(torch.from_numpy(t), weights)
    assert np.array_equal(weights.numpy(), exp_weights(t))


def test_native_noise_keys_are_the_samplers_row_keys(kernel_isa):
    keys = row_keys(np.array([5]), np.array([9]))
    out = torch.empty(1, 300)
    cpu_kernels.ops().gumbel_noise(torch.from_numpy(keys), out)
    assert np.array_equal(out[0].numpy(), gumbel_noise(5, 9, 300))


def _decoding_sequences(rng: np.random.Generator, params: list[SamplingParams], pool) -> list[Sequence]:
    """One decoding sequence per params (random tokens, all but the last computed, one block), as a repair sees
    them."""
    seqs = []
    for i, p in enumerate(params):
        tokens = rng.integers(0, VOCAB, size=6 + i).tolist()
        seq = Sequence.of(str(i), p, p.seed or 0, tokens, 4, i)
        seq.num_computed = len(tokens) - 1
        assert pool.allocate(seq, len(tokens))
        seqs.append(seq)
    return seqs


SAMPLING_FIELDS = ("seq_lens", "sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seeds", "mask_kind", "force_token", "ban_ids", "num_logprobs", "hist_tokens",
                   "hist_start", "hist_prompt_len", "grammar_bitmask", "bias_start", "bias_ids", "bias_values",
                   "pinned_start", "pinned_ids")


def _resample_equals_the_step(builder, seqs, masks, rng, repeats: int = 1) -> StepPlan:
    """The step builder's RESAMPLE plan for seqs (a RepickOnly repair's: their rows as they are now, the step's
    seq_lens) has the sampling arrays of the plan it builds for their next step, and the device sampler picks alike
    from both; returns the step's plan."""
    plan = builder.build(seqs, [1] * len(seqs), masks)
    again = builder.resample(seqs, masks, plan.seq_lens.tolist(), plan.sample.tolist())
    for name in SAMPLING_FIELDS:
        assert np.array_equal(getattr(again, name), getattr(plan, name)), name
    sampler = Sampler(VOCAB, torch.device("cpu"))
    for _ in range(repeats):
        logits = _random_logits(rng, len(seqs), VOCAB)
        rows = torch.from_numpy(np.flatnonzero(plan.sample))
        assert sampler(logits[rows], again, rows).tokens.tolist() == sampler(logits[rows], plan, rows).tokens.tolist()
    return plan


def test_a_resample_plan_lays_out_each_sequence_as_the_step_builder_does():
    """A repair's rows (sequences under their masks now) are sampled from the arrays a step of them would carry."""
    from metrale.engine_core.step_builder import StepBuilder

    rng = np.random.default_rng(5)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=7, seed=3),
        SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, seed=4),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, seed=5),
        SamplingParams(temperature=0.8, seed=6, min_tokens=5),
    ]
    pool = KvBlockPool(16, 16)
    seqs = _decoding_sequences(rng, params, pool)
    masks = [RowMask(), RowMask(), RowMask(MASK_GREEDY), RowMask(), RowMask(MASK_BAN, -1, (2, 9, 11))]
    builder = StepBuilder(pool, max_tokens=8, max_rows=8, max_model_len=64)
    _resample_equals_the_step(builder, seqs, masks, rng, repeats=5)


def _with_random_bias(rng: np.random.Generator, plan: StepPlan, vocab: int) -> StepPlan:
    """The plan with a random logit_bias on about half its rows (ids distinct within a row, values in [-100, 100])."""
    per_row = [rng.choice(vocab, size=int(rng.integers(1, 30)), replace=False) if rng.random() < 0.5 else [] for _ in range(plan.num_rows)]
    plan.bias_start = np.concatenate([[0], np.cumsum([len(ids) for ids in per_row])]).astype(np.int32)
    plan.bias_ids = np.concatenate([np.asarray(ids, np.int32) for ids in per_row]).astype(np.int32)
    values = [-100.0, 100.0, 0.5, -3.25, 7.0, float(rng.uniform(-100, 100))]
    plan.bias_values = rng.choice(values, size=len(plan.bias_ids)).astype(np.float32)
    return plan


def test_host_picks_equal_the_device_sampler_with_logit_bias(device_path):
    """Biased rows among rows of every other kind: the host adds the bias where the device does (first, one float32
    addition a token), so every pick is equal."""
    rng = np.random.default_rng(2026)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    rows = 32
    for _ in range(20):
        plan = _with_random_bias(rng, _random_plan(rng, rows, VOCAB), VOCAB)
        logits = _random_logits(rng, rows, VOCAB)
        device = sampler(logits, plan, torch.arange(rows)).tokens.numpy()
        host = [sample_row(logits[r].numpy(), SamplingRow.of_plan(plan, r)) for r in range(rows)]
        assert host == device.tolist()


def test_a_resample_plan_carries_a_sequences_logit_bias_as_the_step_builder_does():
    """A repair's rows with logit_bias: the RESAMPLE plan's bias_start / bias_ids / bias_values hold each biased
    row's entries and nothing for the others, as the step's."""
    from metrale.engine_core.step_builder import StepBuilder

    rng = np.random.default_rng(6)
    params = [
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.9, seed=3),
        SamplingParams(temperature=1.1, top_p=0.8, seed=4, logit_bias={7: -100.0, 8: 2.5, 300: 9.0}),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=5, logit_bias={1: 4.0}),
    ]
    pool = KvBlockPool(16, 16)
    seqs = _decoding_sequences(rng, params, pool)
    builder = StepBuilder(pool, max_tokens=8, max_rows=8, max_model_len=64)
    masks = [RowMask()] * len(seqs)
    plan = _resample_equals_the_step(builder, seqs, masks, rng, repeats=10)
    assert plan.bias_start.tolist() == [0, 1, 1, 4, 5]
    assert plan.bias_ids.tolist() == [5, 7, 8, 300, 1] and plan.bias_values.tolist() == [100.0, -100.0, 2.5, 9.0, 4.0]
    unbiased = builder.build(seqs[1:2], [1], masks[:1])
    assert unbiased.bias_start.tolist() == [0, 0] and len(unbiased.bias_ids) == 0
