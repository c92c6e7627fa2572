"""The multi-turn chat workload: `jaxserve bench --dataset multi-turn`.

N conversations share one system prompt of `system_len` tokens. Each has `turns`
turns: a user message of `user_len` tokens (cut from the same corpus as the synthetic
prompts, seeded), the server's answer appended as the assistant's message, then the
next user message; so turn t resends everything before it. Turns run in order within a
conversation; conversations run concurrently, at most `max_concurrency` at a time.

This is the traffic a prefix cache is for: turn 1 shares the system prompt with every
other conversation, a later turn shares its whole history with the turn before. The
summary reports TTFT per turn (turn 1 against turns 2..N is the cache's effect on a
user's wait) and the prompt tokens the server says it found cached
(`usage.prompt_tokens_details.cached_tokens`, where the server reports it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Callable

import httpx

from jaxserve.bench.client import send
from jaxserve.bench.dataset import BenchPrompt, corpus_window
from jaxserve.bench.metrics import RequestRecord, stats, summarize


@dataclasses.dataclass(frozen=True)
class Conversation:
    system: str
    user_messages: tuple[str, ...]
    output_len: int


def conversations(tok, n: int, turns: int, system_len: int, user_len: int, output_len: int,
                  seed: int = 0) -> list[Conversation]:
    """`n` conversations of `turns` user messages; one shared system prompt. Seeded."""
    if n < 1 or turns < 1 or system_len < 1 or user_len < 1:
        raise ValueError("multi-turn needs at least one conversation, turn, system token and user token")
    rng = random.Random(seed)
    system = corpus_window(tok, rng, system_len)
    return [Conversation(system, tuple(corpus_window(tok, rng, user_len) for _ in range(turns)), output_len)
            for _ in range(n)]


async def run_conversations(base_url: str, model: str, convs: list[Conversation], *, max_concurrency: int | None,
                            ignore_eos: bool = True, temperature: float = 0.0,
                            count_tokens: Callable[[str], int] | None = None, timeout: float = 1800.0,
                            ) -> tuple[list[tuple[int, RequestRecord]], float]:
    """Every conversation, turn by turn: ([(turn, record)], duration in s). A failed turn ends
    its conversation (the later turns would resend an answer that never came)."""
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=(max_concurrency or len(convs)) + 4)
    gate = asyncio.Semaphore(max_concurrency or len(convs))
    out: list[tuple[int, RequestRecord]] = []

    async def one(client: httpx.AsyncClient, conv: Conversation) -> None:
        async with gate:
            messages = [{"role": "system", "content": conv.system}]
            for t, user in enumerate(conv.user_messages, 1):
                messages.append({"role": "user", "content": user})
                p = BenchPrompt(None, list(messages), 0, conv.output_len)
                rec = await send(client, base_url, p, model, ignore_eos=ignore_eos, temperature=temperature,
                                 count_tokens=count_tokens)
                out.append((t, rec))
                if not rec.ok:
                    return
                messages.append({"role": "assistant", "content": rec.text})

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, c) for c in convs))
        duration = time.perf_counter() - t0
    return out, duration


def summarize_turns(records: list[tuple[int, RequestRecord]], duration: float) -> dict:
    """`metrics.summarize` over all turns, plus TTFT by turn, TTFT of turns 2.., and the hit rate."""
    result = summarize([r for _, r in records], duration)
    ok = [(t, r) for t, r in records if r.ok]
    turns = sorted({t for t, _ in ok})
    result["ttft_by_turn"] = {t: stats([r.ttft for u, r in ok if u == t]) for t in turns}
    result["ttft_later_turns"] = stats([r.ttft for t, r in ok if t > 1])
    reported = [r for _, r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    result["cached_tokens"] = sum(r.cached_tokens for r in reported) if reported else None
    result["cache_hit_rate"] = result["cached_tokens"] / prompt if reported and prompt else None
    return result


def table(results: list[dict]) -> str:
    """One row per run: throughput, TTFT of turn 1 and of the later turns (ms), the hit rate."""
    rows = [f"{'run':>12} {'done':>5} {'out tok/s':>9} {'TTFT t1 p50':>11} {'t2+ p50':>8} {'t2+ p99':>8} "
            f"{'TPOT p50':>8} {'hit rate':>8}"]
    for r in results:
        first = r["ttft_by_turn"].get(1, {"p50": float("nan")})
        hit = "n/a" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.1f} %"
        rows.append(f"{r.get('label') or 'c=' + str(r.get('max_concurrency')):>12} {r['completed']:>5} "
                    f"{r['output_throughput']:9.1f} {first['p50'] * 1e3:11.0f} "
                    f"{r['ttft_later_turns']['p50'] * 1e3:8.0f} {r['ttft_later_turns']['p99'] * 1e3:8.0f} "
                    f"{r['tpot']['p50'] * 1e3:8.1f} {hit:>8}")
        if r["failed"]:
            rows.append(f"{'':>12} {r['failed']} failed: {'; '.join(r['errors'])}")
    return "\n".join(rows)
