#!/usr/bin/env python
"""Quantized KV caches against the float cache, under KV memory pressure.

    python scripts/bench_kv_dtype.py [--kv-cache-memory 0.1] [--num-prompts 32] [--kv-cache-dtypes auto,int8]

--num-prompts requests (prompts of --input-len tokens cut from the documentation corpus,
--output-len tokens out, greedy, EOS ignored) are added at once to the offline engine with
configs/server.toml's [engine] settings and a KV budget of --kv-cache-memory GiB, small
enough that the float32 cache cannot hold them all and preempts (by recompute). Once per
kv_cache_dtype of --kv-cache-dtypes ("auto", the float32 cache, first), one after the other in
one process; prints the tokens each cache holds, preemptions, and output tok/s over the whole run.
Results: between the bench-kv-dtype markers of BENCHMARKS.md and benchmarks/kv_dtype.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_compare import write_benchmarks_md  # noqa: E402

from jaxserve.bench import report  # noqa: E402
from jaxserve.bench.dataset import load_tokenizer, synthetic  # noqa: E402
from jaxserve.bench.machine import describe  # noqa: E402
from jaxserve.config import load_config_file  # noqa: E402
from jaxserve.default_model import DEFAULT_DIR  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.engine.sequence import SamplingParams  # noqa: E402

START, END = "<!-- bench-kv-dtype:start -->", "<!-- bench-kv-dtype:end -->"


def run(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    before = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    wall = time.perf_counter() - t0
    out = sum(len(s.output_ids) for s in seqs)
    return {"output_tokens": out, "seconds": wall, "output_tok_s": out / wall,
            "preemptions": engine.scheduler.num_preemptions - before, "kv_tokens": engine.pool.num_tokens,
            "outputs": [s.output_ids for s in seqs]}


def workload_arguments(ap: argparse.ArgumentParser, kv_cache_memory: float, num_prompts: int) -> None:
    """The workload's flags (also scripts/bench_fp8_pages.py's)."""
    ap.add_argument("--model", default=str(DEFAULT_DIR))
    ap.add_argument("--config", default=str(ROOT / "configs/server.toml"))
    ap.add_argument("--kv-cache-memory", type=float, default=kv_cache_memory, metavar="GIB")
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)


def measure(args, kv_cache_dtype: str) -> dict:
    """`run` of the workload on a fresh engine with this cache (after two short warm requests)."""
    _, base = load_config_file(args.config)
    base = dataclasses.replace(base, kv_cache_memory_gib=args.kv_cache_memory, kv_cache_memory_fraction=None,
                               kv_cache_dtype=kv_cache_dtype)
    eng = Engine(args.model, base)
    prompts = [eng.tokenizer.encode(p.prompt) for p in synthetic(load_tokenizer(args.model), args.num_prompts,
                                                                   args.input_len, args.output_len, seed=0)]
    run(eng, prompts[:2], 16)  # warm
    return run(eng, prompts, args.output_len)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(ap, kv_cache_memory=0.1, num_prompts=32)
    ap.add_argument("--kv-cache-dtypes", default="auto,int8", help="comma-separated; auto (float32) first")
    ap.add_argument("--out-dir", default="benchmarks")
    ap.add_argument("--markdown", default="BENCHMARKS.md")
    args = ap.parse_args()
    kinds = args.kv_cache_dtypes.split(",")
    if kinds[0] != "auto" or len(kinds) < 2:
        ap.error("--kv-cache-dtypes: auto first, then at least one quantized cache")
    machine, t_all, results = describe(), time.monotonic(), {}
    for kv in kinds:
        results[kv] = r = measure(args, kv)
        print(f"{kv:8s}: {r['kv_tokens']} KV tokens, {r['preemptions']} preemptions, {r['output_tok_s']:.1f} "
              f"output tok/s ({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
    f = results["auto"]
    same = {kv: sum(a == b for a, b in zip(f["outputs"], results[kv]["outputs"])) for kv in kinds[1:]}
    for r in results.values():
        del r["outputs"]
    wall = time.monotonic() - t_all
    command = ("python scripts/bench_kv_dtype.py " + " ".join(sys.argv[1:])).strip()
    out = Path(args.out_dir)
    out.mkdir(exist_ok=True)
    report.save_json(out / "kv_dtype.json", {"machine": machine, "results": results, "identical_outputs": same,
                                            "command": command})
    names = {"auto": "float32"}
    title = f"## Quantized KV cache: {', '.join(kinds[1:])} against float32 under KV pressure (issue 21)"
    lines = [START, "", title, "",
             f"One run of `{command}` on {time.strftime('%Y-%m-%d')}: {machine['cpu']}, {machine['cores']} cores "
             f"({wall / 60:.1f} min). Offline engine, configs/server.toml's [engine] (int8 weights) with a "
             f"{args.kv_cache_memory} GiB KV budget; {args.num_prompts} requests of {args.input_len} prompt tokens "
             f"and {args.output_len} out (greedy, EOS ignored) added at once.", "",
             "| KV cache | tokens the budget holds | preemptions | output tok/s |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {names.get(kv, kv)} | {r['kv_tokens']} | {r['preemptions']} | {r['output_tok_s']:.1f} |"
              for kv, r in results.items()]
    lines += [""] + [f"{kv} / float32: **{results[kv]['kv_tokens'] / f['kv_tokens']:.2f}x** the tokens, "
                     f"**{results[kv]['output_tok_s'] / f['output_tok_s']:.2f}x** the output tok/s; {same[kv]} of "
                     f"{args.num_prompts} greedy outputs identical to the float cache's." for kv in kinds[1:]]
    lines += ["", END]
    write_benchmarks_md("\n".join(lines), Path(args.markdown), START, END)
    print(f"wrote {args.markdown} and {out}/kv_dtype.json in {wall / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
