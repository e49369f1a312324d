"""The `metrale bench` commands (click); the work is in serve.py and throughput.py, imported when run."""

from __future__ import annotations

import json
import re

import click

_SLO = re.compile(r"^(ttft|tpot|e2el):")


def _pairs(items: tuple[str, ...], sep: str, flag: str) -> dict[str, str]:
    """KEY<sep>VALUE strings as a dict; a UsageError naming the flag for one without sep."""
    out = {}
    for item in items:
        key, found, value = item.partition(sep)
        if not found:
            raise click.UsageError(f"{flag} {item!r}: use KEY{sep}VALUE")
        out[key.strip()] = value.strip()
    return out


@click.group()
def bench() -> None:
    """Benchmarks: a serving one against any OpenAI-compatible server, an offline throughput one."""


@bench.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: from --host and --port).")
@click.option("--host", default="127.0.0.1", show_default=True, help="server host, when no --base-url.")
@click.option("--port", default=8000, show_default=True, help="server HTTP port, when no --base-url.")
@click.option("--endpoint", default="/v1/completions", show_default=True, help="/v1/completions or /v1/chat/completions.")
@click.option("--backend", default=None, type=click.Choice(["openai", "openai-chat", "vllm"]),
              help="recorded in the result as vLLM's bench records it (default: openai, or openai-chat for the chat endpoint).")
@click.option("--model", default=None, help="model name sent to the server, and the tokenizer's folder unless --tokenizer "
                                             "(default: the first model the server lists).")
@click.option("--served-model-name", default=None, help="model name to send, when it differs from --model.")
@click.option("--tokenizer", default=None, help="model folder or GGUF file whose tokenizer makes and counts prompts.")
@click.option("--dataset-name", default="random", type=click.Choice(["random", "sharegpt"]), show_default=True,
              help="random token prompts of drawn lengths, or a ShareGPT JSON file (--dataset-path).")
@click.option("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt).")
@click.option("--num-prompts", default=1000, show_default=True, help="requests to send.")
@click.option("--seed", default=0, show_default=True, help="seed of the dataset sampling and the arrival times.")
@click.option("--input-len", default=None, type=int, help="sets --random-input-len.")
@click.option("--output-len", default=None, type=int, help="sets --random-output-len and --sharegpt-output-len.")
@click.option("--random-input-len", default=1024, show_default=True, help="prompt tokens per random request.")
@click.option("--random-output-len", default=128, show_default=True, help="output tokens per random request.")
@click.option("--random-range-ratio", default=0.0, show_default=True,
              help="lengths drawn uniformly from [len·(1−r), len·(1+r)], 0 <= r < 1.")
@click.option("--random-prefix-len", default=0, show_default=True, help="random tokens shared by every prompt, before its own.")
@click.option("--sharegpt-output-len", default=None, type=int, help="output tokens per ShareGPT request (default: its reply's).")
@click.option("--disable-shuffle", is_flag=True, help="take ShareGPT conversations in file order.")
@click.option("--request-rate", default=float("inf"), show_default=True,
              help="requests per second (Poisson arrivals, or gamma with --burstiness); inf: all at once.")
@click.option("--burstiness", default=1.0, show_default=True, help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 more even.")
@click.option("--max-concurrency", default=None, type=int, help="requests in flight at most (the others wait in the client).")
@click.option("--ignore-eos", is_flag=True, help="ask for exactly the output length (always on for random prompts, as in vLLM).")
@click.option("--temperature", default=None, type=float, help="sampling temperature (default: the server's).")
@click.option("--top-p", default=None, type=float, help="top-p (default: the server's).")
@click.option("--top-k", default=None, type=int, help="top-k (default: the server's).")
@click.option("--extra-body", default=None, help="JSON object merged into every request's body.")
@click.option("--header", multiple=True, help="KEY=VALUE header on every request (repeatable).")
@click.option("--num-warmups", default=0, show_default=True, help="requests sent (one at a time) before the timed run.")
@click.option("--disable-tqdm", is_flag=True, help="no progress bar.")
@click.option("--percentile-metrics", default="ttft,tpot,itl,e2el", show_default=True,
              help="metrics whose percentiles are reported: ttft, tpot, itl, e2el (vLLM's default: ttft,tpot,itl).")
@click.option("--metric-percentiles", default="99", show_default=True, help="comma-separated percentiles, e.g. 50,90,99.")
@click.option("--goodput", multiple=True, help="SLOs as NAME:MS, NAME in ttft, tpot, e2el (several may follow one --goodput).")
@click.option("--label", default=None, help="prefix of the result file's name (default: the backend).")
@click.option("--metadata", multiple=True, help="KEY=VALUE recorded in the result JSON (repeatable).")
@click.option("--save-result", is_flag=True, help="write the result JSON (vLLM's keys).")
@click.option("--save-detailed", is_flag=True, help="with --save-result, also per-request lists (texts, errors, timings).")
@click.option("--result-dir", default=None, help="folder for the result JSON (default: here).")
@click.option("--result-filename", default=None, help="the result JSON's name (default: vLLM's pattern).")
@click.pass_context
def serve_bench(ctx: click.Context, **o) -> None:
    """Benchmark a running OpenAI-compatible server (metrale's, vLLM's, SGLang's) with streamed requests."""
    from metrale.bench.serve import ServeBenchArgs, run

    goodput = list(o["goodput"])
    for extra in ctx.args:  # vLLM's `--goodput ttft:MS tpot:MS` spelling: the later pairs arrive as extra arguments
        if not (goodput and _SLO.match(extra)):
            raise click.UsageError(f"unexpected argument {extra!r}")
        goodput.append(extra)
    extra_body = json.loads(o["extra_body"]) if o["extra_body"] else {}
    for key in ("temperature", "top_p", "top_k"):
        if o[key] is not None:
            extra_body.setdefault(key, o[key])
    args = ServeBenchArgs(
        base_url=o["base_url"], host=o["host"], port=o["port"], endpoint=o["endpoint"], backend=o["backend"],
        model=o["model"], served_model_name=o["served_model_name"], tokenizer=o["tokenizer"],
        dataset_name=o["dataset_name"], dataset_path=o["dataset_path"], num_prompts=o["num_prompts"], seed=o["seed"],
        random_input_len=o["input_len"] if o["input_len"] is not None else o["random_input_len"],
        random_output_len=o["output_len"] if o["output_len"] is not None else o["random_output_len"],
        random_range_ratio=o["random_range_ratio"], random_prefix_len=o["random_prefix_len"],
        sharegpt_output_len=o["output_len"] if o["output_len"] is not None else o["sharegpt_output_len"],
        disable_shuffle=o["disable_shuffle"], request_rate=o["request_rate"], burstiness=o["burstiness"],
        max_concurrency=o["max_concurrency"], ignore_eos=o["ignore_eos"], num_warmups=o["num_warmups"],
        disable_tqdm=o["disable_tqdm"], percentile_metrics=o["percentile_metrics"],
        metric_percentiles=o["metric_percentiles"], goodput=goodput, extra_body=extra_body,
        headers=_pairs(o["header"], "=", "--header"), label=o["label"], metadata=_pairs(o["metadata"], "=", "--metadata"),
        save_result=o["save_result"], save_detailed=o["save_detailed"], result_dir=o["result_dir"],
        result_filename=o["result_filename"],
    )
    try:
        run(args, echo=click.echo)
    except ValueError as e:
        raise click.UsageError(str(e))


@bench.command("throughput")
@click.option("--model", default=None, help="model folder or GGUF file (default: the built-in tiny demo model).")
@click.option("--dataset-name", default="random", type=click.Choice(["random", "sharegpt"]), show_default=True,
              help="random token prompts of drawn lengths, or a ShareGPT JSON file (--dataset-path).")
@click.option("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt).")
@click.option("--input-len", default=1024, show_default=True, help="prompt tokens per random request.")
@click.option("--output-len", default=None, type=int, help="output tokens per request (random default 128; ShareGPT: its reply's).")
@click.option("--num-prompts", default=1000, show_default=True,
              help="prompts to run.")
@click.option("--range-ratio", default=0.0, show_default=True, help="random lengths drawn from [len·(1−r), len·(1+r)].")
@click.option("--prefix-len", default=0, show_default=True, help="random tokens shared by every prompt.")
@click.option("--seed", default=0, show_default=True,
              help="seed of the dataset sampling.")
@click.option("--temperature", default=1.0, show_default=True, help="sampling temperature (vLLM's bench samples at 1).")
@click.option("--num-warmups", default=0, show_default=True, help="single requests run before the timed one.")
@click.option("--output-json", default=None, help="write the figures as JSON (vLLM's keys) to this file.")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), show_default=True,
              help="the model's dtype in the offline LLM.")
@click.option("--max-num-seqs", default=64, show_default=True,
              help="requests the engine runs at once.")
@click.option("--max-num-batched-tokens", default=2048, show_default=True,
              help="tokens one engine step may take (prefill chunks).")
@click.option("--max-model-len", default=None, type=int, help="cap on prompt + output tokens.")
@click.option("--num-kv-blocks", default=None, type=int, help="KV blocks (default: from memory).")
def throughput_bench(**o) -> None:
    """Time the offline metrale.LLM on a dataset's prompts, all submitted at once."""
    from metrale.bench.throughput import ThroughputArgs, run

    engine = {k: o[k] for k in ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks")}
    args = ThroughputArgs(model=o["model"], dataset_name=o["dataset_name"], dataset_path=o["dataset_path"],
                          input_len=o["input_len"], output_len=o["output_len"], num_prompts=o["num_prompts"],
                          range_ratio=o["range_ratio"], prefix_len=o["prefix_len"], seed=o["seed"],
                          temperature=o["temperature"], num_warmups=o["num_warmups"], output_json=o["output_json"],
                          engine={k: v for k, v in engine.items() if v is not None})
    try:
        run(args, echo=click.echo)
    except ValueError as e:
        raise click.UsageError(str(e))
