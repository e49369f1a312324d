"""metrale.LLM: the offline engine — an engine core wired to the model runner in this process."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Sequence as Seq

import msgspec
import numpy as np

from metrale.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from metrale.config import EngineArgs
from metrale.settings import DEFAULTS
from metrale.engine_core.engine import EngineCore, EngineOptions
from metrale.engine_core.pipeline import special_tokens_of
from metrale.frontend.chat import ChatTemplate, ChatTemplateError, chat_template_source, special_token_variables
from metrale.frontend.detokenizer import IncrementalDetokenizer
from metrale.frontend.tokenizer import Tokenizer
from metrale.ipc.messages import BeamHypothesis, EngineStats, RequestOutputDelta, TokenLogprob
from metrale.ipc.pooling import PoolingParams
from metrale.ipc.sampling import SamplingParams, logprobs_cap, seeded_for_choice
from metrale.llm_embed import EmbeddingRequestOutput, embed
from metrale.llm_lora import LoRARequest, adapter_names
from metrale.model_facts import generation_defaults, resolve_model_dir

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt (vLLM's name): its tokens, text and how it ended."""

    index: int  # which of the prompt's n samples
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' log-probabilities (None without logprobs)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass(slots=True)
class RequestOutput:
    """The whole result of one prompt: its n samples in `outputs` (vLLM's shape); `token_ids`, `text`,
    `finish_reason`, `logprobs` and `error` are the first sample's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt: str | None = None  # the prompt's text (a chat's rendered template), None when given as token ids
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (its first sample's request)
    # SamplingParams.prompt_logprobs: entry i is prompt token i's log-probability given those before it and the
    # top-N alternatives (None for the first token), as vLLM's prompt_logprobs (TokenLogprob, as `logprobs`).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


class LLM:
    """Generate offline, batched, like vLLM's LLM: LLM(model=...).generate(prompts, SamplingParams(...)),
    LLM.chat(messages); outputs read `outputs[i].text` as vLLM's do."""

    def __init__(self, model_dir: str | None = None, dtype: str = DEFAULTS.dtype, *, model: str | None = None,
                 generation_config: str = DEFAULTS.generation_config, **kwargs):
        if model is not None and model_dir is not None and model != model_dir:
            raise ValueError(f"two models: {model_dir!r} and model={model!r}")
        args = EngineArgs(model=model if model is not None else model_dir, dtype=dtype, **kwargs)
        args.validate()
        from metrale.gpu_worker.local_device import LocalDevice
        from metrale.gpu_worker.model_runner import ModelRunner

        if args.data_parallel_size > 1:
            raise ValueError("data_parallel_size is for `metrale serve` (replicas behind one frontend); LLM runs one engine")
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self._sampling_defaults = generation_defaults(self.model_dir, generation_config)
        options = EngineOptions.from_args(args)
        if args.tensor_parallel_size > 1:
            self.runner = None
            self.device = _spawn_group(args, self.model_dir)
        else:
            self.runner = ModelRunner(**args.runner_kwargs(self.model_dir))
            # On a CPU the model and the host share one GIL and the same cores: a device thread costs more
            # than the overlap gains (measured), so steps run inside launch; the lane's logic is unchanged.
            self.device = LocalDevice(self.runner, threaded=args.pipeline and self.runner.device.type != "cpu")
            if self.device.threaded:
                options.decode_burst = 1  # the lane overlaps the host's tick with the device's step already
        self.engine = EngineCore(self.device, options, special_tokens=special_tokens_of(self.tokenizer))
        self._ids = itertools.count()
        self._grammars = None  # the grammar compiler (frontend/grammar_compiler.py), made at the first constraint
        self._chat_template: ChatTemplate | None = None

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt runs with when generate() is given no params: the model's generation_config.json
        sampling values (LLM(generation_config="vllm"): SamplingParams' own defaults), as vLLM's LLM does."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: str | dict | Seq[str | dict] | Seq[int] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}) to
        completion, params.n samples each; outputs in the order of the prompts.

        A prompt or parameter the engine cannot serve raises ValueError naming the field, and nothing runs.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model).
        """
        if sampling_params is not None:  # vLLM's keyword
            if params is not None:
                raise ValueError("give params or sampling_params, not both")
            params = sampling_params
        texts, token_lists = self._prompts(prompts)
        return self._run(texts, token_lists, params, adapter_names(self, lora_request, len(token_lists)))

    def embed(self, prompts, pooling_params: PoolingParams | Seq[PoolingParams] | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (text, token ids, or vLLM's prompt dicts), pooled as the model pools (its
        sentence-transformers config; a plain decoder: its last token, normalised): `outputs[i].outputs.embedding`."""
        texts, token_lists = self._prompts(prompts)
        return embed(self, texts, token_lists, list(pooling_params) if isinstance(pooling_params, Seq) else pooling_params)

    def next_id(self) -> int:
        """A fresh number for an offline request's id."""
        return next(self._ids)

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them, each
        rendered by the model's chat template (or chat_template: a file or Jinja); one RequestOutput each, whose
        `prompt` is the rendered text. ChatTemplateError when the model has no template or a chat does not render."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give params or sampling_params, not both")
            params = sampling_params
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = self._template(chat_template)
        texts = [template.render(list(chat), add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, tools=tools,
                                 extra=chat_template_kwargs) for chat in conversations]
        # The template writes the special tokens it wants (BOS included): nothing is added, as over HTTP.
        return self._run(texts, [self.tokenizer.encode(t, add_special_tokens=False) for t in texts], params,
                         adapter_names(self, lora_request, len(texts)))

    def beam_search(
        self,
        prompts: str | dict | Seq[str | dict] | Seq[int] | Seq[Seq[int]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's beam_width best hypotheses, best first, found by transformers'
        beam search (metrale/beam_search.py); prompts as generate() takes them.

        Each prompt is one beam search in the engine (engine_core/beam_groups.py): its live beams are rows that
        decode together, beside every other search's, forking their parents' KV blocks by reference. A prompt or
        parameter the engine cannot serve raises ValueError naming the field, and nothing runs.
        """
        params.validate()
        _, token_lists = self._prompts(prompts)
        self._check_beam_prompts(token_lists, params.max_tokens)
        eos = self.engine.info.eos_token_ids
        for ids in token_lists:
            BeamSearch(ids, params, eos)  # a width the engine cannot report raises here, before anything runs
        rids = [f"beam-{next(self._ids)}" for _ in token_lists]
        index = {rid: i for i, rid in enumerate(rids)}
        got: list[list[BeamHypothesis] | None] = [None] * len(rids)
        queue = list(zip(rids, token_lists))[::-1]  # popped from the end: first in, first added
        open_ids: set[str] = set()
        try:
            while queue or open_ids:
                room = self.engine.options.max_waiting  # within the waiting room (a search's forks may wait too)
                while queue and len(open_ids) < room and self.engine.scheduler.num_waiting < room:
                    rid, ids = queue.pop()
                    self.engine.add_beam_request(rid, ids, params)
                    open_ids.add(rid)
                for delta in self.engine.step():
                    if delta.request_id not in open_ids or delta.finish_reason is None:
                        continue
                    if delta.beams is None:
                        raise RuntimeError(f"a beam search ended {delta.finish_reason}: {delta.error}")
                    got[index[delta.request_id]] = delta.beams
                    open_ids.discard(delta.request_id)
        except BaseException:
            self.abandon(open_ids)
            raise
        self.run_until_idle()
        outputs = []
        for ids, hyps in zip(token_lists, got):
            sequences = []
            for h in hyps:
                text = IncrementalDetokenizer(self.tokenizer, ids, SamplingParams()).finish(h.token_ids)
                sequences.append(BeamSearchSequence(tokens=list(ids) + h.token_ids, output_ids=h.token_ids,
                                                    logprobs=h.logprobs, cum_logprob=h.cum_logprob, score=h.score,
                                                    finish_reason=h.finish_reason, text=text))
            outputs.append(BeamSearchOutput(sequences))
        return outputs

    def _check_beam_prompts(self, token_lists: list[list[int]], max_tokens: int) -> None:
        """Raise ValueError naming the field unless every prompt's beams fit the engine to max_tokens (checked
        before the first round, so a refused search runs nothing)."""
        vocab, pool = self.engine.info.vocab_size, self.engine.pool
        limit = min(self.engine.info.max_model_len, pool.num_blocks * pool.block_size)
        for ids in token_lists:
            if not ids:
                raise ValueError("prompt must have at least one token")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token_ids must be in [0, {vocab}) (got {bad[:5]})")
            if len(ids) + max_tokens > limit:
                raise ValueError(f"max_tokens {max_tokens} after a prompt of {len(ids)} tokens passes the "
                                 f"engine's {limit} (max_model_len, KV capacity)")

    def _template(self, chat_template: str | None) -> ChatTemplate:
        """The template a chat renders with: chat_template's, else the model's (compiled once)."""
        variables = special_token_variables(self.model_dir, self.tokenizer)
        if chat_template is not None:
            return ChatTemplate.from_source(chat_template_source(chat_template), variables)
        if self._chat_template is None:
            self._chat_template = ChatTemplate.load(self.model_dir, self.tokenizer)
            if self._chat_template is None:
                raise ChatTemplateError(f"the model {self.model_dir} has no chat template; pass chat_template=")
        return self._chat_template

    def _run(self, texts: list[str | None], token_lists: list[list[int]], params,
             adapters: list[str | None] | None = None) -> list[RequestOutput]:
        """Run each prompt's n samples to completion (adapters: each prompt's LoRA adapter); one RequestOutput per
        prompt, samples in order."""
        adapters = adapters or [None] * len(token_lists)
        plist = _params_list(params, len(token_lists), self.get_default_sampling_params)
        vocab = self.engine.info.vocab_size
        for p in plist:
            p.validate(vocab, logprobs_cap(self.args.max_logprobs, vocab))
        grammars = [self._grammar(p) for p in plist]
        results = [RequestOutput(f"offline-{next(self._ids)}", ids, prompt=text)
                   for text, ids in zip(texts, token_lists)]
        samples: dict[str, tuple[CompletionOutput, IncrementalDetokenizer]] = {}
        firsts: dict[str, RequestOutput] = {}  # each prompt's first sample's id -> its result
        added = []
        try:
            for result, p, g, adapter in zip(results, plist, grammars, adapters):
                for j in range(p.n):
                    sample_params = seeded_for_choice(p, j)  # a copy: the engine may keep it
                    if j and sample_params.prompt_logprobs is not None:  # the first sample reports them for all
                        sample_params = msgspec.structs.replace(sample_params, prompt_logprobs=None)
                    rid = result.request_id if p.n == 1 else f"{result.request_id}-{j}"
                    out = CompletionOutput(index=j)
                    result.outputs.append(out)
                    detok = IncrementalDetokenizer(self.tokenizer, result.prompt_token_ids, sample_params)
                    samples[rid] = (out, detok)
                    if j == 0:
                        firsts[rid] = result
                    # Only a request with stop strings needs its tokens as they come (to detokenize them).
                    self.engine.add_request(rid, result.prompt_token_ids, msgspec.structs.replace(sample_params),
                                            stream=detok.has_stop_strings, grammar=g, lora=adapter)
                    added.append(rid)
        except Exception:
            self.abandon(added)
            raise
        open_ids = set(samples)
        while open_ids:
            for delta in self.engine.step():
                rid = delta.request_id
                if rid not in open_ids:
                    continue
                out, detok = samples[rid]
                if delta.num_cached_tokens is not None and rid in firsts:
                    firsts[rid].num_cached_tokens = delta.num_cached_tokens
                if delta.prompt_logprobs is not None and rid in firsts:
                    firsts[rid].prompt_logprobs = delta.prompt_logprobs
                out.token_ids.extend(delta.new_token_ids)
                if delta.logprobs:
                    if out.logprobs is None:
                        out.logprobs = []
                    out.logprobs.extend(delta.logprobs)
                if detok.has_stop_strings:
                    self._stop_or_finish(rid, out, detok, delta)
                elif delta.finish_reason:
                    # Nothing streams, so its text is made once, from all its ids (the same text).
                    self._finish(out, detok.finish(out.token_ids), delta)
                if out.finish_reason is not None:
                    open_ids.discard(rid)
        self.run_until_idle()
        return results

    def _grammar(self, params: SamplingParams):
        """The compiled grammar of params.structured_outputs (None without one); ValueError when it does not
        compile in time."""
        if params.structured_outputs is None:
            return None
        from metrale.frontend.grammar_compiler import GrammarCompiler, GrammarRefused, grammar_vocab

        if self._grammars is None:
            info = self.engine.info
            self._grammars = GrammarCompiler(grammar_vocab(self.tokenizer, info.vocab_size, info.eos_token_ids))
            self.engine.set_grammar_vocab(self._grammars.vocab)
        try:
            return self._grammars.compile_blocking(params.structured_outputs)
        except GrammarRefused as exc:
            raise ValueError(f"structured_outputs: {exc}") from None

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (between benchmark runs, or after changing what prompts mean); False
        while a generate() is running in another thread."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Settle what is in flight and stop the device thread."""
        self.engine.drain()
        self.device.close()
        if self._grammars is not None:
            self._grammars.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stop_or_finish(self, rid: str, out: CompletionOutput, detok: IncrementalDetokenizer, delta: RequestOutputDelta) -> None:
        """Detokenize a delta of a request with stop strings as it comes: one may end the request early."""
        text, stopped = detok.push(delta.new_token_ids)
        out.text += text
        if stopped:
            self.engine.abort(rid)  # a stop string ended it: the engine stops generating
            out.token_ids = out.token_ids[: len(detok.output_ids)]
            out.finish_reason = "stop"
        elif delta.finish_reason:
            self._finish(out, out.text + detok.flush(), delta)

    @staticmethod
    def _finish(out: CompletionOutput, text: str, delta: RequestOutputDelta) -> None:
        """Record how a request ended, with its whole text."""
        out.text = text
        out.finish_reason = delta.finish_reason
        out.error = delta.error

    def abandon(self, request_ids) -> None:
        """Abort these requests and step until they are retired (nothing of them is in flight, their blocks freed)."""
        for rid in request_ids:
            self.engine.abort(rid)
        self.run_until_idle()

    def run_until_idle(self) -> None:
        """Step until aborted requests are retired and nothing is in flight (their blocks are freed)."""
        while self.engine.has_unfinished():
            self.engine.step()

    def _prompts(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        """Each prompt's text (None when given as ids) and token ids: a str, a dict or a list of ints is one."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [list(prompts)]
        texts, token_lists = [], []
        for p in prompts:
            if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
                if "prompt_token_ids" in p:
                    p = list(p["prompt_token_ids"])
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids' (got keys {sorted(p)})")
            texts.append(p if isinstance(p, str) else None)
            token_lists.append(self.tokenizer.encode(p) if isinstance(p, str) else list(p))
        return texts, token_lists


def _spawn_group(args: EngineArgs, model_dir: str):
    """The tensor-parallel device of LLM(tensor_parallel_size=N): N worker processes on a ticket ring, started
    and owned by this process (WorkerDevice.spawn), exactly the group `metrale serve` runs; on a CPU each rank
    gets an equal share of the cores unless worker_threads says."""
    import os

    from metrale.engine_core.core import geometry_for
    from metrale.engine_core.worker_device import WorkerDevice
    from metrale.model_facts import resolve_model

    n = args.tensor_parallel_size
    env = {}
    if args.device in (None, "cpu"):
        env["OMP_NUM_THREADS"] = str(args.worker_threads or max(1, (os.cpu_count() or 1) // n))
    facts = resolve_model(model_dir, args.max_model_len)
    geometry = geometry_for(args, facts.max_model_len, args.decode_burst, facts.vocab_size, facts.hidden_size)
    return WorkerDevice.spawn(geometry, runner_kwargs=args.runner_kwargs(model_dir),
                              env=env, tensor_parallel_size=n, all_reduce=args.all_reduce)


def _params_list(params, n: int, default) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"params has {len(params)} entries for {n} prompts")
    return list(params)
