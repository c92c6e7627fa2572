"""Streamed requests, timed chunk by chunk, and the load generator that sends them.

Load is either a fixed maximum concurrency (a semaphore: at most C requests in
flight, the next one sent as soon as one finishes) or Poisson arrivals at a request
rate (exponential gaps, seeded), optionally capped by a concurrency too, as in
`vllm bench serve`. A few warm-up requests run first and are not counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Callable

import httpx

from jaxserve.bench.dataset import BenchPrompt
from jaxserve.bench.metrics import RequestRecord


def request_body(p: BenchPrompt, model: str, ignore_eos: bool, temperature: float, extra: dict | None = None) -> dict:
    body = {"model": model, "max_tokens": p.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    if ignore_eos:
        body["ignore_eos"] = True
    if p.messages is not None:
        body["messages"] = p.messages
    else:
        body["prompt"] = p.prompt
    return body


def _text_of(chunk: dict) -> str:
    out = ""
    for c in chunk.get("choices") or []:
        out += (c.get("delta") or {}).get("content") or c.get("text") or ""
    return out


async def send(client: httpx.AsyncClient, base_url: str, p: BenchPrompt, model: str, *, ignore_eos: bool = True,
               temperature: float = 0.0, count_tokens: Callable[[str], int] | None = None,
               extra: dict | None = None) -> RequestRecord:
    """One streamed request; never raises: a failure is recorded on the returned record.
    `extra` adds body fields (e.g. `priority`)."""
    path = "/v1/chat/completions" if p.messages is not None else "/v1/completions"
    rec = RequestRecord(start=time.perf_counter(), prompt_tokens=p.prompt_tokens)
    usage = None
    try:
        async with client.stream("POST", base_url + path, json=request_body(p, model, ignore_eos, temperature, extra),
                                 headers={"Accept": "text/event-stream"}) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return rec
                text = _text_of(chunk)
                if text:
                    rec.chunk_times.append(now)
                    rec.text += text
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if isinstance((chunk.get("timings") or {}).get("cache_n"), int):
                    rec.cached_tokens = chunk["timings"]["cache_n"]  # llama-server: prompt tokens its slot kept
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if usage and usage.get("completion_tokens"):
        rec.output_tokens = int(usage["completion_tokens"])
    elif count_tokens is not None:
        rec.output_tokens = count_tokens(rec.text)
    else:
        rec.output_tokens = len(rec.chunk_times)
    if usage and usage.get("prompt_tokens"):
        rec.prompt_tokens = int(usage["prompt_tokens"])
    details = (usage or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]
    if not rec.chunk_times:
        rec.error = "no text in the response"
    return rec


async def run_load(base_url: str, model: str, prompts: list[BenchPrompt], *, max_concurrency: int | None,
                   request_rate: float = float("inf"), seed: int = 0, warmup: int = 1, ignore_eos: bool = True,
                   temperature: float = 0.0, count_tokens: Callable[[str], int] | None = None,
                   progress: bool = True, timeout: float = 1800.0) -> tuple[list[RequestRecord], float]:
    """Send prompts[:warmup] one by one (uncounted), then the rest under the given load.

    Returns the counted records and the run's duration (s)."""
    from tqdm import tqdm

    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=max(max_concurrency or len(prompts), 1) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as client:
        prompts, warm = prompts[warmup:], prompts[:warmup]
        for p in warm:
            await send(client, base_url, p, model, ignore_eos=ignore_eos, temperature=temperature,
                       count_tokens=count_tokens)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(prompts), desc=f"c={max_concurrency or 'inf'}", unit="req", disable=not progress,
                   leave=False)
        rng = random.Random(seed)

        async def one(p: BenchPrompt) -> RequestRecord:
            if gate is None:
                rec = await send(client, base_url, p, model, ignore_eos=ignore_eos, temperature=temperature,
                                 count_tokens=count_tokens)
            else:
                async with gate:
                    rec = await send(client, base_url, p, model, ignore_eos=ignore_eos, temperature=temperature,
                                     count_tokens=count_tokens)
            bar.update(1)
            return rec

        t0 = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(one(p)))
            if request_rate != float("inf") and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return list(records), duration
