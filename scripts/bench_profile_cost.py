#!/usr/bin/env python
"""What an XLA profile of live traffic costs to write (POST /debug/profile's stop_trace).

    python scripts/bench_profile_cost.py [--config configs/server.toml] [--seconds 0.5,1.5]

Builds the engine of `--config`'s [engine] on the default model, keeps it busy with back-to-back
requests (16 tokens each) on a thread, and for each capture length starts jax's profiler as the
server does (`create_perfetto_trace=True`), waits, and times `stop_trace`: seconds to write, the
trace's events and bytes on disk, and how many engine steps ran while it captured.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import threading
import time
from pathlib import Path

import jax

from jaxserve.config import load_config_file
from jaxserve.default_model import DEFAULT_DIR
from jaxserve.engine.engine import Engine
from jaxserve.engine.sequence import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/server.toml")
    ap.add_argument("--seconds", default="0.5,1.5", help="capture lengths, comma-separated")
    args = ap.parse_args()
    eng = Engine(DEFAULT_DIR, load_config_file(args.config)[1])
    steps, stop, lock = [0], threading.Event(), threading.Lock()

    def traffic():  # the engine is not thread-safe: this thread alone drives it
        while not stop.is_set():
            eng.add_request([1000 + i for i in range(32)], SamplingParams(max_tokens=16, ignore_eos=True))
            while eng.has_unfinished:
                eng.step()
                with lock:
                    steps[0] += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        print(f"{'capture s':>9} {'engine steps':>12} {'stop_trace s':>12} {'events':>9} {'MB on disk':>10}")
        for seconds in (float(s) for s in args.seconds.split(",")):
            out = tempfile.mkdtemp(prefix="jaxserve-profile-")
            jax.profiler.start_trace(out, create_perfetto_trace=True)
            with lock:
                s0 = steps[0]
            time.sleep(seconds)
            with lock:
                ran = steps[0] - s0
            t0 = time.perf_counter()
            jax.profiler.stop_trace()
            took = time.perf_counter() - t0
            files = [f for f in Path(out).rglob("*") if f.is_file()]
            trace = next(f for f in files if f.name == "perfetto_trace.json.gz")
            events = json.loads(gzip.decompress(trace.read_bytes()))
            events = events["traceEvents"] if isinstance(events, dict) else events
            print(f"{seconds:9.1f} {ran:12d} {took:12.1f} {len(events):9d} {sum(f.stat().st_size for f in files) / 1e6:10.0f}")
    finally:
        stop.set()
        worker.join()


if __name__ == "__main__":
    main()
