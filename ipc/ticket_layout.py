"""The ticket ring's byte layout: where every field of a plan and a result lives in the shared segment.

A segment is a 4 KiB header page, then num_slots slots of equal size. The header holds int64s: magic, version,
owner pid, slot size, the RingGeometry that sized the slots, and the worker's counters. A slot is a 256-byte control block (counts and
sequence numbers, engine-written half then worker-written half, so the two sides never share a cache line)
followed by one fixed-capacity region per StepPlan and StepResult array, each 64-byte aligned and sized for the
geometry's worst case. No logits cross the ring: a RepickOnly repair is a RESAMPLE ticket, a plan of the
settled step's sampling rows under their masks now (C_RESAMPLE_OF naming that step), which the worker samples
again from the logits it kept and answers as any step's result. TicketRing (tickets.py) maps this layout onto an
open segment; this module only computes it and checks that a plan or result fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .plan import StepPlan, StepResult
from .sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS

MAGIC = 0x474E52454C52544D  # b"MTRLERNG" little-endian
VERSION = 13  # 5: StepPlan.grammar_bitmask and num_drafts, StepPlan.state_slots, the logits region and logits tickets;
# 6: StepPlan.bias_start, bias_ids and bias_values (logit_bias); 7: the ticket's StepKind (C_KIND);
# 8: prompt logprobs (StepPlan.prompt_lp_*, StepResult.prompt_*); 9: embeddings (StepPlan.pool, StepResult.pooled,
# RingGeometry.max_pool_dim; the worker's counters moved to H_WORKER 24; StepPlan.lora_slots); 10: LoRA tickets (C_KIND LORA, C_LORA_SLOT, the request text region)
# 11: the alternatives regions (RNS, PN) hold a bounded number of rows (RingGeometry.sample_logprob_rows / prompt_logprob_rows)
# 12: StepPlan.pinned_start and pinned_ids (logprob_token_ids), counted by C_PI in the control block's third line
# 13: RESAMPLE tickets (C_KIND 3, C_RESAMPLE_OF) in place of logits tickets; no logits region (max_logits_vocab gone)

STATUS_OK = 0
STATUS_ERROR = 1

ALIGN = 64
HEADER_BYTES = 4096
CTRL_BYTES = 384  # 128-byte lines: engine-written, worker-written, engine-written again (no false sharing)

# Header int64 indices.
H_MAGIC, H_VERSION, H_OWNER_PID, H_SLOT_BYTES = 0, 1, 2, 3
H_GEOMETRY = 4  # the RingGeometry fields, in order
N_GEOMETRY = 12  # RingGeometry's fields in the header (at most 20: the worker's counters follow)
H_WORKER = 24  # worker_pid, started_ns, idle_ns, busy_ns, steps, waiting_since_ns (worker-written)
# Control block int64 indices (relative to the slot's first int64).
C_PLAN_SEQ, C_T, C_R, C_B, C_K, C_H, C_SO, C_SI, C_G, C_W, C_STEPS = range(11)  # C_STEPS: a burst's steps
C_S = 11  # state_slots entries (0 or R)
C_RESAMPLE_OF = 12  # a RESAMPLE ticket: the seq of the settled step whose kept logits it samples again
C_BI = 13  # logit_bias entries (bias_ids, bias_values)
C_KIND = 14  # the ticket's StepKind: what the worker runs
C_LORA_SLOT = 15  # a LoRA ticket: the adapter slot; its adapter's path is the slot's request text (empty: unload)
C_RESULT_SEQ, C_STATUS, C_RES_R, C_RES_N, C_RES_FLAGS, C_ERR_LEN, C_EXEC_NS, C_RES_STEPS = range(16, 24)
C_RES_P, C_RES_PN = 24, 25  # prompt logprobs: positions, and alternatives per position
C_RES_Q, C_RES_QD = 26, 27  # pooled vectors: rows, and their width
C_PI = 32  # the third line (engine-written): logprob_token_ids entries (pinned_ids)
HAS_LOGPROBS, HAS_TOP, HAS_PROMPT, HAS_POOLED = 1, 2, 4, 8
# Alternatives (an id and a log-probability each) one slot's sample region, and again its prompt region, holds at
# most: a --max-logprobs of the whole vocabulary would otherwise size them for every token of a step (GiBs). Rows
# past this bound are the scheduler's to keep out of one step (prompt positions) or the step shaper's (bursts).
LOGPROB_ALTERNATIVES = 1 << 22

# Every StepPlan field: (name, dtype, length kind). Kinds: T tokens, R rows, R1 rows + 1,
# RB rows × block-table width, RK rows × ban width, H history tokens, SO / SI swap pairs × 2,
# GW grammar rows × bitmask words, S state slots (R for a model with recurrent state, else 0), BI logit_bias entries
# (at most MAX_LOGIT_BIAS per row), PI logprob_token_ids entries (at most max_logprobs per row).
PLAN_FIELDS = (
    ("input_ids", np.int32, "T"),
    ("positions", np.int32, "T"),
    ("slot_mapping", np.int64, "T"),
    ("query_start", np.int32, "R1"),
    ("seq_lens", np.int32, "R"),
    ("block_tables", np.int32, "RB"),
    ("sample", np.bool_, "R"),
    ("feed_from_row", np.int32, "R"),
    ("temperature", np.float32, "R"),
    ("top_k", np.int32, "R"),
    ("top_p", np.float32, "R"),
    ("min_p", np.float32, "R"),
    ("repetition_penalty", np.float32, "R"),
    ("presence_penalty", np.float32, "R"),
    ("frequency_penalty", np.float32, "R"),
    ("seeds", np.int64, "R"),
    ("mask_kind", np.uint8, "R"),
    ("force_token", np.int32, "R"),
    ("ban_ids", np.int32, "RK"),
    ("num_logprobs", np.int32, "R"),
    ("hist_tokens", np.int32, "H"),
    ("hist_start", np.int32, "R1"),
    ("hist_prompt_len", np.int32, "R"),
    ("swap_out", np.int32, "SO"),
    ("swap_in", np.int32, "SI"),
    ("grammar_bitmask", np.int32, "GW"),
    ("num_drafts", np.int32, "R"),
    ("state_slots", np.int32, "S"),
    ("bias_start", np.int32, "R1"),
    ("bias_ids", np.int32, "BI"),
    ("bias_values", np.float32, "BI"),
    ("prompt_lp_n", np.int32, "R"),
    ("prompt_lp_count", np.int32, "R"),
    ("prompt_lp_next", np.int32, "R"),
    ("pool", np.int32, "R"),
    ("lora_slots", np.int32, "R"),
    ("pinned_start", np.int32, "R1"),
    ("pinned_ids", np.int32, "PI"),
)
assert tuple(f[0] for f in PLAN_FIELDS) == tuple(f.name for f in dataclasses.fields(StepPlan)), (
    "StepPlan changed: update the ticket layout"
)
PLAN_NAMES = tuple(f[0] for f in PLAN_FIELDS)

# StepResult arrays, one result per step of a burst, step after step: tokens and logprobs per row (RS),
# top-N per row (RNS), the error message (E); then a STEP's prompt logprobs, one per position (P) and its top-N
# (PN); then a STEP's pooled vectors, one per pooled row (QD).
RESULT_FIELDS = (
    ("tokens", np.int32, "RS"),
    ("logprobs", np.float32, "RS"),
    ("top_ids", np.int32, "RNS"),
    ("top_logprobs", np.float32, "RNS"),
    ("error", np.uint8, "E"),
    ("prompt_logprobs", np.float32, "P"),
    ("prompt_top_ids", np.int32, "PN"),
    ("prompt_top_logprobs", np.float32, "PN"),
    ("pooled", np.float32, "QD"),
)
# What an engine-written ticket without a plan says in words (a LoRA ticket's path): one region after the results.
TEXT_FIELDS = (("request_text", np.uint8, "E"),)


@dataclass(frozen=True, slots=True)
class RingGeometry:
    """The ring's shape: how many slots, and the capacity of every plan and result region."""

    num_slots: int = 4
    max_tokens: int = 8192
    max_rows: int = 256
    max_blocks_per_row: int = 512
    max_ban_ids: int = 16
    max_hist_tokens: int = 65536
    max_logprobs: int = 20
    error_msg_bytes: int = 4096
    max_swaps: int = 4096  # block copies per step, each way
    max_burst: int = 1  # decode steps one ticket may ask for (results held per step; a verify step's picks too)
    max_bitmask_words: int = 1  # int32 words of a grammar row's token bitmask (the model's vocab / 32)
    max_pool_dim: int = 0  # width of a pooled vector (the model's hidden size; 0: the ring carries no embeddings)

    def capacity(self, kind: str) -> int:
        """Elements a region of this length kind holds."""
        return {
            "T": self.max_tokens,
            "R": self.max_rows,
            "R1": self.max_rows + 1,
            "RB": self.max_rows * self.max_blocks_per_row,
            "RK": self.max_rows * self.max_ban_ids,
            "H": self.max_hist_tokens,
            "RS": self.max_rows * self.max_burst,
            "RNS": self.sample_logprob_rows * self.max_logprobs,
            "E": self.error_msg_bytes,
            "SO": 2 * self.max_swaps,
            "SI": 2 * self.max_swaps,
            "GW": self.max_rows * self.max_bitmask_words,
            "S": self.max_rows,
            "BI": self.max_rows * MAX_LOGIT_BIAS,
            "PI": self.max_rows * self.max_logprobs,
            "P": self.max_tokens,
            "PN": self.prompt_logprob_rows * self.max_logprobs,
            "QD": self.max_rows * self.max_pool_dim,
        }[kind]

    @property
    def sample_logprob_rows(self) -> int:
        """Rows of max_logprobs alternatives a ticket's results hold (rows x burst steps): every row of one step
        always fits, a burst of wide rows may not (the step shaper runs a row wanting more than MAX_LOGPROBS alone)."""
        return max(self.max_rows, min(self.max_rows * self.max_burst, LOGPROB_ALTERNATIVES // self.max_logprobs))

    @property
    def prompt_logprob_rows(self) -> int:
        """Prompt positions with max_logprobs alternatives one step's result holds (prompt_logprob_rows(), which
        the scheduler chunks a prompt_logprobs prefill to)."""
        return prompt_logprob_rows(self.max_tokens, self.max_logprobs)


def prompt_logprob_rows(max_tokens: int, max_logprobs: int) -> int:
    """Prompt positions whose alternatives (max_logprobs each: the ring's width) one step may report: every token of a
    step at the default width, fewer for a wide --max-logprobs (at least one)."""
    return max(1, min(max_tokens, LOGPROB_ALTERNATIVES // max(max_logprobs, MAX_LOGPROBS)))


def check_geometry(g: RingGeometry) -> None:
    """ValueError unless every capacity is positive (the pooled region may be absent)."""
    for f in dataclasses.fields(g):
        if getattr(g, f.name) < (0 if f.name == "max_pool_dim" else 1):
            raise ValueError(f"RingGeometry.{f.name} must be >= 1, got {getattr(g, f.name)}")


def region_offsets(g: RingGeometry) -> dict[str, int]:
    """Byte offset of every region inside a slot (aligned to 64), and the slot size under "_end"."""
    offsets, at = {}, CTRL_BYTES
    for name, dtype, kind in PLAN_FIELDS + RESULT_FIELDS + TEXT_FIELDS:
        offsets[name] = at
        at += -(-g.capacity(kind) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    offsets["_end"] = -(-at // 4096) * 4096
    return offsets


def regions(base: np.ndarray, slot_at: int, offsets: dict[str, int], g: RingGeometry, fields) -> list[np.ndarray]:
    """Full-capacity 1-D arrays of one slot's regions, in field order."""
    out = []
    for name, dtype, kind in fields:
        start = slot_at + offsets[name]
        out.append(base[start : start + g.capacity(kind) * np.dtype(dtype).itemsize].view(dtype))
    return out


def region_lengths(
    t: int, r: int, b: int, k: int, h: int, so: int, si: int, g: int, w: int, s: int, bi: int, pi: int,
) -> dict[str, int]:
    """Element count of each length kind for a plan's counts."""
    return {"T": t, "R": r, "R1": r + 1, "RB": r * b, "RK": r * k, "H": h, "SO": 2 * so, "SI": 2 * si, "GW": g * w,
            "S": s, "BI": bi, "PI": pi}


def plan_counts(plan: StepPlan, g: RingGeometry) -> tuple[int, ...]:
    """(T, R, B, K, H, SO, SI, G, W, S, BI, PI) of a plan, checked against its own arrays and the ring's capacity."""
    t, r, h = len(plan.input_ids), len(plan.seq_lens), len(plan.hist_tokens)
    so, si = len(plan.swap_out), len(plan.swap_in)
    gr, w = plan.grammar_bitmask.shape if plan.grammar_bitmask.ndim == 2 else (-1, -1)
    if gr > r or (gr > 0 and w > g.max_bitmask_words):
        raise ValueError(f"plan has a grammar bitmask of {plan.grammar_bitmask.shape}, the ticket ring holds at most "
                         f"{r} rows of {g.max_bitmask_words} words")
    s = len(plan.state_slots)
    if s not in (0, r):
        raise ValueError(f"plan has {s} state slots for {r} rows (expected {r}, or none)")
    bi = len(plan.bias_ids)
    if bi > g.capacity("BI"):
        raise ValueError(f"plan has {bi} logit_bias entries, the ticket ring holds at most {g.capacity('BI')}")
    pi = len(plan.pinned_ids)
    if pi > g.capacity("PI"):
        raise ValueError(f"plan has {pi} logprob_token_ids entries, the ticket ring holds at most {g.capacity('PI')}")
    if so > g.max_swaps or si > g.max_swaps:
        raise ValueError(f"plan has {max(so, si)} block copies, the ticket ring holds at most {g.max_swaps}")
    b = _width(plan.block_tables, r, "block_tables")
    k = _width(plan.ban_ids, r, "ban_ids")
    if t > g.max_tokens or r > g.max_rows or b > g.max_blocks_per_row or k > g.max_ban_ids or h > g.max_hist_tokens:
        for value, limit, what in (
            (t, g.max_tokens, "tokens"),
            (r, g.max_rows, "rows"),
            (b, g.max_blocks_per_row, "blocks per row"),
            (k, g.max_ban_ids, "banned ids per row"),
            (h, g.max_hist_tokens, "history tokens"),
        ):
            if value > limit:
                raise ValueError(f"plan has {value} {what}, the ticket ring holds at most {limit}")
    shapes = {
        "T": (t,), "R": (r,), "R1": (r + 1,), "RB": (r, b), "RK": (r, k), "H": (h,), "SO": (so, 2), "SI": (si, 2),
        "GW": (gr, w), "S": (s,), "BI": (bi,), "PI": (pi,),
    }
    for name, _, kind in PLAN_FIELDS:
        if getattr(plan, name).shape != shapes[kind]:
            raise ValueError(f"plan.{name} has shape {getattr(plan, name).shape}, expected {shapes[kind]}")
    return t, r, b, k, h, so, si, gr, w, s, bi, pi


def result_counts(results: list[StepResult], g: RingGeometry) -> tuple[int, int, int]:
    """(R, N, flags) of a burst's results (one per step, alike in shape), checked against their own arrays
    and the ring's capacity."""
    if not 1 <= len(results) <= g.max_burst:
        raise ValueError(f"{len(results)} step results, the ticket ring holds 1 to {g.max_burst}")
    counts = {_counts(result, g) for result in results}
    if len(counts) > 1:
        raise ValueError("the steps of a burst must have results of one shape")
    (r, n, _), = counts
    if len(results) * r * n > g.capacity("RNS"):
        raise ValueError(f"{len(results)} steps of {r} rows x {n} top logprobs, the ticket ring holds "
                         f"{g.sample_logprob_rows} rows of {g.max_logprobs}")
    if any(r.prompt_logprobs is not None or r.pooled is not None for r in results[1:]):
        raise ValueError("only a ticket's first result carries prompt logprobs and pooled vectors")
    return counts.pop()


def prompt_counts(result: StepResult, g: RingGeometry) -> tuple[int, int]:
    """(P, N) of a result's prompt logprobs ((0, 0): none), checked against its own arrays and the ring."""
    if result.prompt_logprobs is None:
        return 0, 0
    p = len(result.prompt_logprobs)
    n = 0 if result.prompt_top_ids is None else _width(result.prompt_top_ids, p, "prompt_top_ids")
    if n and (result.prompt_top_logprobs is None or result.prompt_top_logprobs.shape != result.prompt_top_ids.shape):
        raise ValueError("result.prompt_top_logprobs must have the shape of result.prompt_top_ids")
    if p > g.max_tokens or n > g.max_logprobs or p * n > g.capacity("PN"):
        raise ValueError(f"result has prompt logprobs for {p} positions x {n}, the ticket ring holds "
                         f"{g.max_tokens} positions, {g.prompt_logprob_rows} with {g.max_logprobs} alternatives")
    return p, n


def pooled_counts(result: StepResult, g: RingGeometry) -> tuple[int, int]:
    """(Q, D) of a result's pooled vectors ((0, 0): none), checked against the ring."""
    if result.pooled is None:
        return 0, 0
    q, d = result.pooled.shape
    if q > g.max_rows or d > g.max_pool_dim:
        raise ValueError(f"result has {q} pooled vectors of {d}, the ticket ring holds {g.max_rows} of {g.max_pool_dim}")
    return q, d


def _counts(result: StepResult, g: RingGeometry) -> tuple[int, int, int]:
    """(R, N, flags) of one result."""
    r = len(result.tokens)
    if r > g.max_rows:
        raise ValueError(f"result has {r} rows, the ticket ring holds at most {g.max_rows}")
    flags, n = 0, 0
    if result.logprobs is not None:
        if len(result.logprobs) != r:
            raise ValueError(f"result.logprobs has {len(result.logprobs)} rows, expected {r}")
        flags |= HAS_LOGPROBS
    if result.top_ids is not None:
        n = _width(result.top_ids, r, "top_ids")
        if result.top_logprobs is None or result.top_logprobs.shape != result.top_ids.shape:
            raise ValueError("result.top_logprobs must have the shape of result.top_ids")
        if n > g.max_logprobs:
            raise ValueError(f"result has {n} top logprobs per row, the ticket ring holds at most {g.max_logprobs}")
        flags |= HAS_TOP
    return r, n, flags


def _width(array: np.ndarray, rows: int, name: str) -> int:
    """The column count of a 2-D per-row array; ValueError if it is not [rows, width]."""
    if array.ndim != 2 or array.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}, width], got {array.shape}")
    return array.shape[1]
