#!/usr/bin/env python
"""Where a served token's host time goes: py-spy samples a running jaxserve while one
streamed request at a time (or `--concurrency` at once) runs through it.

    python scripts/profile_host.py [--concurrency 1] [--seconds 30] [-- extra serve flags]
    python scripts/profile_host.py -- --no-overlap --decode-steps 1     # the plain loop

Starts `jaxserve serve --config configs/server.toml` plus the extra flags on a free port,
sends two warm-up requests, then records the server process with py-spy (every thread,
50 samples/s, idle frames left out) while it streams 256-token prompts, 128 tokens each,
greedy, EOS ignored. Prints each thread's share of the samples and the frames that
spend the most samples themselves (self time), per thread: the engine thread waiting in
`Launched.result` is the device computing; anything else there is host work the device
may be waiting for. py-spy comes with the `bench` extra (`make install-bench`).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_latency import one_request, start_server  # noqa: E402


def summarize(raw: Path, top: int) -> str:
    """py-spy's raw (collapsed) stacks -> samples per thread and the top self-time frames."""
    per_thread, self_time, idle = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if frames[-1].startswith("Condition.wait "):  # a thread parked until it has work
            idle += int(count)
            continue
        thread = frames[0].split(":", 1)[-1].strip()
        per_thread[thread] += int(count)
        self_time[(thread, frames[-1])] += int(count)
    total = sum(per_thread.values()) or 1
    lines = [f"{total} samples ({idle} more in threads parked in Condition.wait left out)"]
    lines += [f"  {n / total:6.1%}  thread {t}" for t, n in per_thread.most_common()]
    lines.append("top frames by self samples:")
    lines += [f"  {n / total:6.1%}  [{t}] {f}" for (t, f), n in self_time.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--config", default=str(ROOT / "configs" / "server.toml"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("extra", nargs="*", help="flags for jaxserve serve (after --)")
    args = ap.parse_args()

    from jaxserve.bench.dataset import load_tokenizer, synthetic

    proc, url = start_server(args.model, args.config, args.extra)
    raw = Path(tempfile.mkdtemp()) / "profile.raw"
    try:
        with httpx.Client(timeout=600) as client:
            name = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            body = {"model": name, "stream": True, "max_tokens": 128, "temperature": 0, "ignore_eos": True}
            prompts = [p.prompt for p in synthetic(load_tokenizer(args.model), 64, 256, 128)]
            for p in prompts[:2]:
                one_request(client, url, dict(body, prompt=p))
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(proc.pid), "--rate", "50", "--duration",
                                    str(args.seconds), "--format", "raw", "--threads", "--output", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            queue = iter(prompts[2:])
            lock = threading.Lock()

            def worker():
                while spy.poll() is None:
                    with lock:
                        p = next(queue, None)
                    if p is None:
                        return
                    one_request(client, url, dict(body, prompt=p))

            workers = [threading.Thread(target=worker) for _ in range(args.concurrency)]
            for w in workers:
                w.start()
            spy.wait()
            for w in workers:
                w.join()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"jaxserve serve --config {Path(args.config).name} {' '.join(args.extra)}: "
          f"{args.concurrency} stream(s) at a time, {args.seconds} s recorded")
    print(summarize(raw, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
