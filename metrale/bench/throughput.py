"""`metrale bench throughput`: the offline `metrale.LLM` on a dataset's prompts, all at once — requests/s and
tokens/s as vLLM's `bench throughput` reports them (tokens counted from the outputs: prompt + generated)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from metrale.ipc.sampling import SamplingParams

from . import datasets


@dataclass(slots=True)
class ThroughputArgs:
    """What `metrale bench throughput` is told."""

    model: str | None = None
    dataset_name: str = "random"
    dataset_path: str | None = None
    input_len: int = 1024
    output_len: int | None = None  # random: default 128; sharegpt: None = each conversation's own
    num_prompts: int = 1000
    range_ratio: float = 0.0
    prefix_len: int = 0
    seed: int = 0
    temperature: float = 1.0
    num_warmups: int = 0
    output_json: str | None = None
    engine: dict = field(default_factory=dict)  # EngineArgs fields for LLM(...)


@dataclass(slots=True)
class ThroughputResult:
    """The figures of one offline run."""

    elapsed_time: float
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.total_prompt_tokens + self.total_output_tokens

    def as_json(self, model_id: str) -> dict:
        """vLLM's `--output-json` keys, plus the output-only figures."""
        return {"model_id": model_id, "elapsed_time": self.elapsed_time, "num_requests": self.num_requests,
                "total_num_tokens": self.total_num_tokens,
                "requests_per_second": self.num_requests / self.elapsed_time,
                "tokens_per_second": self.total_num_tokens / self.elapsed_time,
                "total_output_tokens": self.total_output_tokens,
                "output_tokens_per_second": self.total_output_tokens / self.elapsed_time}

    def line(self) -> str:
        """The printed summary (vLLM's wording)."""
        t = self.elapsed_time
        return (f"Throughput: {self.num_requests / t:.2f} requests/s, {self.total_num_tokens / t:.2f} total tokens/s, "
                f"{self.total_output_tokens / t:.2f} output tokens/s\n"
                f"Total num prompt tokens:  {self.total_prompt_tokens}\nTotal num output tokens:  {self.total_output_tokens}")


def run(args: ThroughputArgs, echo=print) -> ThroughputResult:
    """Load the model, make the requests, generate them all in one call and time it."""
    from metrale.llm import LLM

    with LLM(args.model, **args.engine) as llm:
        requests = sample(args, llm.tokenizer)
        params = [SamplingParams(max_tokens=r.expected_output_len, temperature=args.temperature, ignore_eos=True,
                                 seed=args.seed + i) for i, r in enumerate(requests)]
        prompts = [r.prompt for r in requests]
        for _ in range(args.num_warmups):
            llm.generate(prompts[:1], params[:1])
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        model_id = llm.model_dir
    failed = [o.error for o in outputs if getattr(o, "error", None)]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed; the first: {failed[0]}")
    res = ThroughputResult(elapsed, len(outputs), sum(len(o.prompt_token_ids) for o in outputs),
                           sum(_generated(o) for o in outputs))
    echo(res.line())
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res.as_json(model_id), f, indent=4)
    return res


def sample(args: ThroughputArgs, tokenizer) -> list[datasets.SampleRequest]:
    """The run's requests: random ones of --input-len/--output-len, or a ShareGPT file's."""
    if args.dataset_name == "random":
        return datasets.random_requests(tokenizer, args.num_prompts, args.input_len,
                                        args.output_len if args.output_len is not None else 128,
                                        args.range_ratio, args.prefix_len, args.seed)
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
        return datasets.sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.output_len, args.seed)
    raise ValueError(f"--dataset-name {args.dataset_name}: use random or sharegpt")


def _generated(out) -> int:
    """Tokens generated for one prompt, whether the output carries them itself or in vLLM-style .outputs."""
    if hasattr(out, "outputs"):
        return sum(len(c.token_ids) for c in out.outputs)
    return len(out.token_ids)
