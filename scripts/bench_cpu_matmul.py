#!/usr/bin/env python
"""The CPU int8 matmul kernel (layers/cpu_gemv.py) on against off, in one process.

    python scripts/bench_cpu_matmul.py [--config configs/server.toml] [--rounds 2]

Builds the engine of `--config`'s [engine] (the preset: W8A8) with `cpu_matmul_kernel` off and
on, alternately, `--rounds` times each, and times its own decode calls as the server makes them
(`decode_steps` steps per call, launch to sampled ids) for 1 and 4 sequences of 256-token
prompts over the next 128 tokens: p50 ms per step. Also checks that both give the same greedy
tokens (the kernel computes the same integers).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from jaxserve.config import load_config_file
from jaxserve.default_model import DEFAULT_DIR
from jaxserve.engine.engine import Engine
from jaxserve.engine.runner import ScheduledItem
from jaxserve.engine.sequence import SamplingParams


def step_ms(eng: Engine, batch: int, input_len: int, output_len: int) -> tuple[float, list[list[int]]]:
    """p50 ms per decode step of `batch` sequences in calls of decode_steps steps, and their tokens."""
    k = eng.config.decode_steps
    seqs = [eng.add_request([1000 + 7 * b + i for i in range(input_len)],
                            SamplingParams(max_tokens=output_len + k, temperature=0, ignore_eos=True))
            for b in range(batch)]
    while any(s.num_uncomputed > 1 or not s.output_ids for s in seqs):  # the prompts, through the engine
        eng.step()
    times = []
    while len(seqs[0].output_ids) + k <= output_len and all(eng.pool.grow(s.pages, s.num_tokens + k - 1) for s in seqs):
        t0 = time.perf_counter()
        result = eng.runner.run([ScheduledItem(s, s.num_tokens - 1, 1) for s in seqs], decode=True, k=k)
        times.append((time.perf_counter() - t0) / k)
        for i, s in enumerate(seqs):
            s.num_computed = s.num_tokens + k - 1
            s.output_ids.extend(int(t) for t in result.tokens[i, :k])
    tokens = [list(s.output_ids) for s in seqs]
    for s in seqs:
        eng.abort(s.request_id)
    eng.step()
    return statistics.median(times) * 1e3, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_DIR))
    ap.add_argument("--config", default="configs/server.toml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(argv)
    _, cfg = load_config_file(args.config)
    cfg = dataclasses.replace(cfg, max_num_seqs=4, decode_batch_buckets=(1, 4), max_model_len=512,
                              context_buckets=tuple(c for c in cfg.context_buckets if c <= 512))
    results: dict[tuple[bool, int], list[float]] = {}
    tokens: dict[tuple[bool, int], list] = {}
    for _ in range(args.rounds):
        for on in (False, True):
            eng = Engine(args.model, dataclasses.replace(cfg, cpu_matmul_kernel=on))
            assert ("tiles" in eng.runner.params["layers"]["wq"]) == on, "the kernel did not load"
            for batch in (1, 4):
                ms, toks = step_ms(eng, batch, args.input_len, args.output_len)
                results.setdefault((on, batch), []).append(ms)
                tokens[(on, batch)] = toks
            del eng
    print(f"{args.config} [engine] (quantization {cfg.quantization}, decode_steps {cfg.decode_steps}), "
          f"{args.input_len}-token prompts, the next {args.output_len} tokens; p50 ms per decode step, "
          f"{args.rounds} alternating rounds")
    for batch in (1, 4):
        off, on = results[(False, batch)], results[(True, batch)]
        same = tokens[(False, batch)] == tokens[(True, batch)]
        print(f"  {batch} sequence(s): kernel off {' / '.join(f'{x:.2f}' for x in off)} ms, "
              f"on {' / '.join(f'{x:.2f}' for x in on)} ms: {min(off) / min(on):.2f}x (best of each); "
              f"greedy tokens identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
