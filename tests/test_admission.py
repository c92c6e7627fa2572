"""Admission control (jaxserve/serving/admission.py) on a hand-driven clock: no model, no sleeps.

Each expected number is worked out from the bucket arithmetic in the comments: a bucket
of capacity C refilled at r per second, after taking x, holds C - x + r * elapsed.
"""

from __future__ import annotations

import pytest

from jaxserve.config import AdmissionConfig, ConfigError, ServerConfig
from jaxserve.serving.admission import Admission
from jaxserve.serving.protocol import APIError


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def admit(adm: Admission, key="k", priority=0, seqs=1, prompt=10, new=10, pool=10_000, model="m"):
    return adm.admit(model=model, key=key, priority=priority, seqs=seqs, prompt_tokens=prompt,
                     max_new_tokens=new, pool_tokens=pool)


def refusal(fn) -> APIError:
    with pytest.raises(APIError) as info:
        fn()
    return info.value


def test_capacity_caps_give_503_with_retry_after_and_free_up_as_requests_progress():
    adm = Admission(AdmissionConfig(max_waiting=2, max_in_flight=3, retry_after_s=2), Clock())
    a, b = admit(adm), admit(adm)
    e = refusal(lambda: admit(adm))  # two waiting of at most 2
    assert (e.status, e.code, e.headers["Retry-After"]) == (503, "server_overloaded", "2")
    assert "2 waiting sequences of at most 2" in e.message
    adm.started(a)  # a produced its first token: one waiting, two in flight
    c = admit(adm)
    e = refusal(lambda: admit(adm))  # three in flight of at most 3
    assert e.status == 503 and "3 sequences in flight of at most 3" in e.message
    for t in (a, b, c):
        adm.release(t, completion_tokens=5)
    adm.release(a, completion_tokens=5)  # releasing twice changes nothing
    assert adm.in_flight["m"] == 0 and adm.waiting["m"] == 0 and adm.queued_tokens["m"] == 0
    assert adm.rejections == {"queue": 1, "in_flight": 1}
    admit(adm, model="other")  # each model has its own ledger
    admit(adm)


def test_per_priority_waiting_caps_by_class_name():
    cfg = AdmissionConfig(max_waiting_per_priority={"batch": 1})
    adm = Admission(cfg, Clock())
    admit(adm, priority=10)
    e = refusal(lambda: admit(adm, priority=10))
    assert e.status == 503 and "priority 10" in e.message
    admit(adm, priority=0)  # interactive requests are not held back by the batch queue
    assert adm.rejections == {"priority_queue": 1}


def test_kv_aware_cap_counts_queued_prompt_tokens_against_the_pool():
    adm = Admission(AdmissionConfig(), Clock())  # default: 4 x the pool's tokens
    first = admit(adm, prompt=300, pool=100)  # an empty queue always takes one request
    admit(adm, prompt=90, pool=100)  # 390 of 400
    e = refusal(lambda: admit(adm, prompt=20, pool=100))
    assert e.status == 503 and "390 queued prompt tokens of at most 400" in e.message
    adm.started(first)  # its prompt is in the cache now, no longer queued
    admit(adm, prompt=20, pool=100)


def test_request_rate_bucket_refuses_with_the_wait_until_a_token_is_back():
    clock = Clock()
    adm = Admission(AdmissionConfig(limits={"requests_per_second": 2, "request_burst": 3}), clock)
    for _ in range(3):
        admit(adm)
    e = refusal(lambda: admit(adm))
    # empty bucket, 2 per second: one request token in 0.5 s, rounded up to whole seconds
    assert (e.status, e.code, e.headers["Retry-After"]) == (429, "rate_limit_exceeded", "1")
    assert e.type == "rate_limit_error"
    clock.t += 0.5
    admit(adm)
    admit(adm, key="other")  # another key has its own bucket


def test_token_quota_reserves_prompt_plus_max_tokens_and_refunds_what_was_not_generated():
    clock = Clock()
    cfg = AdmissionConfig(limits={"tokens_per_minute": 600}, keys={"big": {"tokens_per_minute": 6000}})
    adm = Admission(cfg, clock)  # 600 per minute: 10 tokens per second
    t = admit(adm, prompt=100, new=400)  # reserves 500: 100 left
    e = refusal(lambda: admit(adm, prompt=50, new=100))  # needs 150: 50 short, 5 s at 10/s
    assert (e.status, e.code, e.headers["Retry-After"]) == (429, "tokens_quota_exceeded", "5")
    admit(adm, key="big", prompt=100, new=400)  # another key, its own (larger) quota
    adm.release(t, completion_tokens=20)  # 380 of the 400 reserved never generated: given back
    admit(adm, prompt=50, new=100)  # 480 - 150 = 330 left
    assert adm._token_buckets["k"].level == pytest.approx(330)
    clock.t += 60  # a minute later the bucket is full again, never fuller
    assert adm._token_buckets["k"].wait_for(600, clock()) == 0
    assert adm._token_buckets["k"].level == 600
    e = refusal(lambda: admit(adm, prompt=500, new=101))  # 601 can never fit a 600 bucket
    assert e.status == 400 and e.param == "max_tokens" and "limit of 600 tokens per minute" in e.message
    assert adm.rejections == {"quota": 1}


def test_a_refused_request_takes_nothing_from_its_buckets():
    clock = Clock()
    cfg = AdmissionConfig(max_waiting=1, limits={"requests_per_second": 1, "tokens_per_minute": 60})
    adm = Admission(cfg, clock)
    admit(adm, key="a", prompt=5, new=5)
    refusal(lambda: admit(adm, key="b", prompt=5, new=5))  # 503: the queue is full
    adm.waiting["m"] = 0  # pretend the first request started (ledger only)
    admit(adm, key="b", prompt=5, new=5)  # b's buckets were untouched by the refusal


def test_config_names_priorities_and_rejects_bad_limits():
    cfg = ServerConfig(admission={"priority_classes": {"interactive": 0, "batch": 10, "offline": 20},
                                  "max_waiting_per_priority": {"offline": 4, "3": 2}})
    adm = cfg.admission
    assert adm.max_waiting_per_priority == {20: 4, 3: 2}
    assert [adm.resolve_priority(v) for v in ("batch", "offline", "-7", 5)] == [10, 20, -7, 5]
    with pytest.raises(ConfigError, match=r"unknown priority 'urgent'.*interactive \(0\), batch \(10\)"):
        adm.resolve_priority("urgent")
    with pytest.raises(ConfigError, match="tokens_per_minute must be > 0"):
        ServerConfig(admission={"limits": {"tokens_per_minute": 0}})
    with pytest.raises(ConfigError, match="unknown key"):
        ServerConfig(admission={"max_queue": 3})
    with pytest.raises(ConfigError, match="must be an integer"):
        AdmissionConfig(priority_classes={"x": "high"})
