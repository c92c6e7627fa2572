"""Admission control: which requests the server takes, and a clear refusal for the rest.

Every generation request passes `Admission.admit` after it is parsed and tokenized and
before it reaches an engine. The checks, in order:

    capacity (503)  sequences in flight per model (`max_in_flight`), sequences waiting
                    for their first token, all priorities (`max_waiting`) and per
                    priority (`max_waiting_per_priority`), and the prompt tokens of the
                    waiting ones against the page pool (`max_queued_tokens`, the
                    KV-aware cap: a queue the cache could never drain is refused)
    rate (429)      the API key's request bucket (`requests_per_second`, `request_burst`)
    quota (429)     the key's token bucket (`tokens_per_minute`): the request reserves
                    prompt + max_tokens tokens; what it did not generate comes back when
                    it ends, so a quota counts tokens used, not tokens asked for

Capacity is checked first and nothing is taken from a bucket unless the request is
admitted, so a refused request costs its key nothing. Each refusal carries
`Retry-After` (seconds, rounded up): the time until the bucket holds enough for a
rate or quota refusal, `retry_after_s` for a capacity one. A request that could never
pass its key's token bucket is a 400, not a 429 that no wait would fix.

All of it runs on the event loop thread (no locks); the engine thread is never asked.
A request is waiting from `admit` until `Ticket.started` (its first token arrives)
and in flight until `release`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict
from typing import Callable

from jaxserve.config import AdmissionConfig, KeyLimits
from jaxserve.serving.protocol import APIError


class TokenBucket:
    """`capacity` tokens, refilled continuously at `rate` per second."""

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity = rate, capacity
        self.level = capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` tokens are there (0: now)."""
        self.refill(now)
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclasses.dataclass
class Ticket:
    """One admitted request's share of the ledgers."""

    model: str
    key: str
    priority: int
    seqs: int  # engine sequences (choices)
    prompt_tokens: int
    reserved_tokens: int  # taken from the key's token bucket
    waiting: bool = True
    released: bool = False


def _refuse(status: int, message: str, code: str, retry_after: float) -> APIError:
    return APIError(status, message, code=code, headers={"Retry-After": str(max(1, math.ceil(retry_after)))})


class Admission:
    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.in_flight: Counter = Counter()  # model -> sequences admitted and not ended
        self.waiting: Counter = Counter()  # model -> sequences with no token yet
        self.waiting_by_priority: dict[str, Counter] = defaultdict(Counter)  # model -> priority -> sequences
        self.queued_tokens: Counter = Counter()  # model -> prompt tokens of waiting sequences
        self.rejections: Counter = Counter()  # reason -> refusals
        self._request_buckets: dict[str, TokenBucket] = {}
        self._token_buckets: dict[str, TokenBucket] = {}

    # The buckets of one key ----------------------------------------------------------------

    def _buckets(self, key: str, limits: KeyLimits, now: float) -> tuple[TokenBucket | None, TokenBucket | None]:
        requests = tokens = None
        if limits.requests_per_second is not None:
            requests = self._request_buckets.get(key)
            if requests is None:
                burst = limits.request_burst or max(1.0, limits.requests_per_second)
                requests = self._request_buckets[key] = TokenBucket(limits.requests_per_second, burst, now)
        if limits.tokens_per_minute is not None:
            tokens = self._token_buckets.get(key)
            if tokens is None:
                tpm = limits.tokens_per_minute
                tokens = self._token_buckets[key] = TokenBucket(tpm / 60.0, tpm, now)
        return requests, tokens

    # Admission -------------------------------------------------------------------------------

    def admit(self, *, model: str, key: str, priority: int, seqs: int, prompt_tokens: int,
              max_new_tokens: int, pool_tokens: int) -> Ticket:
        """Admit a request of `seqs` sequences or raise the APIError that refuses it.

        prompt_tokens: over all its sequences; max_new_tokens: the most they may generate,
        together; pool_tokens: token slots of the model's page pool.
        """
        cfg, now = self.cfg, self.clock()
        self._check_capacity(model, priority, seqs, prompt_tokens, pool_tokens)
        requests, tokens = self._buckets(key, cfg.limits_for(key), now)
        cost = prompt_tokens + max_new_tokens
        if tokens is not None and cost > tokens.capacity:
            raise APIError(400, f"this request may use {cost} tokens (prompt {prompt_tokens} + max_tokens "
                                f"{max_new_tokens}), more than this key's limit of {int(tokens.capacity)} tokens "
                                "per minute; lower max_tokens", param="max_tokens", code="tokens_exceed_quota")
        if requests is not None and (wait := requests.wait_for(1, now)) > 0:
            self.rejections["rate"] += 1
            raise _refuse(429, f"rate limit reached: {requests.rate:g} requests per second for this key; "
                               f"retry in {wait:.1f} s", "rate_limit_exceeded", wait)
        if tokens is not None and (wait := tokens.wait_for(cost, now)) > 0:
            self.rejections["quota"] += 1
            raise _refuse(429, f"token quota reached: {int(tokens.capacity)} tokens per minute for this key, "
                               f"this request needs {cost}; retry in {wait:.1f} s", "tokens_quota_exceeded", wait)
        if requests is not None:
            requests.take(1)
        if tokens is not None:
            tokens.take(cost)
        self.in_flight[model] += seqs
        self.waiting[model] += seqs
        self.waiting_by_priority[model][priority] += seqs
        self.queued_tokens[model] += prompt_tokens
        return Ticket(model=model, key=key, priority=priority, seqs=seqs, prompt_tokens=prompt_tokens,
                      reserved_tokens=cost if tokens is not None else 0)

    def _check_capacity(self, model: str, priority: int, seqs: int, prompt_tokens: int, pool_tokens: int) -> None:
        cfg = self.cfg
        checks = [
            ("in_flight", cfg.max_in_flight, self.in_flight[model], seqs, "sequences in flight"),
            ("queue", cfg.max_waiting, self.waiting[model], seqs, "waiting sequences"),
            ("priority_queue", cfg.max_waiting_per_priority.get(priority), self.waiting_by_priority[model][priority],
             seqs, f"waiting sequences of priority {priority}"),
            ("kv", cfg.max_queued_tokens or 4 * pool_tokens, self.queued_tokens[model], prompt_tokens,
             "queued prompt tokens"),
        ]
        for reason, cap, used, need, what in checks:
            if cap is not None and used + need > cap and used > 0:
                self.rejections[reason] += 1
                raise _refuse(503, f"the server is at capacity: {used} {what} of at most {cap} for model "
                                   f"{model!r}; retry later", "server_overloaded", cfg.retry_after_s)

    # A request's life ------------------------------------------------------------------------

    def started(self, t: Ticket) -> None:
        """The request's first token came: it no longer waits."""
        if t.waiting and not t.released:
            t.waiting = False
            self._unwait(t)

    def release(self, t: Ticket, completion_tokens: int) -> None:
        """The request ended (finished, failed, timed out or disconnected): give back its share
        and the tokens it reserved but did not generate."""
        if t.released:
            return
        if t.waiting:
            self._unwait(t)
        t.released = True
        self.in_flight[t.model] -= t.seqs
        if t.reserved_tokens:
            unused = t.reserved_tokens - t.prompt_tokens - completion_tokens
            self._token_buckets[t.key].give(max(0, unused), self.clock())

    def _unwait(self, t: Ticket) -> None:
        self.waiting[t.model] -= t.seqs
        self.waiting_by_priority[t.model][t.priority] -= t.seqs
        self.queued_tokens[t.model] -= t.prompt_tokens

    def stats(self) -> dict:
        return {"in_flight": dict(self.in_flight), "waiting": dict(self.waiting),
                "rejections": dict(self.rejections)}
