#!/usr/bin/env python
"""Time of one jitted sampler call (`jaxserve.engine.sampler.sample`) on this machine's CPU.

    .venv/bin/python scripts/bench_sampler.py [--vocab 49152] [--batches 8,64] [--repeats 20]

Per batch size, five kinds of rows over random logits: greedy (the one-argmax branch),
seeded sampling at temperature 0.8 with no filter, the same with top-k 40, top-p 0.9 and
min-p 0.05 (the filters), with top-p 0.9 alone, and with top-k 200 alone (on these flat
logits the last two need more than the sampler's 64 candidates). Prints the median
milliseconds per call. Only the sampler's public `sample` and `SamplingArrays` are used, so
the same script times an older commit's sampler (BENCHMARKS.md: "Sampling without a sort",
"Sampling on a CPU").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.engine.sampler import SamplingArrays, sample  # noqa: E402

KINDS = {"greedy": dict(temperature=0.0),
         "sampled": dict(temperature=0.8),
         "sampled + top-k/p, min-p": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
         "sampled + top-p 0.9": dict(temperature=0.8, top_p=0.9),
         "sampled + top-k 200": dict(temperature=0.8, top_k=200)}


def arrays(B: int, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> SamplingArrays:
    f32, i32 = np.float32, np.int32
    return SamplingArrays(
        temperature=np.full(B, temperature, f32), top_k=np.full(B, top_k, i32), top_p=np.full(B, top_p, f32),
        min_p=np.full(B, min_p, f32), presence_penalty=np.zeros(B, f32), frequency_penalty=np.zeros(B, f32),
        repetition_penalty=np.ones(B, f32), seeds=np.arange(B, dtype=np.uint32), counters=np.zeros(B, i32),
        history=np.full((B, 4), -1, i32), prompt_lens=np.zeros(B, i32), logprobs=np.zeros(B, np.bool_),
        bias_ids=np.full((B, 3), -1, i32), bias_values=np.zeros((B, 3), f32))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152, help="the default model's vocabulary")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    fn = jax.jit(sample)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, vocabulary {args.vocab}")
    for B in (int(b) for b in args.batches.split(",")):
        logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, args.vocab)).astype(np.float32) * 3)
        for name, kind in KINDS.items():
            s = arrays(B, **kind)
            jax.block_until_ready(fn(logits, s))  # compile
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(logits, s))
                times.append(time.perf_counter() - t0)
            print(f"B={B:<3d} {name:<26s} {statistics.median(times) * 1e3:8.2f} ms per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
