"""The device sampler: greedy, seeded batch-invariant draws, filters, penalties, masks and logprobs (CPU)."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch

from conftest import use_kernel_class
from metrale.gpu_worker.layers import cpu_kernels
from metrale.gpu_worker.sampler import Sampler, row_keys
from metrale.ipc.plan import MASK_BAN, MASK_FORCE, MASK_GRAMMAR, MASK_GREEDY, MASK_NONE, StepPlan

ROW_DEFAULTS = dict(
    temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
    frequency_penalty=0.0, seed=0, position=10, mask_kind=MASK_NONE, force_token=0, ban=(),
    num_logprobs=-1, prompt=(), output=(), allowed=None, bias={}, pinned=(),
)


def _device_paths() -> list[str]:
    """The device sampler's torch path, then each native kernel class this CPU runs (none when torch is forced)."""
    from metrale import cpu_isa

    if os.environ.get("METRALE_CPU_KERNELS", "").strip().lower() == "torch":
        return ["torch"]
    return ["torch", *cpu_isa.supported()]


@pytest.fixture(params=_device_paths())
def device_path(request, monkeypatch) -> str | None:
    """The device sampler on one path: None for torch's (every device's but a CPU with the kernels loaded), else
    the native class whose kernels the sampler then calls."""
    cls = None if request.param == "torch" else request.param
    if cls is None:
        monkeypatch.setitem(cpu_kernels._active, "ops", None)
        return None
    return use_kernel_class(cls, monkeypatch, unit="sampling", op="sample_rows")


def make_plan(rows: list[dict]) -> StepPlan:
    """A decode plan with one sampling row per dict; unnamed fields take ROW_DEFAULTS."""
    rows = [{**ROW_DEFAULTS, **r} for r in rows]
    n = len(rows)
    col = lambda key, dtype: np.array([r[key] for r in rows], dtype=dtype)  # noqa: E731
    ban_width = max([1] + [len(r["ban"]) for r in rows])
    ban_ids = np.full((n, ban_width), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        ban_ids[i, : len(r["ban"])] = r["ban"]
    histories = [list(r["prompt"]) + list(r["output"]) for r in rows]
    grammar = [r["allowed"] for r in rows if r["mask_kind"] & MASK_GRAMMAR]
    return StepPlan(
        grammar_bitmask=_bitmask(grammar),
        input_ids=np.zeros(n, np.int32),
        positions=col("position", np.int32) - 1,
        slot_mapping=np.zeros(n, np.int64),
        query_start=np.arange(n + 1, dtype=np.int32),
        seq_lens=col("position", np.int32),
        block_tables=np.zeros((n, 1), np.int32),
        sample=np.ones(n, bool),
        feed_from_row=np.full(n, -1, np.int32),
        temperature=col("temperature", np.float32),
        top_k=col("top_k", np.int32),
        top_p=col("top_p", np.float32),
        min_p=col("min_p", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32),
        presence_penalty=col("presence_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
        seeds=col("seed", np.int64),
        mask_kind=col("mask_kind", np.uint8),
        force_token=col("force_token", np.int32),
        ban_ids=ban_ids,
        num_logprobs=col("num_logprobs", np.int32),
        hist_tokens=np.array([t for h in histories for t in h], dtype=np.int32),
        hist_start=np.concatenate([[0], np.cumsum([len(h) for h in histories])]).astype(np.int32),
        hist_prompt_len=np.array([len(r["prompt"]) for r in rows], dtype=np.int32),
        bias_start=np.concatenate([[0], np.cumsum([len(r["bias"]) for r in rows])]).astype(np.int32),
        bias_ids=np.array([t for r in rows for t in r["bias"]], dtype=np.int32),
        bias_values=np.array([v for r in rows for v in r["bias"].values()], dtype=np.float32),
        pinned_start=np.concatenate([[0], np.cumsum([len(r["pinned"]) for r in rows])]).astype(np.int32),
        pinned_ids=np.array([t for r in rows for t in r["pinned"]], dtype=np.int32),
    )


def _bitmask(allowed: list) -> np.ndarray:
    """Packed int32 words (xgrammar's layout) of each row's allowed token ids; [0, 0] for none."""
    if not allowed:
        return np.zeros((0, 0), np.int32)
    words = max(max(ids) for ids in allowed) // 32 + 1
    out = np.zeros((len(allowed), words), np.uint32)
    for g, ids in enumerate(allowed):
        for t in ids:
            out[g, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


def sample(logits: torch.Tensor, rows: list[dict], sampler: Sampler | None = None):
    """Run a sampler over logits [S, V] with one row dict per logits row."""
    sampler = sampler or Sampler(logits.shape[1], torch.device("cpu"))
    return sampler(logits, make_plan(rows), torch.arange(len(rows)))


def draws(logits_row: torch.Tensor, n: int, **params) -> np.ndarray:
    """n seeded draws (seeds 0..n-1) from one row of logits, in a single batch."""
    logits = logits_row[None, :].expand(n, -1).contiguous()
    return sample(logits, [dict(params, seed=s) for s in range(n)]).tokens.numpy()


def frequencies(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Empirical distribution of sampled tokens."""
    return np.bincount(tokens, minlength=vocab) / len(tokens)


def rand_logits(s: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """Reproducible random logits."""
    return torch.randn(s, v, generator=torch.Generator().manual_seed(seed)) * scale


# Probabilities 0.5, 0.3, 0.1, 0.05, 0.05 for the filter tests.
FIVE = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]))


# --- noise ---------------------------------------------------------------------------------------


def _splitmix_mix(z: int) -> int:
    """Reference splitmix64 finaliser in plain Python integers."""
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_noise_equals_reference_splitmix64_hash():
    seeds, positions, vocab = np.array([0, 7, 2**62 + 12345]), np.array([0, 99, 4096]), 300
    noise = Sampler(vocab, torch.device("cpu")).noise(seeds, positions).double().numpy()
    m, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15
    for r, (seed, pos) in enumerate(zip(seeds.tolist(), positions.tolist())):
        key = _splitmix_mix(_splitmix_mix((seed + golden) & m) + (pos + 1) * golden & m)
        assert key == int(row_keys(seeds[r : r + 1], positions[r : r + 1]).view(np.uint64)[0])
        for v in range(vocab):
            u = ((_splitmix_mix((key + (v + 1) * golden) & m) >> 41) + 0.5) / 2**23
            assert noise[r, v] == pytest.approx(-math.log(-math.log(u)), abs=1e-4)


def test_noise_is_finite_and_gumbel_distributed():
    noise = Sampler(4000, torch.device("cpu")).noise(np.arange(8), np.arange(8)).numpy()
    assert np.isfinite(noise).all()
    assert noise.mean() == pytest.approx(0.5772, abs=0.01)  # Euler–Mascheroni
    assert noise.var() == pytest.approx(math.pi**2 / 6, abs=0.03)


def test_noise_of_a_row_is_bit_identical_in_any_batch():
    # An odd vocab and two threads put a row's elements at different vector-lane and chunk offsets.
    vocab, threads = 1001, torch.get_num_threads()
    sampler = Sampler(vocab, torch.device("cpu"))
    alone = sampler.noise(np.array([77]), np.array([5])).clone()
    torch.set_num_threads(2)
    try:
        for n in (3, 37, 130):
            seeds, positions = np.arange(n) * 13, np.arange(n) + 2
            seeds[n // 2], positions[n // 2] = 77, 5
            assert torch.equal(sampler.noise(seeds, positions)[n // 2], alone[0])
    finally:
        torch.set_num_threads(threads)


# --- greedy --------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = rand_logits(16, 500)
    out = sample(logits, [dict(temperature=0.0)] * 16)
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None


def test_fast_path_equals_general_path_for_greedy():
    logits = rand_logits(32, 1000, seed=3)
    fast = sample(logits, [dict()] * 32).tokens
    # An empty ban list and a logprobs request force the general path without changing the pick.
    general = sample(logits, [dict(mask_kind=MASK_BAN, num_logprobs=0)] * 32).tokens
    assert torch.equal(fast, general)
    assert torch.equal(fast, logits.argmax(-1))


def test_logits_are_left_untouched(device_path):
    logits = rand_logits(4, 100, seed=12)
    before = logits.clone()
    sample(logits, [dict(temperature=0.7, top_k=5, top_p=0.5, min_p=0.1, mask_kind=MASK_BAN, ban=[1],
                         repetition_penalty=2.0, prompt=[2], seed=s) for s in range(4)])
    assert torch.equal(logits, before)


def test_rows_map_logits_to_their_plan_rows(device_path):
    # Plan rows 0 and 2 do not sample; logits hold rows 1 and 3 only, so each must read its own params.
    plan = make_plan([
        dict(mask_kind=MASK_FORCE, force_token=1),
        dict(repetition_penalty=3.0, prompt=[0, 9], output=[3]),
        dict(mask_kind=MASK_FORCE, force_token=2),
        dict(mask_kind=MASK_FORCE | MASK_BAN, force_token=8, ban=[3], num_logprobs=2),
    ])
    logits = torch.cat([_two_way(2.0, 1.5), _two_way(2.0, 1.5)])
    out = Sampler(10, torch.device("cpu"))(logits, plan, torch.tensor([1, 3]))
    assert out.tokens.tolist() == [4, 8]
    assert out.top_ids[:, 0].tolist() == [3, 3]  # raw distribution: the penalty does not show


def test_tiny_temperature_is_greedy():
    logits = rand_logits(8, 200, seed=4)
    out = sample(logits, [dict(temperature=1e-7, seed=s) for s in range(8)])
    assert torch.equal(out.tokens, logits.argmax(-1))


# --- seeded, batch-invariant sampling -------------------------------------------------------------


def _mixed_rows(seed_base: int) -> list[dict]:
    """Sixteen rows of deliberately different parameters."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.3, top_k=5),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.9, repetition_penalty=1.5, prompt=[1, 2, 3], output=[4, 4]),
        dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, output=[5, 6, 6]),
        dict(temperature=1.0, mask_kind=MASK_BAN, ban=[0, 1, 2]),
        dict(temperature=1.0, mask_kind=MASK_FORCE, force_token=9),
        dict(temperature=2.0, mask_kind=MASK_GREEDY),
        dict(temperature=1.0, num_logprobs=3),
        dict(temperature=0.5, top_k=20, top_p=0.9, min_p=0.02),
    ]
    return [dict(kinds[i % len(kinds)], seed=seed_base + 31 * i, position=5 + i) for i in range(16)]


def test_same_seed_and_position_give_the_same_token_alone_and_in_a_mixed_batch(device_path):
    logits = rand_logits(16, 401, seed=5, scale=1.0)  # odd vocab: rows straddle vector lanes
    for trial in range(5):
        rows = _mixed_rows(1000 * trial)
        batch = sample(logits, rows).tokens
        for i in range(16):
            alone = sample(logits[i : i + 1], [rows[i]]).tokens
            assert int(alone[0]) == int(batch[i]), (trial, i)
        # The same rows in another order, so each sits among other neighbours.
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(trial))
        shuffled = sample(logits[perm], [rows[int(p)] for p in perm]).tokens
        assert torch.equal(shuffled, batch[perm])


def test_sampled_token_depends_on_seed_and_position_only():
    logits = torch.zeros(1, 1000)  # uniform: the noise alone decides
    first = sample(logits, [dict(temperature=1.0, seed=42, position=7)]).tokens
    again = sample(logits, [dict(temperature=1.0, seed=42, position=7)]).tokens
    assert torch.equal(first, again)


def test_different_seeds_give_different_tokens():
    tokens = draws(torch.zeros(1000), 400, temperature=1.0)
    assert len(set(tokens.tolist())) > 300  # 400 uniform draws from 1000: ~330 distinct expected


def test_different_positions_give_different_tokens():
    logits = torch.zeros(400, 1000)
    tokens = sample(logits, [dict(temperature=1.0, seed=7, position=p) for p in range(400)]).tokens
    assert len(set(tokens.tolist())) > 300


def test_temperature_one_matches_softmax():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 20000
    observed = np.bincount(draws(logits, n, temperature=1.0), minlength=8)
    expected = torch.softmax(logits, -1).numpy() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    assert 0.5 * np.abs(observed / n - expected / n).sum() < 0.015


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    got = frequencies(draws(logits, 8000, temperature=temperature), 4)
    want = torch.softmax(logits / temperature, -1).numpy()
    assert 0.5 * np.abs(got - want).sum() < 0.02
    top_at_one = float(torch.softmax(logits, -1)[0])
    assert (got[0] > top_at_one) == (temperature < 1.0)  # sharper below 1, flatter above


# --- filters --------------------------------------------------------------------------------------


def test_top_k_never_samples_outside_the_top_k():
    logits = rand_logits(1, 300, seed=6, scale=1.0)[0]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    tokens = draws(logits, 3000, temperature=1.5, top_k=5)
    assert set(tokens.tolist()) == top5
    want = torch.softmax(logits[sorted(top5)] / 1.5, -1).numpy()
    got = frequencies(tokens, 300)[sorted(top5)]
    assert 0.5 * np.abs(got - want).sum() < 0.03


@pytest.mark.parametrize("top_k", [0, -1, 300])
def test_top_k_off_samples_everything(top_k):
    tokens = draws(torch.zeros(20), 2000, temperature=1.0, top_k=top_k)
    assert set(tokens.tolist()) == set(range(20))


def test_top_p_never_samples_outside_the_nucleus():
    # Cumulative 0.5, 0.8, ...: the smallest set reaching 0.75 is {0, 1}.
    tokens = draws(FIVE, 4000, temperature=1.0, top_p=0.75)
    assert set(tokens.tolist()) == {0, 1}
    assert frequencies(tokens, 5)[0] == pytest.approx(0.5 / 0.8, abs=0.03)


def test_top_p_keeps_at_least_the_top_token():
    tokens = draws(FIVE, 500, temperature=1.0, top_p=0.01)
    assert set(tokens.tolist()) == {0}


def test_top_p_applies_to_what_top_k_kept(device_path):
    # Top-2 renormalises to 0.625, 0.375; a 0.6 nucleus of that is token 0 alone.
    tokens = draws(FIVE, 1000, temperature=1.0, top_k=2, top_p=0.6)
    assert set(tokens.tolist()) == {0}


def test_top_k_keeps_every_token_tied_with_the_kth(device_path):
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    tokens = draws(logits, 2000, temperature=1.0, top_k=2)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_top_p_keeps_or_drops_a_tie_group_whole(device_path):
    # Masses 0.5, 0.3, 0.1, then a tied 0.05 pair: a 0.95 nucleus needs the pair, so both stay.
    tokens = draws(FIVE, 4000, temperature=1.0, top_p=0.95)
    assert set(tokens.tolist()) == {0, 1, 2, 3, 4}


def test_top_k_top_p_candidates_agree_with_the_full_sort(device_path):
    # Coarse (bf16-like) logits tie often. Alone, a top-k + top-p row takes the CPU candidate path (k=20
    # and k=7 here; at k=50 a tie runs past the candidates and it falls back to a sort); next to a
    # top-p-only row the batch takes the full sort. Both must pick the same tokens.
    v = 2000
    logits = (rand_logits(1, v, seed=11, scale=2.0)[0] * 32).round() / 32
    for k, p in [(20, 0.9), (50, 0.5), (7, 0.99), (300, 0.8)]:
        rows = [dict(temperature=1.0, top_k=k, top_p=p, seed=s, position=3) for s in range(64)]
        batch = torch.stack([logits] * 64)
        alone = sample(batch, rows).tokens
        mixed = sample(torch.cat([batch, logits[None]]), rows + [dict(temperature=1.0, top_p=0.5)]).tokens
        assert torch.equal(alone, mixed[:64]), (k, p)
        kth = torch.topk(logits, k).values[-1]
        assert (logits[alone] >= kth).all()


def test_min_p_drops_tokens_below_the_scaled_top_probability(device_path):
    tokens = draws(FIVE, 4000, temperature=1.0, min_p=0.25)  # threshold 0.125: keeps 0.5 and 0.3
    assert set(tokens.tolist()) == {0, 1}
    assert frequencies(tokens, 5)[0] == pytest.approx(0.5 / 0.8, abs=0.03)


# --- penalties ------------------------------------------------------------------------------------


def _two_way(a: float, b: float) -> torch.Tensor:
    """Logits where token 3 scores a and token 4 scores b, the rest far below."""
    logits = torch.full((1, 10), -10.0)
    logits[0, 3], logits[0, 4] = a, b
    return logits


def test_repetition_penalty_divides_positive_logits_of_prompt_tokens(device_path):
    logits = _two_way(2.0, 1.5)
    assert int(sample(logits, [dict(repetition_penalty=1.5, prompt=[3])]).tokens[0]) == 4  # 1.33 < 1.5
    assert int(sample(logits, [dict(repetition_penalty=1.2, prompt=[3])]).tokens[0]) == 3  # 1.67 > 1.5
    assert int(sample(logits, [dict(repetition_penalty=1.5, prompt=[4])]).tokens[0]) == 3


def test_repetition_penalty_multiplies_negative_logits_of_output_tokens():
    logits = _two_way(-1.0, -1.1)
    assert int(sample(logits, [dict(repetition_penalty=1.2, output=[3])]).tokens[0]) == 4  # -1.2 < -1.1


def test_repetition_penalty_below_one_rewards_repeats():
    logits = _two_way(1.5, 2.0)
    assert int(sample(logits, [dict(repetition_penalty=0.5, prompt=[3])]).tokens[0]) == 3  # 3.0 > 2.0


def test_presence_penalty_counts_output_tokens_once_and_ignores_the_prompt(device_path):
    logits = _two_way(2.0, 1.5)
    assert int(sample(logits, [dict(presence_penalty=0.6, output=[3])]).tokens[0]) == 4
    assert int(sample(logits, [dict(presence_penalty=0.4, output=[3, 3, 3])]).tokens[0]) == 3
    assert int(sample(logits, [dict(presence_penalty=2.0, prompt=[3])]).tokens[0]) == 3


def test_frequency_penalty_scales_with_the_output_count(device_path):
    logits = _two_way(2.0, 1.5)
    assert int(sample(logits, [dict(frequency_penalty=0.2, output=[3, 3])]).tokens[0]) == 3  # 1.6
    assert int(sample(logits, [dict(frequency_penalty=0.2, output=[3, 3, 3])]).tokens[0]) == 4  # 1.4
    assert int(sample(logits, [dict(frequency_penalty=2.0, prompt=[3, 3])]).tokens[0]) == 3


def test_penalties_leave_other_rows_alone():
    logits = torch.cat([_two_way(2.0, 1.5)] * 2)
    out = sample(logits, [dict(repetition_penalty=2.0, output=[3]), dict()])
    assert out.tokens.tolist() == [4, 3]


def test_penalties_apply_before_sampling():
    logits = _two_way(5.0, 4.0)[0]
    tokens = draws(logits, 500, temperature=0.3, presence_penalty=2.0, frequency_penalty=2.0, output=[3])
    assert (tokens == 4).mean() > 0.95  # token 3 falls to 1.0 against 4.0


# --- masks ----------------------------------------------------------------------------------------


def test_ban_mask_removes_ids_for_greedy_and_sampled_rows(device_path):
    logits = _two_way(3.0, 2.0)
    assert int(sample(logits, [dict(mask_kind=MASK_BAN, ban=[3])]).tokens[0]) == 4
    tokens = draws(logits[0], 500, temperature=5.0, mask_kind=MASK_BAN, ban=[3, 4])
    assert not np.isin(tokens, [3, 4]).any()


def test_ban_ids_are_ignored_without_the_ban_bit():
    assert int(sample(_two_way(3.0, 2.0), [dict(ban=[3])]).tokens[0]) == 3


def test_force_mask_picks_the_forced_token_whatever_the_logits():
    logits = _two_way(3.0, 2.0)
    out = sample(logits, [dict(mask_kind=MASK_FORCE, force_token=7, num_logprobs=0)])
    assert int(out.tokens[0]) == 7
    assert float(out.logprobs[0]) == pytest.approx(float(torch.log_softmax(logits, -1)[0, 7]), abs=1e-5)
    tokens = draws(logits[0], 100, temperature=1.0, mask_kind=MASK_FORCE | MASK_BAN, force_token=5, ban=[5])
    assert (tokens == 5).all()


def test_grammar_mask_limits_greedy_and_sampled_picks_to_its_tokens(device_path):
    """A MASK_GRAMMAR row picks only among its bitmask's tokens (greedy: the best of them); its neighbours are free."""
    logits = rand_logits(1, 100, seed=3)[0]
    allowed = [7, 31, 32, 64, 99]
    best = max(allowed, key=lambda t: float(logits[t]))
    rows = [dict(mask_kind=MASK_GRAMMAR, allowed=allowed), dict(), dict(mask_kind=MASK_GRAMMAR, allowed=[5])]
    out = sample(logits[None].expand(3, -1).contiguous(), rows)
    assert out.tokens.tolist() == [best, int(logits.argmax()), 5]
    tokens = draws(logits, 400, temperature=2.0, top_k=50, mask_kind=MASK_GRAMMAR, allowed=allowed)
    assert set(tokens.tolist()) <= set(allowed) and len(set(tokens.tolist())) > 2


def test_grammar_rows_leave_the_greedy_fast_path():
    """A greedy plan with a grammar row is not plain greedy (the argmax alone would ignore the bitmask)."""
    plan = make_plan([dict(), dict(mask_kind=MASK_GRAMMAR, allowed=[1])])
    assert not Sampler.plain_greedy(plan)
    assert Sampler.plain_greedy(make_plan([dict(), dict()]))


def test_greedy_mask_takes_the_argmax_whatever_the_temperature(device_path):
    logits = torch.zeros(10)
    logits[6] = 0.1
    tokens = draws(logits, 200, temperature=1.0, mask_kind=MASK_GREEDY)
    assert (tokens == 6).all()
    banned = draws(logits, 50, temperature=1.0, mask_kind=MASK_GREEDY | MASK_BAN, ban=[6])
    assert (banned == 0).all()  # the argmax of what the ban left (all zeros: the first)


def test_logprob_token_ids_report_those_ids_raw_logprobs_beside_top_n_rows(device_path):
    """A pinning row lists its ids (in their order) with their raw log-probabilities, its pick limited by its bitmask
    (allowed_token_ids) yet its logprobs those of the unmasked logits; a top-N row beside it lists its own top N."""
    logits = rand_logits(3, 96, seed=9)  # the bitmask's 3 words cover 96 ids
    raw = torch.log_softmax(logits, -1)
    rows = [dict(num_logprobs=3, pinned=(90, 2, 77), mask_kind=MASK_GRAMMAR, allowed=[77]),
            dict(num_logprobs=2, temperature=0.8, seed=4),
            dict(num_logprobs=1, pinned=(9,), temperature=1.1, seed=2)]
    out = sample(logits, rows)
    assert out.tokens[0] == 77
    assert out.logprobs[0] == pytest.approx(float(raw[0, 77]), abs=1e-6)
    assert out.top_ids[0].tolist() == [90, 2, 77]
    assert out.top_logprobs[0].tolist() == pytest.approx(raw[0, [90, 2, 77]].tolist(), abs=1e-6)
    assert out.top_ids[1, :2].tolist() == raw[1].topk(2).indices.tolist()
    assert out.top_ids[2, :1].tolist() == [9]
    assert out.top_logprobs[2, 0] == pytest.approx(float(raw[2, 9]), abs=1e-6)
    plain = sample(logits, [dict(r, pinned=()) for r in rows])
    assert out.tokens.tolist() == plain.tokens.tolist()  # pinning changes what is reported, never the picks


# --- logit_bias -----------------------------------------------------------------------------------


def test_logit_bias_moves_greedy_and_sampled_picks(device_path):
    """+100 makes a token the pick, greedy or sampled; -100 all but bans one; a small bias tips a close call."""
    logits = _two_way(3.0, 2.0)
    assert sample(logits, [dict(bias={9: 100.0})]).tokens.tolist() == [9]
    assert sample(logits, [dict(bias={3: -100.0})]).tokens.tolist() == [4]
    assert sample(logits, [dict(bias={4: 1.5})]).tokens.tolist() == [4]
    assert (draws(logits[0], 200, temperature=1.0, top_p=0.9, bias={7: 100.0}) == 7).all()
    assert not np.isin(draws(logits[0], 300, temperature=2.0, bias={3: -100.0, 4: -100.0}), [3, 4]).any()


def test_logit_bias_leaves_unbiased_rows_of_the_batch_alone(device_path):
    """A biased row beside unbiased ones: theirs are the picks they make alone (greedy and seeded)."""
    logits = rand_logits(4, 300, seed=17)
    rows = [dict(), dict(temperature=0.9, seed=5), dict(bias={1: 100.0}), dict(temperature=0.9, seed=6, bias={2: 50.0})]
    together = sample(logits, rows).tokens.tolist()
    alone = [sample(logits[i : i + 1], [rows[i]]).tokens.tolist()[0] for i in (0, 1)]
    assert together[:2] == alone and together[2:] == [1, 2]


def test_logit_bias_applies_before_penalties_and_leaves_logprobs_raw(device_path):
    """The bias is added first (a repetition penalty then divides the biased logit), and logprobs are the raw
    distribution's, as vLLM's default."""
    logits = _two_way(3.0, 2.0)  # token 3 at 3.0, token 4 at 2.0
    # 2.0 + 4.0 = 6.0, halved by the penalty to 3.0: a tie with token 3 goes to the first index.
    out = sample(logits, [dict(bias={4: 4.0}, repetition_penalty=2.0, output=[4], num_logprobs=2)])
    assert out.tokens.tolist() == [3]
    out = sample(logits, [dict(bias={4: 4.5}, num_logprobs=2)])
    raw = torch.log_softmax(logits, -1)
    assert out.tokens.tolist() == [4]
    assert float(out.logprobs[0]) == pytest.approx(float(raw[0, 4]), abs=1e-6)
    assert out.top_ids[0].tolist() == [3, 4]


def test_biased_rows_leave_the_greedy_fast_path():
    plan = make_plan([dict(), dict(bias={1: 2.0})])
    assert not Sampler.plain_greedy(plan)
    logits = rand_logits(2, 50, seed=4)
    biased = logits[1].clone()
    biased[1] += 2.0
    assert sample(logits, [dict(), dict(bias={1: 2.0})]).tokens.tolist() == [int(logits[0].argmax()), int(biased.argmax())]


def test_logit_bias_on_bfloat16_logits_picks_as_on_their_float32_values(device_path):
    logits = rand_logits(6, 400, seed=23).bfloat16()
    rows = [dict(temperature=t, seed=s, bias={s: 3.0, 100 + s: -2.0}) for s, t in enumerate((0.0, 0.7, 1.3) * 2)]
    assert sample(logits, rows).tokens.tolist() == sample(logits.float(), rows).tokens.tolist()


# --- against a reference -------------------------------------------------------------------------


def _vllm_reference_row(logits: torch.Tensor, r: dict, noise: torch.Tensor) -> int:
    """One row picked the way vLLM's sampler code reads (logit_bias, penalties, temperature, top-k/top-p, min-p)."""
    x = logits.clone()
    vocab = x.shape[0]
    for token, value in r["bias"].items():
        x[token] += value
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[list(r["prompt"]) + list(r["output"])] = True
    counts = torch.bincount(torch.tensor(list(r["output"]), dtype=torch.long), minlength=vocab).float()
    rep = torch.where(seen, torch.tensor(r["repetition_penalty"]), torch.tensor(1.0))
    x = torch.where(x > 0, x / rep, x * rep)
    x -= r["frequency_penalty"] * counts
    x -= r["presence_penalty"] * (counts > 0).float()
    if r["mask_kind"] & MASK_BAN:
        x[list(r["ban"])] = -math.inf
    if r["mask_kind"] & MASK_FORCE:
        return r["force_token"]
    if r["temperature"] < 1e-5 or r["mask_kind"] & MASK_GREEDY:
        return int(x.argmax())
    x = x / r["temperature"]
    ascending, order = x.sort()
    if 0 < r["top_k"] < vocab:
        ascending[ascending < ascending[vocab - r["top_k"]]] = -math.inf
    if r["top_p"] < 1.0:
        outside = ascending.softmax(-1).cumsum(-1) <= 1 - r["top_p"]
        outside[-1] = False
        ascending[outside] = -math.inf
    x = torch.empty_like(x).scatter_(0, order, ascending)
    if r["min_p"] > 0:
        probs = x.softmax(-1)
        x[probs < r["min_p"] * probs.max()] = -math.inf
    return int((x + noise).argmax())


def _random_row(rng: np.random.Generator, vocab: int) -> dict:
    """A row with a random mix of every parameter."""
    pick = lambda p, value, default: value if rng.random() < p else default  # noqa: E731
    return dict(
        temperature=float(pick(0.8, rng.uniform(0.3, 2.0), 0.0)),
        top_k=int(pick(0.4, rng.integers(1, 60), 0)),
        top_p=float(pick(0.4, rng.uniform(0.2, 0.99), 1.0)),
        min_p=float(pick(0.3, rng.uniform(0.01, 0.3), 0.0)),
        repetition_penalty=float(pick(0.3, rng.uniform(0.5, 2.0), 1.0)),
        presence_penalty=float(pick(0.3, rng.uniform(-2, 2), 0.0)),
        frequency_penalty=float(pick(0.3, rng.uniform(-2, 2), 0.0)),
        prompt=rng.integers(0, vocab, int(rng.integers(0, 30))).tolist(),
        output=rng.integers(0, vocab, int(rng.integers(0, 30))).tolist(),
        mask_kind=int(rng.choice([MASK_NONE, MASK_NONE, MASK_BAN, MASK_FORCE, MASK_GREEDY])),
        ban=rng.integers(0, vocab, 3).tolist(),
        force_token=int(rng.integers(0, vocab)),
        seed=int(rng.integers(0, 2**62)),
        position=int(rng.integers(1, 5000)),
    )


def test_picks_equal_a_row_by_row_reference_of_vllm_semantics(device_path):
    vocab, rng = 500, np.random.default_rng(13)
    sampler = Sampler(vocab, torch.device("cpu"))
    for trial in range(8):
        rows = [_random_row(rng, vocab) for _ in range(16)]
        logits = rand_logits(16, vocab, seed=100 + trial, scale=2.0)
        got = sample(logits, rows, sampler).tokens.tolist()
        plan = make_plan(rows)
        noise = sampler.noise(plan.seeds, plan.seq_lens)
        want = [_vllm_reference_row(logits[i], {**ROW_DEFAULTS, **r}, noise[i]) for i, r in enumerate(rows)]
        assert got == want, trial


def test_picks_with_logit_bias_equal_the_reference_of_vllm_semantics(device_path):
    """Random rows, most with a random logit_bias, against the reference that adds the bias first."""
    vocab, rng = 500, np.random.default_rng(31)
    sampler = Sampler(vocab, torch.device("cpu"))
    for trial in range(4):
        rows = [_random_row(rng, vocab) for _ in range(16)]
        for r in rows[::3] + rows[1::3]:
            ids = rng.choice(vocab, size=int(rng.integers(1, 40)), replace=False)
            r["bias"] = {int(t): float(v) for t, v in zip(ids, rng.uniform(-100, 100, len(ids)).astype(np.float32))}
        logits = rand_logits(16, vocab, seed=300 + trial, scale=2.0)
        got = sample(logits, rows, sampler).tokens.tolist()
        plan = make_plan(rows)
        noise = sampler.noise(plan.seeds, plan.seq_lens)
        want = [_vllm_reference_row(logits[i], {**ROW_DEFAULTS, **r}, noise[i]) for i, r in enumerate(rows)]
        assert got == want, trial


def _native_and_torch(logits: torch.Tensor, rows: list[dict], monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The picks of the loaded native kernels, then of the torch path, for the same logits and rows."""
    sampler = Sampler(logits.shape[1], torch.device("cpu"))
    native = sample(logits, rows, sampler).tokens
    with monkeypatch.context() as m:
        m.setitem(cpu_kernels._active, "ops", None)
        return native, sample(logits, rows, sampler).tokens


@pytest.mark.parametrize("vocab", [4099, 50000])
def test_native_picks_equal_the_torch_path_at_every_spread(kernel_isa, monkeypatch, vocab):
    """Top-p alone over a large vocabulary (the native kernel's mass levels and weighted selection), with top-k
    (its running-threshold selection), min-p and penalties, on flat to peaked and tied (bfloat16) logits."""
    if not cpu_kernels.has("sample_rows"):
        pytest.skip("the sampling unit is unavailable")
    rng = np.random.default_rng(vocab)
    kinds = [dict(top_p=0.9), dict(top_p=0.99), dict(top_p=0.3), dict(top_k=40), dict(top_k=1000, top_p=0.95),
             dict(min_p=0.02), dict(top_p=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                                    prompt=rng.integers(0, vocab, 500).tolist(), output=rng.integers(0, vocab, 100).tolist()),
             dict(), dict(temperature=0.0, repetition_penalty=2.0, prompt=list(range(50)))]
    for scale in (0.05, 1.0, 4.0, 30.0):
        logits = rand_logits(len(kinds) * 2, vocab, seed=int(scale * 10), scale=scale)
        rows = [dict(kinds[i % len(kinds)], temperature=kinds[i % len(kinds)].get("temperature", 0.7), seed=i, position=9)
                for i in range(len(logits))]
        for x in (logits, logits.bfloat16()):
            native, reference = _native_and_torch(x, rows, monkeypatch)
            assert torch.equal(native, reference), (scale, x.dtype)


def test_native_all_masked_row_picks_the_first_token(kernel_isa):
    """A row whose every token is banned or refused: -inf everywhere, and the pick is token 0, as torch's argmax."""
    logits = torch.full((2, 100), -math.inf)
    logits[1, 7] = 0.0
    rows = [dict(temperature=1.0, top_p=0.5, top_k=3, min_p=0.1), dict(temperature=1.0, top_p=0.5)]
    assert sample(logits, rows).tokens.tolist() == [0, 7]


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution_of_the_picked_token():
    logits = rand_logits(6, 300, seed=8)
    rows = [dict(temperature=0.8, seed=s, num_logprobs=0, repetition_penalty=1.5, prompt=[1, 2])
            for s in range(6)]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.tokens[:, None])[:, 0], atol=1e-6)
    assert out.logprobs.dtype == torch.float32
    assert out.top_ids is None and out.top_logprobs is None


def test_top_logprobs_are_sorted_and_match_log_softmax():
    logits = rand_logits(4, 300, seed=9)
    out = sample(logits, [dict(num_logprobs=n) for n in (-1, 0, 3, 5)])
    raw = torch.log_softmax(logits, -1)
    assert out.top_ids.shape == (4, 5) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids, torch.topk(raw, 5).indices)
    assert torch.allclose(out.top_logprobs, raw.gather(1, out.top_ids), atol=1e-6)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


# --- timing (printed, not asserted) ----------------------------------------------------------------


def _median_ms(fn, reps: int) -> float:
    """Median wall time of fn in milliseconds, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def test_measure_fast_and_general_paths(capsys):
    s, v = 32, 32000
    sampler = Sampler(v, torch.device("cpu"))
    logits = rand_logits(s, v, seed=10)
    rows = torch.arange(s)
    greedy = make_plan([dict()] * s)
    plain = make_plan([dict(temperature=0.8, seed=i) for i in range(s)])
    filtered = make_plan([dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=i) for i in range(s)])
    penalised = make_plan(
        [dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2,
              prompt=list(range(i, i + 500)), output=list(range(i, i + 100)), seed=i) for i in range(s)]
    )
    plans = [("greedy_fast", greedy), ("temperature", plain), ("topk_topp_minp", filtered), ("topp_penalties", penalised)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: figures that do not swing with the other workers' load
    paths = {"torch": None}
    if cpu_kernels.choice() != "torch" and cpu_kernels.available() and cpu_kernels.has("sample_rows"):
        paths[f"native {cpu_kernels.isa()}"] = cpu_kernels.ops()
    active = cpu_kernels._active.get("ops")
    figures = {}
    try:
        for path, ops in paths.items():
            cpu_kernels._active["ops"] = ops
            figures[path] = {name: _median_ms(lambda p=plan: sampler(logits, p, rows), 7) for name, plan in plans}
    finally:
        torch.set_num_threads(threads)
        cpu_kernels._active["ops"] = active
    with capsys.disabled():
        for path, times in figures.items():
            print(f"\nsampler S={s} V={v} CPU {path}, 1 thread, median ms:",
                  " ".join(f"{k}={ms:.2f}" for k, ms in times.items()), end="")
        print()
