#!/usr/bin/env python
"""Client-side latency of one short chat request: time to first token and inter-token latency.

    python scripts/bench_latency.py [--url http://127.0.0.1:8000 | --model DIR] [--repeats 10]

With `--model` it starts `jaxserve serve` on a free loopback port (engine preset from
`--config`, default configs/server.toml) and stops it at the end; with `--url` it
measures a server that is already running (any OpenAI-compatible one).

One request at a time, streamed, greedy, EOS ignored so every run makes the same
number of tokens. TTFT = first content chunk - request sent; ITL = every gap between
content chunks after the first; E2E = last chunk - request sent. The first run is a
warm-up and is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def start_server(model: str, config: str) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from server_proc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--model", model, "--port", str(port),
                             "--config", config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def one_request(client: httpx.Client, url: str, body: dict) -> tuple[float, list[float], float, int]:
    t0 = time.perf_counter()
    stamps = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps, stamps[-1] - t0, len(stamps)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--config", default=str(ROOT / "configs" / "server.toml"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Give me three tips for writing clear emails.")
    args = ap.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, args.config)
    try:
        with httpx.Client(timeout=300) as client:
            name = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            body = {"model": name, "messages": [{"role": "user", "content": args.prompt}], "stream": True,
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            one_request(client, url, body)  # warm-up
            ttft, itl, e2e, chunks = [], [], [], 0
            for _ in range(args.repeats):
                t, gaps, e, n = one_request(client, url, body)
                ttft.append(t)
                itl.extend(gaps)
                e2e.append(e)
                chunks = n
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    ms = 1e3
    print(f"one streamed chat request at a time, {args.repeats} runs, {chunks} content chunks each, {url}")
    print(f"{'metric':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}  (ms)")
    for label, xs in (("TTFT", ttft), ("ITL", itl), ("E2E", e2e)):
        print(f"{label:<6} {statistics.mean(xs) * ms:9.1f} {pct(xs, 50) * ms:9.1f} {pct(xs, 90) * ms:9.1f} "
              f"{pct(xs, 99) * ms:9.1f}")
    print(f"decode rate seen by the client: {1 / statistics.mean(itl):.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
