"""SimRunner: a simulated device for the worker process — a step's calibrated time, no CPU meanwhile, toy tokens.

The worker (worker.py) serves the engine core's real ticket ring with it as it would with the model runner, so
`metrale serve` runs its real supervisor, frontend, engine core, ring and doorbell around a device whose cost is
known; the engine core's own work is then the only host cost, and the worker's idle share (its ring counters)
says whether the device waited on Python. Start it with the environment variable

    METRALE_SIMULATE_DEVICE=A,B,C metrale serve --model DIR ...      (empty or "default": the defaults below)

which the worker reads (worker.SIMULATE_ENV). DIR needs a config.json and a tokenizer, no weights:
`write_weightless_model(out_dir, preset)` writes one (tiny_model's folder without its safetensors).

**Step time** t = A + B·rows + C·tokens milliseconds (rows: the plan's rows; tokens: its query tokens, prefill
chunks included). The defaults, A = 3 ms, B = 0.003 ms per row, C = 0.002 ms per token, stand for bench-small
(16 layers, hidden 1024, GQA 16/8, vocab 32000) in bf16 on one H200, and are ASSUMED, NOT MEASURED: no H200 was
at hand when they were set. They come from arithmetic, not a profile: A is a 16-layer step's launches, norms and
sampling at small batch; B a row's share of attention over ~500 tokens of KV (32 KiB a token, read at ~4.8 TB/s)
plus its sampling; C a token's 0.54 GFLOP of matmuls at a few hundred TFLOP/s. They give ~4.3 ms for 256 decode
rows and ~8.1 ms for 1,024, near the 5 ms / 8 ms steps issue 27's targets name. Refit A, B, C from an H200
profile of bench-small (`bench_serve.py` step times at three batch sizes and a prefill) and pass them.

The step computes its tokens (numpy, vectorized: tens of microseconds at 1,024 rows) and then sleeps until its
start + t, so the device's "compute" costs the host no CPU; a step whose tokens took longer than t counts as an
overrun (`overruns`, logged at the first and every 100th). The runner has no launch(): the worker runs each ticket to completion and
waits for the next on its doorbell, as it does for a CPU runner.

**Tokens** (the FakeDevice style, cheaper): the runner keeps a KV cache of token ids; a step writes its input
ids (a fed row's from the row it is fed from, as the device-side feed does) at the plan's slot mapping, and each
sampling row reads the last three tokens of its context back through its block table and picks

    next_token(t[-3], t[-2], t[-1], length) = splitmix64 of the four, mod vocab

(missing tokens of a context shorter than three are the vocab size itself). So a stream is a function of its
prompt alone — `expected_tokens(prompt, n, vocab)` computes it — and a wrong slot mapping, block table, feed or
prefix-cache hit changes it; reading a never-written slot fails the step. Row masks are kept: a forced token
(MASK_FORCE) is the pick; a banned pick (MASK_BAN) and a pick outside a grammar row's bitmask (MASK_GRAMMAR)
move on to the next allowed id (mod vocab). Temperature, seeds, top-k/p and penalties do not change the pick
(the plan still carries them: the engine's cost of building them is real). This is not FakeDevice's rule:
FakeDevice samples full logits through the host sampler, ~50 µs a row, more than a step at 1,024 rows.
Logprobs are 0.0 for every sampled token (and every asked prompt position). Decode bursts run their steps one after another (each timed);
verify steps (speculative decoding) and RESAMPLE tickets are not simulated.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metrale.ipc.plan import (
    FEED_HOST, MASK_BAN, MASK_FORCE, MASK_GRAMMAR, FedAheadPolicy, ModelInfo, StepPlan, StepResult, moved_on,
    unpack_bitmask,
)

from .result_copy import Ready

log = logging.getLogger("metrale.gpu_worker.sim")

DEFAULT_KV_BLOCKS = 65536  # 1M tokens at 16 a block: more than 1,024 requests of 1,024 tokens need
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, slots=True)
class StepCost:
    """A simulated step's time: a + b·rows + c·tokens, in seconds (fields in ms, as the env var gives them)."""

    a_ms: float = 3.0
    b_ms: float = 0.003
    c_ms: float = 0.002

    @classmethod
    def parse(cls, text: str | None) -> StepCost:
        """"A,B,C" in ms (empty or "default": the assumed defaults); ValueError names what is wrong."""
        if not text or text.strip() == "default":
            return cls()
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3:
            raise ValueError(f"simulated device cost must be 'A,B,C' (ms, ms per row, ms per token), got {text!r}")
        a, b, c = (float(p) for p in parts)
        if min(a, b, c) < 0:
            raise ValueError(f"simulated device cost must not be negative, got {text!r}")
        return cls(a, b, c)

    def seconds(self, rows: int, tokens: int) -> float:
        return (self.a_ms + self.b_ms * rows + self.c_ms * tokens) / 1e3


def next_tokens(t1: np.ndarray, t2: np.ndarray, t3: np.ndarray, length: np.ndarray, vocab: int) -> np.ndarray:
    """int64 picks for contexts ending ..., t1, t2, t3 of these lengths (the rule in the module docstring)."""
    with np.errstate(over="ignore"):
        x = (t1.astype(np.uint64) * _GOLDEN + t2.astype(np.uint64) * _M1 + t3.astype(np.uint64) * _M2
             + length.astype(np.uint64) * _GOLDEN * _GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab)).astype(np.int64)


def expected_tokens(prompt: list[int], n: int, vocab: int, eos_token_ids=(), ignore_eos: bool = True) -> list[int]:
    """The n tokens the simulated device gives after prompt (up to and including an EOS unless ignore_eos)."""
    context = list(prompt)
    out: list[int] = []
    for _ in range(n):
        last = ([vocab] * 3 + context)[-3:]
        pick = int(next_tokens(*(np.array([t]) for t in last), np.array([len(context)]), vocab)[0])
        out.append(pick)
        context.append(pick)
        if not ignore_eos and pick in eos_token_ids:
            break
    return out


def write_weightless_model(out_dir: str | Path, preset: str = "bench-small") -> Path:
    """A model folder for the simulated device: tiny_model's config.json and tokenizer, no weights. Its vocab is
    the tokenizer's (ids past it would not detokenize), its other sizes the preset's."""
    from .tiny_model import _model_config, write_tokenizer, train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = _model_config("llama", preset, "bfloat16", False, None, tokenizer, {"vocab_size": None})
    (out / "config.json").write_text(__import__("json").dumps(config, indent=1))
    write_tokenizer(out, tokenizer, model_max_length=config["max_position_embeddings"])
    return out


class SimRunner:
    """The worker's runner for a simulated device (module docstring): `info`, `launch`, `launch_burst` (each step
    runs to completion: its result is ready when launch returns)."""

    def __init__(self, model_dir: str, *, step_ms: str | None = None, num_kv_blocks: int | None = None,
                 block_size: int | None = None, max_model_len: int | None = None, swap_space: int = 0,
                 **_ignored):
        """The model's facts from model_dir (no weights read); step_ms "A,B,C" (StepCost.parse); the model
        runner's other keywords (dtype, device, ...) are accepted and mean nothing here."""
        from metrale.model_facts import resolve_model

        facts = resolve_model(model_dir, max_model_len)
        self.cost = StepCost.parse(step_ms)
        block_size = block_size or 16
        num_kv_blocks = num_kv_blocks or DEFAULT_KV_BLOCKS
        num_swap_blocks = num_kv_blocks if swap_space else 0
        self.info = ModelInfo(
            name=f"sim:{facts.name}", vocab_size=facts.vocab_size, max_model_len=facts.max_model_len,
            eos_token_ids=tuple(facts.eos_token_ids), num_kv_blocks=num_kv_blocks, block_size=block_size,
            dtype="sim", fed_ahead_policy=FedAheadPolicy.REWIND, num_swap_blocks=num_swap_blocks, kernels="sim",
        )
        self.kv = np.full(num_kv_blocks * block_size, -1, dtype=np.int64)
        self.host_kv = np.full(num_swap_blocks * block_size, -1, dtype=np.int64)
        self.prev_tokens = np.zeros(0, dtype=np.int64)
        self.steps = 0
        self.overruns = 0
        self.overrun_s = 0.0
        log.info("simulated device: step = %.3f ms + %.4f ms/row + %.4f ms/token (assumed bench-small on H200)",
                 self.cost.a_ms, self.cost.b_ms, self.cost.c_ms)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: its tokens now, then sleep out the rest of its calibrated time."""
        start = time.perf_counter()
        result = self._tokens(plan)
        self._wait_until(start + self.cost.seconds(plan.num_rows, plan.num_tokens))
        return result

    def execute_burst(self, plan: StepPlan, steps: int) -> list[StepResult]:
        """A decode burst: the plan, then the same plan moved on one position a step (each fed its own token)."""
        bs = self.info.block_size
        return [self.execute(moved_on(plan, k, bs) if k else plan) for k in range(steps)]

    def launch(self, plan: StepPlan) -> Ready:
        return Ready(self.execute(plan))

    def launch_burst(self, plan: StepPlan, steps: int) -> list[Ready]:
        return [Ready(r) for r in self.execute_burst(plan, steps)]

    def _wait_until(self, deadline: float) -> None:
        """Sleep (no CPU) until deadline; a step already past it is an overrun."""
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1
            self.overrun_s -= left
            if self.overruns % 100 == 1:
                log.warning("simulated device: %d of %d steps took longer than their time (%.1f ms over in all)",
                            self.overruns, self.steps, self.overrun_s * 1e3)

    def _tokens(self, plan: StepPlan) -> StepResult:
        """Write the step's inputs into the KV, then pick a token for every sampling row."""
        self.steps += 1
        bs, vocab = self.info.block_size, self.info.vocab_size
        self._swap(plan)
        input_ids = plan.input_ids.astype(np.int64)
        fed = np.nonzero(plan.feed_from_row != FEED_HOST)[0]
        if len(fed):
            input_ids[plan.query_start[fed]] = self.prev_tokens[plan.feed_from_row[fed]]
        self.kv[plan.slot_mapping] = input_ids
        R = plan.num_rows
        tokens = np.full(R, -1, dtype=np.int64)
        rows = np.nonzero(plan.sample)[0]
        if len(rows):
            lens = plan.seq_lens[rows].astype(np.int64)
            back = []
            for k in (3, 2, 1):  # the context's last three tokens, read through each row's block table
                pos = lens - k
                known = pos >= 0
                pos = np.maximum(pos, 0)
                slots = plan.block_tables[rows, pos // bs].astype(np.int64) * bs + pos % bs
                t = np.where(known, self.kv[slots], vocab)
                if (t < 0).any():
                    raise RuntimeError("a step read KV that was never written")
                back.append(t)
            tokens[rows] = next_tokens(*back, lens, vocab)
            self._apply_masks(plan, tokens)
        self.prev_tokens = tokens
        lp = np.where(tokens >= 0, 0.0, np.nan).astype(np.float32) if (plan.num_logprobs >= 0).any() else None
        result = StepResult(tokens=tokens.astype(np.int32), logprobs=lp)
        if plan.prompt_lp_count.any():  # 0.0 for each asked prompt position, as for sampled tokens; no alternatives
            result.prompt_logprobs = np.zeros(int(plan.prompt_lp_count.sum()), dtype=np.float32)
        return result

    def _apply_masks(self, plan: StepPlan, tokens: np.ndarray) -> None:
        """Forced tokens; banned picks and picks outside a grammar bitmask move on to the next allowed id."""
        masks = plan.mask_kind
        if not masks.any():
            return
        vocab = self.info.vocab_size
        grammar_rows = np.nonzero(masks & MASK_GRAMMAR)[0].tolist()
        for r in np.nonzero(masks)[0].tolist():
            if not plan.sample[r]:
                continue
            if masks[r] & MASK_FORCE:
                tokens[r] = plan.force_token[r]
                continue
            allowed = np.ones(vocab, dtype=bool)
            if masks[r] & MASK_BAN:
                banned = plan.ban_ids[r]
                allowed[banned[(banned >= 0) & (banned < vocab)]] = False
            if masks[r] & MASK_GRAMMAR:
                allowed &= unpack_bitmask(plan.grammar_bitmask[grammar_rows.index(r)], vocab)
            order = (np.arange(vocab) + tokens[r]) % vocab
            ok = order[allowed[order]]
            if len(ok) == 0:
                raise RuntimeError(f"row {r}: its masks allow no token")
            tokens[r] = ok[0]

    def _swap(self, plan: StepPlan) -> None:
        """Copy blocks out to host, then in (as FakeDevice does)."""
        bs = self.info.block_size
        for d, h in plan.swap_out.tolist():
            self.host_kv[h * bs:(h + 1) * bs] = self.kv[d * bs:(d + 1) * bs]
        for h, d in plan.swap_in.tolist():
            if h < 0:  # a device copy (ipc/plan.py)
                self.kv[d * bs:(d + 1) * bs] = self.kv[(-1 - h) * bs:(-h) * bs]
                continue
            self.kv[d * bs:(d + 1) * bs] = self.host_kv[h * bs:(h + 1) * bs]
