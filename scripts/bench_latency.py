#!/usr/bin/env python
"""Client-side latency of one request at a time: time to first token, inter-token latency, TPOT.

    python scripts/bench_latency.py [--url http://127.0.0.1:8000 | --model DIR] [--repeats 10]
    python scripts/bench_latency.py --input-len 256 --max-tokens 128 --engine-step

`--input-len N` sends /v1/completions prompts of N tokens cut from the benchmark corpus
(jaxserve/bench/dataset.py) instead of the short chat prompt. `--engine-step` then also
loads the same model with the same [engine] config in this process (after the server has
stopped) and times the engine's own batch-1 decode: one sequence at the same context
lengths, one decode call after another (launch + wait for the sampled ids), with no HTTP,
no event loop and no postprocessing, in single-step calls and in calls of the config's
`decode_steps`. It prints TPOT p50 against the per-token time of the calls the server
makes (decode_steps): the host overhead a streaming client pays per token.

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


def start_server(model: str, config: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from server_proc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--model", model, "--port", str(port),
                             "--config", config, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    route = "chat/completions" if "messages" in body else "completions"
    with client.stream("POST", f"{url}/v1/{route}", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if any(c.get("delta", {}).get("content") or c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, gaps, stamps[-1] - t0, len(stamps)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def engine_step_ms(model: str, config: str, input_len: int, output_len: int) -> dict[int, float]:
    """{k: p50 ms per token} of the engine's own batch-1 decode calls of k steps (k = 1 and the
    config's decode_steps) over contexts input_len .. input_len + output_len, same model and
    [engine] config as the server: launch + wait for the sampled ids, nothing else."""
    from jaxserve.config import load_config_file
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.runner import ScheduledItem
    from jaxserve.engine.sequence import SamplingParams

    _, cfg = load_config_file(config)
    eng = Engine(model, cfg)
    per_token = {}
    for k in sorted({1, cfg.decode_steps}):
        seq = eng.add_request(list(range(1000, 1000 + input_len)),
                              SamplingParams(max_tokens=output_len, ignore_eos=True))
        while seq.num_uncomputed > 1 or not seq.output_ids:  # the prompt, through the engine
            eng.step()
        times = []
        while len(seq.output_ids) + k <= output_len and eng.pool.grow(seq.pages, seq.num_tokens + k - 1):
            t0 = time.perf_counter()
            result = eng.runner.run([ScheduledItem(seq, seq.num_tokens - 1, 1)], decode=True, k=k)
            times.append((time.perf_counter() - t0) / k)
            seq.num_computed = seq.num_tokens + k - 1
            seq.output_ids.extend(int(t) for t in result.tokens[0, :k])
        eng.abort(seq.request_id)
        eng.step()
        per_token[k] = pct(times, 50) * 1e3
    return per_token


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--config", default=str(ROOT / "configs" / "server.toml"))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Give me three tips for writing clear emails.")
    ap.add_argument("--input-len", type=int, help="send /v1/completions prompts of this many corpus tokens")
    ap.add_argument("--engine-step", action="store_true",
                    help="also time the engine's own batch-1 decode step in-process (needs --model)")
    args = ap.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, args.config)
    try:
        with httpx.Client(timeout=300) as client:
            name = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            body = {"model": name, "stream": True, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            if args.input_len:
                from jaxserve.bench.dataset import load_tokenizer, synthetic

                prompts = synthetic(load_tokenizer(args.model), args.repeats + 1, args.input_len, args.max_tokens)
                bodies = [dict(body, prompt=p.prompt) for p in prompts]
            else:
                bodies = [dict(body, messages=[{"role": "user", "content": args.prompt}])] * (args.repeats + 1)
            one_request(client, url, bodies[0])  # warm-up
            ttft, itl, e2e, tpot, chunks = [], [], [], [], 0
            for b in bodies[1:]:
                t, gaps, e, n = one_request(client, url, b)
                ttft.append(t)
                itl.extend(gaps)
                e2e.append(e)
                tpot.append((e - t) / max(args.max_tokens - 1, 1))  # vllm bench's TPOT: per token, not per chunk
                chunks = n
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    ms = 1e3
    what = f"{args.input_len}-token completion prompt" if args.input_len else "chat request"
    print(f"one streamed {what} at a time, {args.max_tokens} tokens, {args.repeats} runs, {chunks} content chunks "
          f"each, {url}")
    print(f"{'metric':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}  (ms)")
    for label, xs in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e)):
        print(f"{label:<6} {statistics.mean(xs) * ms:9.1f} {pct(xs, 50) * ms:9.1f} {pct(xs, 90) * ms:9.1f} "
              f"{pct(xs, 99) * ms:9.1f}")
    print(f"decode rate seen by the client: {1 / statistics.mean(tpot):.1f} tok/s")
    if args.engine_step:
        per_token = engine_step_ms(args.model, args.config, args.input_len or 64, args.max_tokens)
        k = max(per_token)
        print("engine's own batch-1 decode, same model and config, in-process, p50 per token: "
              + ", ".join(f"{v:.1f} ms in {n}-step calls" for n, v in per_token.items()))
        print(f"TPOT p50 / engine step p50 per token ({k}-step calls, as the server runs) = "
              f"{pct(tpot, 50) * ms / per_token[k]:.2f}; against single steps = {pct(tpot, 50) * ms / per_token[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
