"""Page pool and scheduler bookkeeping, driven by hypothesis through random sequences of
add / schedule / run / finish / abort against a small pool. After every action: no page
is owned by two sequences, the pool's used count equals the pages sequences hold, each
owned page has reference count 1, and a running sequence holds enough pages for the
tokens it has computed. At the end everything is finished and no page is left in use."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.engine.pages import OutOfPages, PagePool
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig, by_priority
from jaxserve.engine.sequence import SamplingParams, Sequence, Status


def test_pool_allocate_free_and_share():
    pool = PagePool(4, 16)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    pool.share(a[0])
    pool.free(a)
    assert pool.num_used == 1 and pool.refcount(a[0]) == 1  # still shared once
    pool.free([a[0]])
    assert pool.num_used == 0
    with pytest.raises(ValueError):
        pool.free([a[0]])


def test_grow_takes_pages_as_tokens_arrive():
    pool = PagePool(8, 4)
    pages: list[int] = []
    assert pool.grow(pages, 1) and len(pages) == 1
    assert pool.grow(pages, 4) and len(pages) == 1  # still fits the first page
    assert pool.grow(pages, 5) and len(pages) == 2
    assert not pool.grow(pages, 100) and len(pages) == 2  # no partial allocation
    pool.release(pages)
    assert pages == [] and pool.num_used == 0


def run_step(sched: Scheduler, pool: PagePool):
    """Schedule, then do what the engine does with the result (minus the device)."""
    batch = sched.schedule()
    if batch is None:
        return None
    for it in batch.items:
        seq = it.seq
        assert seq.status is Status.RUNNING
        assert len(seq.pages) * pool.page_size >= it.start + it.length
        seq.num_computed = it.start + it.length
        if it.samples:
            seq.output_ids.append(7)
            if len(seq.output_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
    return batch


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool(12, 4)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=2, max_prefill_chunk=8,
                                               max_prefill_tokens=16, watermark_pages=1, preemption_mode="auto",
                                               swap_pages=6, swap_min_tokens=6), self.pool, by_priority)
        self.seqs: list[Sequence] = []
        self.n = 0

    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 12), priority=st.integers(0, 2))
    def add(self, prompt_len, max_tokens, priority):
        self.n += 1
        seq = Sequence(f"r{self.n}", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                       priority=priority, arrival=float(self.n))
        self.seqs.append(seq)
        self.sched.add(seq)

    @rule()
    def step(self):
        run_step(self.sched, self.pool)

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data):
        live = [s for s in self.seqs if not s.is_finished]
        self.sched.finish(data.draw(st.sampled_from(live)), "abort")

    @invariant()
    def pages_owned_once_and_none_leaked(self):
        owned = [p for s in self.seqs for p in s.pages]
        assert len(owned) == len(set(owned))
        assert len(owned) == self.pool.num_used
        assert all(self.pool.refcount(p) == 1 for p in owned)
        for s in self.seqs:
            if s.status is Status.RUNNING:
                assert s.num_computed <= len(s.pages) * self.pool.page_size
            else:
                assert s.pages == []

    def teardown(self):
        for _ in range(2000):
            if not self.sched.has_work:
                break
            self.step()
        assert not self.sched.has_work, "requests did not all complete"
        assert self.pool.num_used == 0


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_scheduler_bookkeeping = SchedulerMachine.TestCase


def test_an_urgent_arrival_skips_the_decode_turn_and_goes_before_a_long_prompts_chunk():
    """A batch stream decodes and a long batch prompt is mid-prefill (8-token chunks, one
    sequence per prefill step). An interactive request (priority 0) arriving right after a
    prefill step is prefilled in the very next step, before the long prompt's next chunk;
    then decode and the long prompt's chunks alternate again."""
    pool = PagePool(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=1, max_prefill_chunk=8, max_prefill_tokens=8),
                      pool, by_priority)
    stream = Sequence("stream", [3] * 5, SamplingParams(max_tokens=50), priority=10, arrival=1.0)
    long = Sequence("long", [4] * 30, SamplingParams(max_tokens=50), priority=10, arrival=2.0)
    urgent = Sequence("urgent", [5] * 6, SamplingParams(max_tokens=50), priority=0, arrival=3.0)

    def step():
        batch = run_step(sched, pool)
        return [(it.seq.request_id, it.length) for it in batch.items]

    sched.add(stream)
    assert step() == [("stream", 5)]
    sched.add(long)
    assert step() == [("stream", 1)]
    assert step() == [("long", 8)]  # the decode turn is now due
    sched.add(urgent)
    assert step() == [("urgent", 6)]  # ... but the interactive request outranks every stream
    assert step() == [("urgent", 1), ("stream", 1)]
    assert step() == [("long", 8)]
    assert step() == [("urgent", 1), ("stream", 1)]


def test_a_device_that_reports_memory_gets_the_fraction_of_what_is_free(monkeypatch):
    """A GPU-like device (memory_stats with a 10 GiB limit, 2 GiB in use by the weights): the
    budget is exactly the fraction of the 8 GiB left, and kv_cache_memory_gib is ignored."""
    import jax

    from jaxserve.config import EngineConfig
    from jaxserve.engine import engine

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 10 * 2**30, "bytes_in_use": 2 * 2**30}

    monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
    assert engine.kv_budget_bytes(EngineConfig(kv_cache_memory_gib=0.5, kv_cache_memory_fraction=0.25)) == 2 * 2**30
    assert engine.kv_budget_bytes(EngineConfig(kv_cache_memory_gib=0.5)) == 2**29  # no fraction: the GiB


def test_the_kv_capacity_refusal_names_the_capacity_at_its_exact_edge():
    from jaxserve.engine.limits import RequestLimits
    from jaxserve.engine.sequence import InvalidRequest

    limits = RequestLimits(vocab_size=100, max_model_len=4096, pool_tokens=64)
    limits.check_request(list(range(10)), 54)  # 64 tokens: exactly what the cache holds
    with pytest.raises(InvalidRequest, match=r"^the KV cache holds 64 tokens; the prompt has 10 tokens and "
                                             r"max_tokens is 55$"):
        limits.check_request(list(range(10)), 55)


def test_kv_budget_from_gib_or_a_fraction_of_device_memory():
    """CPUs report no memory size, so a fraction falls back to the GiB budget; a bad fraction is refused."""
    import jax

    from jaxserve.config import ConfigError, EngineConfig
    from jaxserve.engine.engine import kv_budget_bytes

    assert kv_budget_bytes(EngineConfig(kv_cache_memory_gib=0.5)) == 2**29
    assert jax.local_devices()[0].memory_stats() is None  # this CPU reports nothing: the GiB budget
    cfg = EngineConfig(kv_cache_memory_gib=0.5, kv_cache_memory_fraction=0.5)
    assert kv_budget_bytes(cfg) == 2**29
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="kv_cache_memory_fraction"):
            EngineConfig(kv_cache_memory_fraction=bad)


@pytest.mark.parametrize("mode", ["recompute", "auto"])
def test_prompts_all_mid_prefill_with_a_dry_pool_still_finish(mode):
    """8 pages of 4 tokens; two prompts of 20 and 24 tokens prefill side by side in 8-token
    chunks until they hold all 8 pages, both still mid-prompt. The earlier one's next chunk
    preempts the later one (found by the bookkeeping machine above: before, neither could
    grow, no decode step was possible, and nothing ever ran again)."""
    pool = PagePool(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=2, max_prefill_chunk=8, max_prefill_tokens=16,
                                      watermark_pages=0, preemption_mode=mode, swap_pages=8, swap_min_tokens=8),
                      pool, by_priority)
    a = Sequence("a", [3] * 20, SamplingParams(max_tokens=4), arrival=1.0)
    b = Sequence("b", [4] * 24, SamplingParams(max_tokens=4), arrival=2.0)
    sched.add(a)
    sched.add(b)
    run_step(sched, pool)
    run_step(sched, pool)
    assert pool.num_free == 0 and a.num_uncomputed > 1 and b.num_uncomputed > 1
    for _ in range(50):
        if not sched.has_work:
            break
        run_step(sched, pool)
    assert not sched.has_work and pool.num_used == 0
    assert len(a.output_ids) == 4 and len(b.output_ids) == 4 and sched.num_preemptions >= 1
