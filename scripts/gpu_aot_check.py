#!/usr/bin/env python
"""Compile every Pallas kernel configuration and engine steps for A100 (sm_80) and H100 (sm_90),
on a machine without a GPU (jaxserve/aot.py). Run it with the CUDA plugin's environment:

    make install-gpu-aot
    .venv-gpu-aot/bin/python scripts/gpu_aot_check.py [--targets sm_80,sm_90] [--steps all|extremes|none]
                                                      [--kernels all|none] [--int8-blocks BM,BN,BK]

One line per compilation ("ok TARGET SECONDS NAME"), "FAIL TARGET NAME: MESSAGE" for each that
the compiler refuses, a summary, exit status 1 if any failed. --steps all (the default, what
`make test` runs) compiles every step bucket of the engine's default configuration on a GPU
(aot.gpu_engine_config: 13 per model and weights, the Pallas kernels needing one context width)
for both models and both weights: 104 steps and the kernels, some minutes on two cores;
--steps extremes only each one's two largest buckets (aot.extreme_buckets). --int8-blocks adds an
int8 matmul with those block sizes at the 8B model's largest projection (a way to see the check
fail: 256,512,512 needs 1.5 MiB of shared memory).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve import aot  # noqa: E402

aot.compile_only_environment()  # before any backend starts


def cases(targets: list[str], kernels: str, steps: str, int8_blocks: tuple[int, int, int] | None) -> list[aot.Case]:
    out = []
    for t in targets:
        if int8_blocks:
            bm, bn, bk = int8_blocks
            out.append(aot._matmul_case(t, "int8", 2048, 4096, 14336, "bfloat16", block_m=bm, block_n=bn, block_k=bk))
        if kernels == "all":
            out += aot.kernel_cases(t)
        for model in aot.MODELS if steps != "none" else ():
            for weights in aot.WEIGHTS:
                out += aot.step_cases(t, model, weights, only=aot.extreme_buckets if steps == "extremes" else None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(aot.TARGETS))
    ap.add_argument("--kernels", choices=("all", "none"), default="all")
    ap.add_argument("--steps", choices=("all", "extremes", "none"), default="all")
    ap.add_argument("--int8-blocks", type=lambda s: tuple(int(x) for x in s.split(",")), metavar="BM,BN,BK")
    args = ap.parse_args()
    failed, t_all = 0, time.perf_counter()
    todo = cases(args.targets.split(","), args.kernels, args.steps, args.int8_blocks)
    for case in todo:
        t0 = time.perf_counter()
        try:
            case.compile()
        except aot.CompileError as e:
            failed += 1
            print(f"FAIL {case.target} {' '.join(str(e).split())[:2000]}", flush=True)
            continue
        print(f"ok {case.target} {time.perf_counter() - t0:5.2f}s {case.name}", flush=True)
    print(f"{len(todo) - failed} of {len(todo)} compiled for {args.targets} in {time.perf_counter() - t_all:.0f}s"
          + (f"; {failed} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
