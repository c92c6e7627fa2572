"""Benchmark metrics, with the definitions of `vllm bench serve`.

Per request (all times in seconds, from the moment the request was sent):
  TTFT  time to the first chunk that carries text;
  E2EL  time to the last chunk that carries text;
  ITL   every gap between consecutive text chunks (a request with k chunks gives k-1);
  TPOT  (E2EL - TTFT) / (output_tokens - 1), for requests with more than one token.
Output tokens are the server's `usage.completion_tokens` when it sends usage, else the
tokenizer's count of the text. Over the run, `duration` runs from the first request
sent to the last one finished: request throughput = completed / duration, output
throughput = output tokens / duration, total = (prompt + output tokens) / duration.
Goodput counts only requests that meet every given SLO (ttft, tpot, e2el in ms).
Percentiles are numpy's (linear interpolation), as vLLM reports them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it."""

    start: float  # perf_counter when sent
    prompt_tokens: int
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # absolute, text-bearing chunks
    output_tokens: int = 0
    text: str = ""
    error: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_slos(spec: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (ms on the command line, s inside)."""
    slos = {}
    for item in spec or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"SLO {item!r}: expected one of {', '.join(SLO_KEYS)} as KEY:MILLISECONDS")
        try:
            slos[key] = float(value) / 1e3
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
    return slos


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values, np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def _meets(r: RequestRecord, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.e2el}
    return all(got[k] <= v for k, v in slos.items())


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None) -> dict:
    """The run's metrics: counts, throughputs and mean/p50/p90/p99 of each latency (seconds)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    result = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": stats([r.ttft for r in ok]),
        "tpot": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": stats([g for r in ok for g in r.itls]),
        "e2el": stats([r.e2el for r in ok]),
    }
    if slos:
        good = sum(_meets(r, slos) for r in ok)
        result["slos_ms"] = {k: v * 1e3 for k, v in slos.items()}
        result["good_requests"] = good
        result["goodput"] = good / duration
    return result
