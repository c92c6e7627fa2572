"""`jaxserve bench`: one run, or a sweep over concurrencies, against any OpenAI-compatible URL."""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time

import httpx

from jaxserve.bench import dataset, multiturn, report
from jaxserve.bench.client import run_load
from jaxserve.bench.metrics import parse_slos, summarize


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def first_model(url: str) -> str:
    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def build_prompts(args, n: int, tok) -> list[dataset.BenchPrompt]:
    chat = args.endpoint == "chat"
    if args.dataset.endswith(".jsonl"):
        prompts = dataset.from_jsonl(args.dataset, tok, args.output_len, chat=chat)
        return (prompts * (n // len(prompts) + 1))[:n]
    return dataset.synthetic(tok, n, args.input_len, args.output_len, kind=args.dataset, sigma=args.sigma,
                             seed=args.seed, chat=chat)


def run_sweep(args, progress: bool = True) -> list[dict]:
    """Every load level of `args` in turn; one result dict per level."""
    tok = dataset.load_tokenizer(args.tokenizer)
    model = args.model or first_model(args.url)
    slos = parse_slos(args.goodput)
    levels = _ints(args.max_concurrency) if args.max_concurrency else [0]
    counts = _ints(str(args.num_prompts))
    if len(counts) == 1:
        counts = counts * len(levels)
    if len(counts) != len(levels):
        raise ValueError(f"--num-prompts gives {len(counts)} counts for {len(levels)} concurrency levels")
    results = []
    for level, n in zip(levels, counts):
        if args.dataset == "multi-turn":
            results.append(run_multiturn(args, tok, model, level, n, progress))
            continue
        prompts = build_prompts(args, n + args.warmup, tok)
        warm, timed = prompts[n:], prompts[:n]  # the same timed prompts whatever the warm-up
        records, duration = asyncio.run(run_load(
            args.url, model, warm + timed, max_concurrency=level or None, request_rate=args.request_rate,
            seed=args.seed, warmup=len(warm), ignore_eos=not args.no_ignore_eos, temperature=args.temperature,
            count_tokens=lambda s: len(tok.encode(s, add_special_tokens=False).ids), progress=progress))
        r = summarize(records, duration, slos)
        r.update(max_concurrency=level or None, request_rate=args.request_rate, num_prompts=n, model=model,
                 url=args.url, dataset=args.dataset, input_len=args.input_len, output_len=args.output_len,
                 label=args.label)
        results.append(r)
        if progress:
            print(report.table([r]).splitlines()[-1], file=sys.stderr)
    return results


def run_multiturn(args, tok, model: str, level: int, n: int, progress: bool) -> dict:
    """`n` conversations at concurrency `level`, after `args.warmup` unrelated warm-up prompts."""
    count = lambda s: len(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    convs = multiturn.conversations(tok, n, args.turns, args.system_len, args.input_len, args.output_len, args.seed)
    if args.warmup:
        warm = dataset.synthetic(tok, args.warmup, 32, 4, seed=args.seed + 1, chat=True)
        asyncio.run(run_load(args.url, model, warm, max_concurrency=1, warmup=len(warm), progress=False,
                             count_tokens=count))
    records, duration = asyncio.run(multiturn.run_conversations(
        args.url, model, convs, max_concurrency=level or None, ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature, count_tokens=count))
    r = multiturn.summarize_turns(records, duration)
    r.update(max_concurrency=level or None, num_prompts=len(records), conversations=n, turns=args.turns,
             system_len=args.system_len, model=model, url=args.url, dataset=args.dataset, input_len=args.input_len,
             output_len=args.output_len, label=args.label)
    if progress:
        print(multiturn.table([r]).splitlines()[-1], file=sys.stderr)
    return r


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of any OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default="checkpoints/smollm2-135m-instruct",
                   help="directory with tokenizer.json, to build prompts of exact token lengths and count tokens")
    p.add_argument("--dataset", default="fixed",
                   help="fixed | sharegpt-like | grounded | multi-turn | PATH.jsonl; grounded: copy out an "
                        "--input-len passage, lightly edited (where prompt-lookup speculation pays); multi-turn: --num-prompts conversations "
                        "of --turns turns over one --system-len system prompt, user messages of --input-len")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--system-len", type=int, default=1000, help="multi-turn: tokens of the shared system prompt")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--num-prompts", default="64", help="requests per run; a comma list gives one per --max-concurrency")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (the median for sharegpt-like)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (the median for sharegpt-like)")
    p.add_argument("--sigma", type=float, default=0.8, help="lognormal spread of sharegpt-like lengths")
    p.add_argument("--max-concurrency", default="", help="requests in flight at most; a comma list is a sweep")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests sent first, one at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore_eos)")
    p.add_argument("--goodput", nargs="*", metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:500 tpot:100")
    p.add_argument("--label", default="", help="a name for this server in the output")
    p.add_argument("--result-json", help="write every result here")
    p.add_argument("--plot", help="write a throughput-latency PNG here (most useful for a sweep)")
    p.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    t0 = time.time()
    try:
        results = run_sweep(args, progress=not args.no_progress)
    except (ValueError, FileNotFoundError, httpx.HTTPError) as e:
        print(f"jaxserve bench: error: {e}", file=sys.stderr)
        return 1
    print(multiturn.table(results) if args.dataset == "multi-turn" else report.table(results))
    if args.result_json:
        report.save_json(args.result_json, {"started": t0, "machine": platform.machine(), "results": results})
    if args.plot:
        report.plot({args.label or args.url: results}, args.plot)
    return 0
