#!/usr/bin/env python
"""Scheduling under load, on a real `jaxserve serve` process: priorities and chunked prefill.

    python scripts/bench_scheduling.py [--model DIR] [--scenario priority|prefill|both]

priority  An engine of 8 slots is saturated by 24 concurrent batch-priority streams (8
          running, 16 waiting, each replaced as soon as it ends). Interactive requests
          (priority "interactive") are sent one after another and their time to first token
          is compared with the same requests' TTFT on the idle server. An interactive request
          takes a slot from the latest batch sequence (preemption), so its TTFT should stay
          within a small factor of idle: the issue's bar is p99 <= 3 x idle. Prefill steps
          are capped at `--priority-budget` tokens (chunked prefill): a new request waits for
          the step in progress, and without a cap a step of 4 batch prompts runs for seconds.
prefill   8 streams decode while a 2,000-token prompt arrives. The largest gap between two
          tokens of any stream while that prompt is prefilled is compared with the time the
          same prompt takes to prefill alone (its TTFT on the idle server). Run once with
          `prefill_token_budget` (chunks of that many tokens alternate with decode steps) and
          once without (chunks of the largest prefill bucket, 512 here).

Every time is client-side: perf_counter at the HTTP client, streamed SSE chunks. Numbers go
to stdout as Markdown, for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bench_latency import pct  # noqa: E402  (scripts/ is on sys.path: it holds this script)
from server_proc import ServerProcess  # noqa: E402

from jaxserve.bench.client import send  # noqa: E402
from jaxserve.bench.dataset import load_tokenizer, synthetic  # noqa: E402

PRIORITY_CONFIG = """
[server.admission]
max_waiting = 64
[engine]
max_num_seqs = 8
decode_batch_buckets = [1, 2, 4, 8]
context_buckets = [256, 1024]
max_model_len = 1024
prefill_batch_buckets = [1, 4]
prefill_length_buckets = [32, 64, 128, 256]
prefill_token_budget = {budget}
preemption_mode = "{mode}"
swap_space_gib = 1.0
compilation_cache_dir = "{cache}"
"""

PREFILL_CONFIG = """
[engine]
max_num_seqs = 16
decode_batch_buckets = [1, 8, 16]
context_buckets = [256, 1024, 2560]
max_model_len = 2560
prefill_batch_buckets = [1, 4]
prefill_length_buckets = [64, 256, 512]
{budget}
compilation_cache_dir = "{cache}"
"""


def _ok(rec, what: str):
    if not rec.ok:
        raise SystemExit(f"{what} failed: {rec.error}")
    return rec


async def _engine(client: httpx.AsyncClient, url: str) -> dict:
    models = (await client.get(f"{url}/stats")).json()["models"]
    return next(iter(models.values()))


# priority ------------------------------------------------------------------------------


async def priority_run(url: str, tok, n_interactive: int, n_batch: int) -> dict:
    interactive = synthetic(tok, n_interactive + 1, 64, 16, seed=1, chat=True)
    batch = synthetic(tok, 64, 256, 256, seed=2, chat=True)
    limits = httpx.Limits(max_connections=n_batch + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        name = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        hi = {"priority": "interactive"}
        _ok(await send(client, url, interactive[0], name, extra=hi), "warm-up")
        _ok(await send(client, url, batch[0], name, extra={"priority": "batch"}), "warm-up")
        idle = [_ok(await send(client, url, p, name, extra=hi), "idle request").ttft for p in interactive[1:]]

        stop = asyncio.Event()
        batch_done = []

        async def batch_worker(i: int):
            k = i
            while not stop.is_set():
                rec = await send(client, url, batch[k % len(batch)], name, extra={"priority": "batch"})
                batch_done.append(rec)
                k += n_batch

        workers = [asyncio.create_task(batch_worker(i)) for i in range(n_batch)]
        while True:  # saturated: every slot taken and a queue behind them
            eng = await _engine(client, url)
            if eng["running"] == 8 and eng["waiting"] >= n_batch - 8 - 2:
                break
            await asyncio.sleep(0.1)
        loaded, seen = [], []
        for p in interactive[1:]:
            rec = _ok(await send(client, url, p, name, extra=hi), "interactive request under load")
            loaded.append(rec.ttft)
            seen.append(await _engine(client, url))
        before = await _engine(client, url)
        stop.set()
        await asyncio.gather(*workers)
        failed = [r.error for r in batch_done if not r.ok]
        if failed:
            raise SystemExit(f"{len(failed)} batch requests failed, e.g. {failed[0]}")
    return {"idle": idle, "loaded": loaded, "waiting_seen": [s["waiting"] for s in seen],
            "preemptions": before["preemptions"], "batch_completed": len(batch_done)}


def priority_markdown(runs: dict[str, dict], cmd: str) -> str:
    rows = ["| preemption mode | idle TTFT p50 / p99 (ms) | TTFT under batch load p50 / p99 (ms) | "
            "p99 / idle p99 | p99 / idle p50 | waiting batch requests while measured | preemptions (recompute, swap) |",
            "|---|---|---|---|---|---|---|"]
    for mode, r in runs.items():
        idle50 = pct(r["idle"], 50)
        rows.append(f"| {mode} | {idle50 * 1e3:.0f} / {pct(r['idle'], 99) * 1e3:.0f} | "
                    f"{pct(r['loaded'], 50) * 1e3:.0f} / {pct(r['loaded'], 99) * 1e3:.0f} | "
                    f"{pct(r['loaded'], 99) / pct(r['idle'], 99):.2f} | "
                    f"{pct(r['loaded'], 99) / idle50:.2f} | {min(r['waiting_seen'])}-{max(r['waiting_seen'])} | "
                    f"{r['preemptions']['recompute']}, {r['preemptions']['swap']} |")
    return "\n".join([f"`{cmd}`", "", *rows])


# prefill -------------------------------------------------------------------------------


async def prefill_run(url: str, tok, n_streams: int, long_len: int, repeats: int) -> dict:
    longs = synthetic(tok, repeats + 2, long_len, 2, seed=3)
    shorts = synthetic(tok, n_streams, 64, 400, seed=4, chat=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30),
                                 limits=httpx.Limits(max_connections=n_streams + 4)) as client:
        name = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        _ok(await send(client, url, longs[0], name), "warm-up")
        alone = [_ok(await send(client, url, longs[1], name), "long prompt alone").ttft for _ in range(2)]
        # A stream's decode rate with no long prompt around, and then with one arriving.
        quiet = [_ok(r, "stream") for r in await asyncio.gather(*(send(client, url, p, name) for p in shorts))]
        worst, during = [], []
        for long in longs[2:]:
            streams = [asyncio.create_task(send(client, url, p, name)) for p in shorts]
            while True:  # every stream is decoding
                eng = await _engine(client, url)
                if eng["running"] == n_streams and eng["waiting"] == 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            rec = _ok(await send(client, url, long, name), "long prompt while streams run")
            t_sent, t_first = rec.start, rec.chunk_times[0]
            done = [_ok(r, "stream") for r in await asyncio.gather(*streams)]
            gaps = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])
                    if b > t_sent and a < t_first]  # gaps that overlap the long prefill
            worst.append(max(gaps))
            during.append(rec.ttft)
    itl = [g for r in quiet for g in r.itls]
    return {"alone": min(alone), "worst_gap": max(worst), "ttft_during": statistics.median(during),
            "itl_p50": pct(itl, 50), "itl_max_quiet": max(itl)}


def prefill_markdown(runs: dict[str, dict], long_len: int, n_streams: int, cmd: str) -> str:
    rows = [f"| prefill | {long_len}-token prefill alone (ms) | largest gap of {n_streams} streams during it (ms) | "
            "gap / prefill alone | its TTFT with the streams (ms) | stream ITL p50 / max, no long prompt (ms) |",
            "|---|---|---|---|---|---|"]
    for label, r in runs.items():
        rows.append(f"| {label} | {r['alone'] * 1e3:.0f} | {r['worst_gap'] * 1e3:.0f} | "
                    f"{r['worst_gap'] / r['alone']:.2f} | {r['ttft_during'] * 1e3:.0f} | "
                    f"{r['itl_p50'] * 1e3:.0f} / {r['itl_max_quiet'] * 1e3:.0f} |")
    return "\n".join([f"`{cmd}`", "", *rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--scenario", choices=("priority", "prefill", "both"), default="both")
    ap.add_argument("--modes", default="recompute,swap", help="preemption modes for the priority scenario")
    ap.add_argument("--interactive", type=int, default=20, help="interactive requests, idle and under load")
    ap.add_argument("--batch-concurrency", type=int, default=24)
    ap.add_argument("--priority-budget", type=int, default=128, help="prefill_token_budget, priority scenario")
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--budget", type=int, default=256, help="prefill_token_budget of the chunked run")
    ap.add_argument("--repeats", type=int, default=3, help="long prompts sent while streams run, per config")
    args = ap.parse_args(argv)
    cmd = " ".join(["python scripts/bench_scheduling.py", *(argv if argv is not None else sys.argv[1:])])
    tok = load_tokenizer(args.model)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "xla"

        def serve(name: str, config: str) -> ServerProcess:
            work = tmp / name
            work.mkdir()
            return ServerProcess(Path(args.model), work, config, startup_timeout=1800)

        if args.scenario in ("priority", "both"):
            runs = {}
            for mode in args.modes.split(","):
                config = PRIORITY_CONFIG.format(mode=mode, budget=args.priority_budget, cache=cache)
                srv = serve(f"priority-{mode}", config)
                try:
                    runs[mode] = asyncio.run(priority_run(srv.url, tok, args.interactive, args.batch_concurrency))
                finally:
                    srv.stop()
                print(f"priority/{mode}: {runs[mode]}", file=sys.stderr)
            out.append(priority_markdown(runs, cmd))
        if args.scenario in ("prefill", "both"):
            runs = {}
            for label, budget in ((f"chunked, prefill_token_budget = {args.budget}", args.budget),
                                  ("no budget (chunks of 512)", None)):
                setting = "" if budget is None else f"prefill_token_budget = {budget}"
                srv = serve(f"prefill-{budget}", PREFILL_CONFIG.format(budget=setting, cache=cache))
                try:
                    runs[label] = asyncio.run(prefill_run(srv.url, tok, args.streams, args.long_len, args.repeats))
                finally:
                    srv.stop()
                print(f"prefill/{label}: {runs[label]}", file=sys.stderr)
            out.append(prefill_markdown(runs, args.long_len, args.streams, cmd))
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
