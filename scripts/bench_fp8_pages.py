#!/usr/bin/env python
"""fp8 KV pages on a CPU: as uint8 bits (what the engine keeps) against float8 pages, in one run.

    python scripts/bench_fp8_pages.py [--kv-cache-memory 0.04] [--num-prompts 16]

XLA's CPU backend has no float8 scatter: around each write into float8 pages it widens the
whole cache to float16 and back, so the engine keeps an fp8 cache's pages as uint8 holding the
float8 bits there (`jaxserve.layers.attention.fp8_bits`, the one place that decides). This
runs scripts/bench_kv_dtype.py's workload (same prompts, config and KV budget) with
kv_cache_dtype fp8_e4m3 twice in one process: as the engine runs it, then with `fp8_bits`
answering None, which gives the float8 pages the engine had before. Prints output tok/s of
each and the ratio; both runs' greedy outputs must be identical (the same float8 values).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kv_dtype import measure, workload_arguments  # noqa: E402

from jaxserve.bench.machine import describe  # noqa: E402
from jaxserve.engine import runner  # noqa: E402
from jaxserve.layers import attention  # noqa: E402


@contextlib.contextmanager
def float8_pages():
    """Engines made inside keep float8 pages on a CPU (no uint8 bits)."""
    saved = attention.fp8_bits
    attention.fp8_bits = runner.fp8_bits = lambda kv_cache_dtype, platform: None
    try:
        yield
    finally:
        attention.fp8_bits = runner.fp8_bits = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(ap, kv_cache_memory=0.04, num_prompts=16)
    args = ap.parse_args()
    machine, results = describe(), {}
    for pages, ctx in (("uint8 bits", contextlib.nullcontext()), ("float8", float8_pages())):
        with ctx:
            store = attention.kv_storage("fp8_e4m3", "float32", "cpu")[0]  # what init_kv_cache allocates
            assert store.name == ("uint8" if pages == "uint8 bits" else "float8_e4m3fn"), store
            results[pages] = r = measure(args, "fp8_e4m3")
        print(f"fp8_e4m3 pages as {pages}: {r['kv_tokens']} KV tokens, {r['preemptions']} preemptions, "
              f"{r['output_tok_s']:.1f} output tok/s ({r['seconds']:.1f} s)", flush=True)
    new, old = results["uint8 bits"], results["float8"]
    print(f"{machine['cpu']}, {machine['cores']} cores: uint8 bits / float8 pages = "
          f"{new['output_tok_s'] / old['output_tok_s']:.2f}x the output tok/s; identical greedy outputs: "
          f"{new['outputs'] == old['outputs']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
