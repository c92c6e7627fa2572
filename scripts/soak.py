"""Soak: N minutes of mixed traffic against a real server, watching for growth and drift.

    python scripts/soak.py --minutes 30                      # starts `jaxserve serve` on the default model
    python scripts/soak.py --url http://HOST:PORT --pid PID  # an existing server (the pid for RSS, fds)

Traffic (a fixed seeded mix, `--concurrency` closed-loop workers): chat and completions, whole
and streamed, n = 2, priority classes, requests that hit their deadline, clients that abort
mid-stream, and bad requests. Every `--sample-s` seconds it samples the server's RSS, open
file descriptors, threads, and the engine's pages in use; at the end it prints, per
`--window-min` window, the request count and latency percentiles (whole requests answered
200), the growth per hour of each sample after the warm-up (a least-squares slope), and the
verdicts the reliability issue asks for. Not part of CI: it takes as long as you ask.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
TOPICS = ["the moon", "bread", "rivers", "a small town", "chess", "autumn", "trains", "honey bees", "glaciers",
          "lighthouses", "the printing press", "volcanoes", "owls", "tea", "bridges", "the ocean floor"]


@dataclasses.dataclass
class Result:
    at: float  # seconds since the start, when the request ended
    kind: str
    status: int  # HTTP status; 0 for a client-side abort, -1 for a transport error
    latency: float
    ttft: float | None = None


@dataclasses.dataclass
class Sample:
    at: float
    rss_mib: float
    fds: int
    threads: int
    pages_used: int
    running: int
    waiting: int


def _messages(rng: random.Random) -> list[dict]:
    topic = rng.choice(TOPICS)
    msgs = [{"role": "user", "content": f"Write two sentences about {topic}."}]
    if rng.random() < 0.3:  # a multi-turn chat resends the earlier turns
        msgs = [{"role": "system", "content": "You are a concise assistant."}, *msgs,
                {"role": "assistant", "content": f"{topic.capitalize()} is a fine subject."},
                {"role": "user", "content": "Say one more thing about it."}]
    return msgs


BAD_BODIES = [
    {"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]}, {"messages": "hi"},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 9},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 100},
]


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, t0: float) -> Result:
    """One request of a kind drawn from the mix."""
    r = rng.random()
    max_tokens = rng.choice([16, 32, 48, 64])
    body: dict = {"messages": _messages(rng), "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.7])}
    path, kind, stream, abort_after = "/v1/chat/completions", "chat", False, None
    if r < 0.30:
        pass
    elif r < 0.55:
        kind, stream = "chat-stream", True
    elif r < 0.65:
        path, kind = "/v1/completions", "completion"
        body = {"prompt": f"A short note on {rng.choice(TOPICS)}:", "max_tokens": max_tokens,
                "stream": rng.random() < 0.5}
        stream = body["stream"]
    elif r < 0.72:
        kind, body["n"] = "chat-n2", 2
    elif r < 0.80:
        kind, body["priority"] = "batch-priority", "batch"
    elif r < 0.85:
        kind, body["timeout"], stream = "deadline", 0.2, True  # ends with finish_reason timeout
        body["max_tokens"] = 64
    elif r < 0.95:
        kind, stream, abort_after = "abort", True, rng.randint(0, 6)  # the client leaves mid-stream
    else:
        kind, body = "bad", rng.choice(BAD_BODIES)
    if stream:
        body["stream"] = True
    start = time.monotonic()
    ttft = None
    try:
        if not stream:
            resp = await client.post(url + path, json=body)
            return Result(time.monotonic() - t0, kind, resp.status_code, time.monotonic() - start)
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Result(time.monotonic() - t0, kind, resp.status_code, time.monotonic() - start)
            events = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if '"error"' in line[:20]:
                    return Result(time.monotonic() - t0, kind, 500, time.monotonic() - start)
                events += 1
                if ttft is None and '"content": ""' not in line:
                    ttft = time.monotonic() - start
                if abort_after is not None and events > abort_after:
                    return Result(time.monotonic() - t0, kind, 0, time.monotonic() - start, ttft)
            return Result(time.monotonic() - t0, kind, 200, time.monotonic() - start, ttft)
    except httpx.HTTPError:
        return Result(time.monotonic() - t0, kind, -1, time.monotonic() - start, ttft)


def proc_stats(pid: int) -> tuple[float, int, int]:
    """(RSS in MiB, open fds, threads) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])


async def sampler(client: httpx.AsyncClient, url: str, pid: int, t0: float, every: float, stop: asyncio.Event,
                  samples: list[Sample]) -> None:
    while not stop.is_set():
        stats = next(iter((await client.get(url + "/stats")).json()["models"].values()))
        rss, fds, threads = proc_stats(pid)
        samples.append(Sample(time.monotonic() - t0, rss, fds, threads, stats["pages_used"], stats["running"],
                              stats["waiting"]))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def soak(url: str, pid: int, minutes: float, concurrency: int, sample_s: float, seed: int
               ) -> tuple[list[Result], list[Sample], Sample]:
    t0 = time.monotonic()
    end = t0 + minutes * 60
    results: list[Result] = []
    samples: list[Sample] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                results.append(await one_request(client, url, rng, t0))

        sampling = asyncio.create_task(sampler(client, url, pid, t0, sample_s, stop, samples))
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        stop.set()
        await sampling
        # The aborted streams' sequences end at the engine's next step; let it settle.
        deadline = time.monotonic() + 30
        while True:
            stats = next(iter((await client.get(url + "/stats")).json()["models"].values()))
            if stats["running"] == stats["waiting"] == 0 and stats["pages_used"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        rss, fds, threads = proc_stats(pid)
        final = Sample(time.monotonic() - t0, rss, fds, threads, stats["pages_used"], stats["running"],
                       stats["waiting"])
    return results, samples, final


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 3600 if den else float("nan")


def report(results: list[Result], samples: list[Sample], final: Sample, window_min: float, warmup_min: float) -> dict:
    win = window_min * 60
    n_windows = max(1, int(max(r.at for r in results) // win) + 1)
    print("| window (min) | requests | 200 | 4xx | 5xx | client aborts | p50 latency (s) | p99 latency (s) "
          "| p99 TTFT of streams (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    windows = []
    for w in range(n_windows):
        rs = [r for r in results if w * win <= r.at < (w + 1) * win]
        whole = [r.latency for r in rs if r.status == 200 and r.kind in ("chat", "chat-n2", "batch-priority")]
        ttfts = [r.ttft for r in rs if r.status == 200 and r.ttft is not None]
        row = {"window": w, "requests": len(rs), "ok": sum(r.status == 200 for r in rs),
               "4xx": sum(400 <= r.status < 500 for r in rs), "5xx": sum(r.status >= 500 for r in rs),
               "aborts": sum(r.status == 0 for r in rs), "transport_errors": sum(r.status == -1 for r in rs),
               "p50": pct(whole, 0.5), "p99": pct(whole, 0.99), "ttft_p99": pct(ttfts, 0.99)}
        windows.append(row)
        print(f"| {w * window_min:g}-{(w + 1) * window_min:g} | {row['requests']} | {row['ok']} | {row['4xx']} "
              f"| {row['5xx']} | {row['aborts']} | {row['p50']:.2f} | {row['p99']:.2f} | {row['ttft_p99']:.2f} |")
    after = [s for s in samples if s.at >= warmup_min * 60] or samples
    growth = {k: slope_per_hour([(s.at, getattr(s, k)) for s in after]) for k in ("rss_mib", "fds", "threads")}
    rss_growth = max(s.rss_mib for s in after) - after[0].rss_mib
    full = windows  # the last window is a tail of a few seconds: leave it out of the comparison
    if len(windows) > 1 and windows[-1]["requests"] < windows[0]["requests"] / 2:
        full = windows[:-1]
    p99_ratio = max(w["p99"] for w in full) / windows[0]["p99"] if windows[0]["p99"] > 0 else float("nan")
    print(f"\nsamples after the first {warmup_min:g} min: RSS {after[0].rss_mib:.0f} -> {after[-1].rss_mib:.0f} MiB "
          f"(max {max(s.rss_mib for s in after):.0f}), growth {growth['rss_mib']:+.1f} MiB/h; open fds "
          f"{after[0].fds} -> {after[-1].fds} ({growth['fds']:+.1f}/h); threads {after[0].threads} -> "
          f"{after[-1].threads} ({growth['threads']:+.1f}/h); pages in use max {max(s.pages_used for s in samples)}")
    print(f"at the end: pages in use {final.pages_used}, running {final.running}, waiting {final.waiting}, "
          f"RSS {final.rss_mib:.0f} MiB, fds {final.fds}, threads {final.threads}")
    verdict = {"no_5xx": sum(w["5xx"] for w in windows) == 0 and sum(w["transport_errors"] for w in windows) == 0,
               "rss_growth_after_warmup_mib": round(rss_growth, 1), "rss_growth_under_50_mib": rss_growth < 50,
               "pages_back_to_0": final.pages_used == 0 and final.running == 0 and final.waiting == 0,
               "worst_p99_over_first": round(p99_ratio, 2), "p99_within_1_5x": p99_ratio <= 1.5}
    print("verdicts:", json.dumps(verdict))
    return {"windows": windows, "growth_per_hour": growth, "final": dataclasses.asdict(final), "verdict": verdict,
            "samples": [dataclasses.asdict(s) for s in samples]}


def start_server(model: str, config: str, port: int, log: Path) -> subprocess.Popen:
    from bench_compare import stop, wait_healthy

    cmd = [sys.executable, "-m", "jaxserve", "serve", "--model", model, "--config", config, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
    except Exception:
        stop(proc)
        raise
    return proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an existing server (needs --pid); default: start one")
    p.add_argument("--pid", type=int, help="the existing server's process id")
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    p.add_argument("--config", default=str(ROOT / "configs" / "server.toml"))
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--sample-s", type=float, default=5)
    p.add_argument("--window-min", type=float, default=5)
    p.add_argument("--warmup-min", type=float, default=5, help="growth is measured after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write every result and sample here as JSON")
    args = p.parse_args()
    proc = None
    if args.url:
        if args.pid is None:
            p.error("--url needs --pid (RSS, fds and threads are read from /proc/PID)")
        url, pid = args.url.rstrip("/"), args.pid
    else:
        log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
        print(f"starting the server (log: {log})", file=sys.stderr)
        proc = start_server(args.model, args.config, args.port, log)
        url, pid = f"http://127.0.0.1:{args.port}", proc.pid
    try:
        print(f"soaking {url} for {args.minutes:g} min with {args.concurrency} clients", file=sys.stderr)
        results, samples, final = asyncio.run(soak(url, pid, args.minutes, args.concurrency, args.sample_s,
                                                   args.seed))
        out = report(results, samples, final, args.window_min, args.warmup_min)
        if args.out:
            out["results"] = [dataclasses.asdict(r) for r in results]
            Path(args.out).write_text(json.dumps(out))
    finally:
        if proc is not None:
            proc.terminate()
            print(f"server exited with {proc.wait(timeout=60)} after SIGTERM", file=sys.stderr)
    return 0 if all(v for k, v in out["verdict"].items() if isinstance(v, bool)) else 1


if __name__ == "__main__":
    sys.exit(main())
