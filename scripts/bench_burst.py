#!/usr/bin/env python
"""A burst through the engine, in-process: N requests arrive at once; how long until every one
has its first token (the prefill phase, with the decode steps that interleave with it), and
how long the rest takes.

    python scripts/bench_burst.py [--requests 64] [--prompt-len 256] [--output-len 128] [--repeats 2]
                                  [--set '{"context_buckets": [256, 384, 512, 1024, 2048]}']

The engine takes configs/server.toml's [engine] with `--set`'s keys replaced (a JSON object;
lists become tuples), so one change can be timed against the preset, each in its own process.
This is the serving comparison's load at concurrency 64 (256-token prompts, 128 out, greedy,
EOS ignored) without HTTP: random prompt tokens, so nothing hits the prefix cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxserve.config import load_config_file  # noqa: E402
from jaxserve.default_model import DEFAULT_DIR  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.engine.sequence import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_DIR))
    ap.add_argument("--config", default=str(ROOT / "configs" / "server.toml"))
    ap.add_argument("--set", default="{}", help="JSON object of [engine] keys to replace")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(args.set).items()}
    _, cfg = load_config_file(args.config)
    engine = Engine(args.model, dataclasses.replace(cfg, **changes))
    print(f"[engine] changes: {changes or 'none'}; compiled in {engine.runner.compile_seconds:.1f} s", flush=True)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for _ in range(args.repeats):
        seqs = [engine.add_request([rng.randrange(3, engine.model_cfg.vocab_size) for _ in range(args.prompt_len)],
                                   params) for _ in range(args.requests)]
        t0, first = time.perf_counter(), None
        while engine.has_unfinished:
            engine.step()
            if first is None and all(s.output_ids for s in seqs):
                first = time.perf_counter()
        end = time.perf_counter()
        print(f"prefill phase {first - t0:5.1f} s   decode phase {end - first:5.1f} s   total {end - t0:5.1f} s   "
              f"output {args.requests * args.output_len / (end - t0):6.1f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
