#!/usr/bin/env python
"""Scoring prompts as an evaluation harness does, with and without kept prompt-logprob records.

    python scripts/bench_scoring.py [--questions 16] [--answers 4]

lm-evaluation-harness's `local-completions` scores a multiple-choice question by sending
each (context + answer) with echo, logprobs 1 and one token to generate, and reads the
answer's prompt logprobs. The contexts repeat: the same few-shot header before every
question, and each question before each of its answers. A scored prompt needs every
position's logits, which cached K/V pages do not hold, so the prefix cache also keeps the
records of each scored page (engine/prefix_cache.py, `keep_scores` / `find_scores`).

This scores `--questions` x `--answers` such prompts, all sent at once, on one engine with
configs/server.toml's [engine] (prefix caching on), twice: with the records kept, and with
`PrefixCache.MAX_SCORED_PAGES` 0 (none kept: every scored prompt computes all of itself, as
before they were kept). Each run uses its own cache salt, so neither finds the other's
pages, and runs once unmeasured first to compile the scored steps it uses. Prints prompt
tokens scored per second of each, the ratio, and the largest and the mean difference
between the two runs' logprobs. The two runs split the prompts into different steps: with
float weights (`--quantization none`) that moves a logprob by a few 1e-6; with the preset's
w8a8 by up to a few tenths at some positions, where those last bits turn an activation's
int8 rounding (the same happens between any two splits of a prompt, kept records or not).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxserve.bench.machine import describe  # noqa: E402
from jaxserve.config import load_config_file  # noqa: E402
from jaxserve.default_model import DEFAULT_DIR  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.engine.prefix_cache import PrefixCache  # noqa: E402
from jaxserve.engine.sequence import SamplingParams  # noqa: E402

WORDS = ("river mountain lantern copper orchard signal harbor meadow puzzle velvet garden thunder pencil marble "
         "ocean violet candle window ladder forest").split()


def workload(tok, questions: int, answers: int, seed: int = 0) -> list[list[int]]:
    """A few-shot header (about 200 tokens) shared by every prompt, then a question (about 40
    tokens) shared by its answers, then one answer (about 8 tokens)."""
    rng = random.Random(seed)
    shots = "".join(f"Question: which word comes first, {rng.choice(WORDS)} or {rng.choice(WORDS)}?\n"
                    f"Answer: the {rng.choice(WORDS)} one, because it is older than the {rng.choice(WORDS)}.\n\n"
                    for _ in range(6))
    prompts = []
    for _ in range(questions):
        q = "Question: " + " ".join(rng.choice(WORDS) for _ in range(30)) + "?\nAnswer:"
        for _ in range(answers):
            prompts.append(tok.encode(shots + q + " the " + " ".join(rng.choice(WORDS) for _ in range(5)) + "."))
    return prompts


def score(eng: Engine, prompts: list[list[int]], salt: str) -> dict:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    t0 = time.perf_counter()
    seqs = [eng.add_request(p, params, cache_salt=salt) for p in prompts]
    eng.run_until_done()
    wall = time.perf_counter() - t0
    scored = sum(len(s.prompt_logprobs) for s in seqs)
    return {"seconds": wall, "tok_s": scored / wall, "scored": scored,
            "cached": sum(s.cached_tokens or 0 for s in seqs),
            "logprobs": [[r["logprob"] for r in s.prompt_logprobs] for s in seqs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_DIR))
    ap.add_argument("--config", default=str(ROOT / "configs/server.toml"))
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--answers", type=int, default=4)
    ap.add_argument("--quantization", choices=["config", "none", "int8", "w8a8"], default="config",
                    help="the weights' quantization (default: the config's)")
    args = ap.parse_args()
    _, cfg = load_config_file(args.config)
    if args.quantization != "config":
        cfg = dataclasses.replace(cfg, quantization=None if args.quantization == "none" else args.quantization)
    eng = Engine(args.model, cfg)
    assert eng.cache is not None, "the config must enable prefix caching"
    prompts = workload(eng.tokenizer, args.questions, args.answers)
    kept_pages = PrefixCache.MAX_SCORED_PAGES
    results = {}
    for mode, pages in (("records kept", kept_pages), ("none kept", 0)):
        PrefixCache.MAX_SCORED_PAGES = pages
        score(eng, prompts, f"warm {mode}")  # compiles the scored steps this mode's shapes use
        results[mode] = r = score(eng, prompts, mode)
        print(f"{mode}: {len(prompts)} prompts, {r['scored']} prompt tokens scored in {r['seconds']:.2f} s, "
              f"{r['tok_s']:.0f} tok/s ({r['cached']} tokens from the prefix cache)", flush=True)
    PrefixCache.MAX_SCORED_PAGES = kept_pages
    on, off = results["records kept"], results["none kept"]
    diffs = [abs(a - b) for x, y in zip(on["logprobs"], off["logprobs"]) for a, b in zip(x, y)]
    machine = describe()
    print(f"{machine['cpu']}, {machine['cores']} cores, quantization {cfg.quantization}: records kept / none kept = "
          f"{on['tok_s'] / off['tok_s']:.2f}x the scored tok/s; logprob difference largest {max(diffs):.2g}, "
          f"mean {sum(diffs) / len(diffs):.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
