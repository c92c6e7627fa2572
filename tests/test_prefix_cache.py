"""Automatic prefix caching: the pool's index and LRU, the scheduler driving it under
hypothesis (with a model of what every page holds), and the engine's outputs with the
cache on and off."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.pages import PagePool
from jaxserve.engine.prefix_cache import PrefixCache
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig, by_priority
from jaxserve.engine.sequence import SamplingParams, Sequence, Status
from test_pages import SchedulerMachine


def seq_of(rid, tokens, salt=None, max_tokens=4, arrival=0.0):
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival=arrival, cache_salt=salt)


def test_released_pages_stay_cached_count_as_free_and_are_evicted_tail_first():
    pool = PagePool(6, 4)
    cache = PrefixCache(pool, "model")
    a = seq_of("a", list(range(1, 14)))  # 13 tokens: 3 full pages and one partial
    pool.grow(a.pages, 13)
    a.num_computed = 13
    cache.commit(a)
    assert a.num_indexed_pages == 3 and pool.num_indexed == 3
    head, tail, partial = a.pages[0], a.pages[2], a.pages[3]
    pool.release(a.pages)
    assert pool.num_used == 0 and pool.num_cached == 3 and pool.num_free == 6
    assert pool.refcount(head) == 0 and pool.hash_of(partial) is None  # the partial page is simply free

    b = seq_of("b", list(range(1, 10)) + [99] * 4)  # shares two full pages with a
    assert cache.match(b) == [head, a_second := pool.lookup(cache.hashes(b, 2)[1])] and a_second != tail
    assert pool.pages_to_take(cache.match(b), 13) == 2 + 2  # both matched pages are cached, two more new
    assert cache.acquire(b, cache.match(b)) == 8 and b.cached_tokens == 8
    assert pool.num_used == 2 and pool.num_cached == 1  # only a's third page is still cached
    assert cache.queries == 13 and cache.hits == 8

    # Three free pages, then the cached one: allocation takes free pages first, then evicts.
    got = pool.allocate(3)
    assert tail not in got and pool.num_cached == 1
    assert pool.allocate(1) == [tail] and pool.evictions == 1 and pool.lookup(cache.hashes(a, 3)[2]) is None


def test_tail_pages_are_evicted_before_head_pages():
    pool = PagePool(4, 2)
    cache = PrefixCache(pool, "m")
    a = seq_of("a", [1, 2, 3, 4, 5, 6, 7, 8])
    pool.grow(a.pages, 8)
    a.num_computed = 8
    cache.commit(a)
    order = list(a.pages)
    pool.release(a.pages)
    assert [pool.allocate(1)[0] for _ in range(4)] == order[::-1]


def test_a_full_hit_still_computes_the_last_token_and_salts_separate_tenants():
    pool = PagePool(8, 4)
    cache = PrefixCache(pool, "m")
    a = seq_of("a", list(range(1, 9)))  # exactly two pages
    pool.grow(a.pages, 8)
    a.num_computed = 8
    cache.commit(a)
    again = seq_of("again", list(range(1, 9)))
    assert len(cache.match(again)) == 1  # the last page is recomputed, so one token is
    assert cache.match(seq_of("salted", list(range(1, 9)), salt="tenant-2")) == []
    other = PrefixCache(pool, "another model")
    assert other.match(seq_of("x", list(range(1, 9)))) == []


def test_a_failed_step_forgets_the_index():
    pool = PagePool(4, 2)
    cache = PrefixCache(pool, "m")
    a = seq_of("a", [1, 2, 3, 4, 5])
    pool.grow(a.pages, 5)
    a.num_computed = 5
    cache.commit(a)
    pool.release(a.pages)
    assert pool.num_cached == 2
    pool.clear_index()
    assert pool.num_cached == 0 and pool.num_free == 4 and cache.match(seq_of("b", [1, 2, 3, 4, 5])) == []


# The scheduler, the pool and the cache under hypothesis ---------------------------------

STEMS = [list(range(10, 40)), list(range(50, 80))]


class PrefixMachine(SchedulerMachine):
    """Requests that share stems of random lengths, some salted, run by the real scheduler
    (auto preemption: recompute and swap) over a small pool. `slot[(page, offset)]` is what
    the simulated device wrote there: (salt, the whole token chain up to that position).
    The engine's host side is mimicked: copies before the step, writes of each item, then
    the postprocess that appends a token (a function of the chain, as greedy decoding is)
    and indexes computed pages. Aborts and the final drain are test_pages' machine's."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(14, 4)
        self.cache = PrefixCache(self.pool, "m")
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=2, max_prefill_chunk=8,
                                               max_prefill_tokens=16, watermark_pages=1, preemption_mode="auto",
                                               swap_pages=8, swap_min_tokens=6), self.pool, by_priority,
                               cache=self.cache)
        self.seqs: list[Sequence] = []
        self.slot: dict[tuple[int, int], tuple] = {}
        self.host: dict[int, list] = {}
        self.n = 0

    @rule(stem=st.integers(0, 1), shared=st.integers(0, 30), tail=st.integers(0, 6), salt=st.sampled_from([None, "t"]),
          max_tokens=st.integers(1, 10), priority=st.integers(0, 2))
    def add(self, stem, shared, tail, salt, max_tokens, priority):
        self.n += 1
        tokens = STEMS[stem][:shared] + [100 + self.n] * tail or [7]
        seq = Sequence(f"r{self.n}", tokens, SamplingParams(max_tokens=max_tokens), priority=priority,
                       arrival=float(self.n), cache_salt=salt)
        self.seqs.append(seq)
        self.sched.add(seq)

    def _write(self, page: int, offset: int, value) -> None:
        # Nobody else holds a page being written, and the index never lists one.
        assert self.pool.refcount(page) == 1 and self.pool.hash_of(page) is None, (page, offset)
        self.slot[(page, offset)] = value

    @rule()
    def step(self):
        batch = self.sched.schedule()
        if batch is None:
            return
        ps = self.pool.page_size
        for seq, pages in batch.swap_out:
            self.host[id(seq)] = [[self.slot.get((p, o)) for o in range(ps)] for p in pages]
        for seq in batch.swap_in:
            data = self.host.pop(id(seq))
            for i in range(seq.swap_skip, seq.swap_pages):
                for o in range(ps):
                    self._write(seq.pages[i], o, data[i][o])
            seq.swap_pages = seq.swap_skip = 0
        for it in batch.items:
            seq, tokens = it.seq, it.seq.tokens
            assert len(seq.pages) * ps >= it.start + it.length
            for pos in range(it.start, it.start + it.length):
                self._write(seq.pages[pos // ps], pos % ps, (seq.cache_salt, tuple(tokens[:pos + 1])))
        for it in batch.items:
            seq = it.seq
            seq.num_computed = it.start + it.length
            if it.samples:
                seq.output_ids.append(1 + sum(seq.tokens) % 5)
                if len(seq.output_ids) >= seq.params.max_tokens:
                    self.sched.finish(seq, "length")
                    continue
            self.cache.commit(seq)

    @invariant()
    def pages_owned_once_and_none_leaked(self):  # the parent's invariant, for pages that may be shared
        pool = self.pool
        held: dict[int, int] = {}
        for s in self.seqs:
            assert len(s.pages) == len(set(s.pages))
            for p in s.pages:
                held[p] = held.get(p, 0) + 1
            if s.status is not Status.RUNNING:
                assert s.pages == []
        free, cached = set(pool._free), set(pool._cached)
        assert len(free) == len(pool._free) and not free & cached and not free & set(held)
        assert not cached & set(held)
        assert len(free) + len(cached) + len(held) == pool.num_pages
        assert all(pool.refcount(p) == n for p, n in held.items())
        assert all(pool.refcount(p) == 0 for p in free | cached)
        assert cached <= set(pool._hash_of)

    @invariant()
    def pages_hold_exactly_their_chains(self):
        ps = self.pool.page_size
        for s in self.seqs:
            if s.status is not Status.RUNNING or s in self.sched._swap_in:
                continue
            tokens = s.tokens
            for pos in range(s.num_computed):
                assert self.slot[(s.pages[pos // ps], pos % ps)] == (s.cache_salt, tuple(tokens[:pos + 1]))
        for page, h in self.pool._hash_of.items():
            salt, chain = self.slot[(page, ps - 1)]
            probe = Sequence("probe", list(chain), SamplingParams(), cache_salt=salt)
            assert len(chain) % ps == 0 and self.cache.hashes(probe, len(chain) // ps)[-1] == h
            for o in range(ps):
                assert self.slot[(page, o)] == (salt, chain[:len(chain) - ps + o + 1])


PrefixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_prefix_cache_bookkeeping = PrefixMachine.TestCase


# The engine: outputs with the cache on and off ---------------------------------------------

SMALL = dict(max_num_seqs=32, decode_batch_buckets=(1, 8, 32), context_buckets=(256,), max_model_len=256,
             prefill_length_buckets=(32, 128), prefill_batch_buckets=(1, 4))


def shared_prefix_workload(seed=0):
    """32 prompts over one 230-token base: prefixes ending mid-page, on page boundaries, longer
    than the largest prefill chunk (128), equal to a whole earlier prompt, and none at all;
    half greedy, half seeded sampling."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 49152) for _ in range(230)]
    prompts = []
    for i, n in enumerate([0, 5, 16, 16, 31, 32, 33, 47, 64, 64, 100, 129, 130, 144, 160, 200, 216, 230,
                           1, 15, 17, 48, 80, 150, 176, 192, 208, 222]):
        prompts.append(base[:n] + [rng.randrange(3, 49152) for _ in range(rng.randint(1 if n else 3, 20))])
    prompts.append(list(prompts[8]))  # a whole earlier prompt: 64 + tail
    prompts.append(base[:32])  # a prefix that is exactly two pages and nothing more
    prompts.append(prompts[12] + [7, 8, 9])  # an earlier prompt and more
    prompts.append(list(prompts[17]))
    assert len(prompts) == 32 and max(len(p) for p in prompts) + 8 <= 256
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, ignore_eos=True)
              for i in range(32)]
    return prompts, params


def run_alone(engine, prompts, params):
    outs = []
    for p, sp in zip(prompts, params):
        seq = engine.add_request(p, sp)
        engine.run_until_done()
        outs.append(seq.output_ids)
    return outs


def run_batched(engine, prompts, params, per_step=4):
    seqs, pending = [], list(zip(prompts, params))
    while pending or engine.has_unfinished:
        for p, sp in pending[:per_step]:
            seqs.append(engine.add_request(p, sp))
        pending = pending[per_step:]
        engine.step()
    return [s.output_ids for s in seqs]


def random_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return (Engine(tiny_model_dir, EngineConfig(**SMALL, enable_prefix_caching=False), warmup=False),
            Engine(tiny_model_dir, EngineConfig(**SMALL), warmup=False))


@pytest.fixture
def cold(engines):
    """The caching engine with nothing cached."""
    engines[1].pool.clear_index()
    return engines[1]


def test_outputs_do_not_depend_on_the_cache(engines):
    off, on = engines
    assert off.cache is None and on.cache is not None
    prompts, params = shared_prefix_workload()
    expected = run_alone(off, prompts, params)
    assert len({tuple(o) for o in expected}) > 16  # sampling sampled, prompts differ

    assert run_alone(on, prompts, params) == expected
    seqs_hit = on.cache.hits
    assert seqs_hit > 0 and on.pool.num_used == 0 and on.pool.num_cached > 0
    assert run_batched(on, prompts, params) == expected  # now nearly everything is cached
    assert run_batched(off, prompts, params) == expected
    on.pool.clear_index()
    assert run_batched(on, prompts, params, per_step=32) == expected  # all at once, cold cache
    assert on.pool.num_used == 0


def test_cached_tokens_are_whole_pages_and_never_the_last_token(cold):
    on = cold
    base = random_ids(1, 100)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = on.add_request(base[:80], greedy)
    on.run_until_done()
    assert first.cached_tokens == 0
    cases = [(base[:40], 32), (base[:80], 64), (base[:81], 80), (base[:90], 80), (base[:5], 0)]
    for prompt, cached in cases:
        seq = on.add_request(prompt, greedy)
        on.run_until_done()
        assert seq.cached_tokens == cached, (len(prompt), seq.cached_tokens)


def test_choices_and_bursts_of_one_prompt_compute_it_once(cold):
    """Four requests with one 130-token prompt arrive together: the first prefills it (a
    128-token chunk, then 2), the other three wait a step for its pages and share them."""
    on = cold
    hits0 = on.cache.hits
    prompt = random_ids(2, 130)
    seqs = [on.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for _ in range(4)]
    while not all(s.output_ids for s in seqs):
        on.step()
    tables = [s.pages[:8] for s in seqs]
    assert all(t == tables[0] for t in tables)
    assert all(on.pool.refcount(p) == 4 for p in tables[0])
    assert on.cache.hits - hits0 == 3 * 128
    on.run_until_done()
    assert len({tuple(s.output_ids) for s in seqs}) == 1


def test_different_cache_salts_share_no_page(cold):
    on = cold
    prompt = random_ids(3, 100)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def shared_pages(salt_a, salt_b):
        a = on.add_request(prompt, greedy, cache_salt=salt_a)
        on.step()
        b = on.add_request(prompt, greedy, cache_salt=salt_b)
        while not b.output_ids:
            on.step()
        shared = len(set(a.pages) & set(b.pages))
        on.run_until_done()
        assert a.output_ids == b.output_ids
        return shared, b.cached_tokens

    assert shared_pages("tenant-a", "tenant-b") == (0, 0)
    assert shared_pages(None, "tenant-d") == (0, 0)  # every pair is new to the cache
    assert shared_pages("tenant-c", "tenant-c") == (6, 96)
    assert shared_pages(None, None) == (6, 96)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_resume_on_their_cached_prefix(tiny_model_dir, mode):
    """A 16-page pool under eight requests sharing a 48-token prefix preempts (by recompute or
    by swap); greedy outputs equal those of an ample pool without the cache, and resumed
    sequences find pages of their own still cached."""
    opts = dict(max_num_seqs=8, decode_batch_buckets=(1, 8), context_buckets=(128,), max_model_len=128,
                prefill_length_buckets=(32,), prefill_batch_buckets=(1, 4))
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ample = Engine(tiny_model_dir, EngineConfig(**opts, enable_prefix_caching=False), warmup=False)
    expected = run_batched(ample, prompts, [params] * 8, per_step=8)
    small = Engine(tiny_model_dir, EngineConfig(num_pages=16, preemption_mode=mode, swap_space_gib=0.01, **opts),
                   warmup=False)
    resumed_hits = []
    acquire = small.cache.acquire

    def watch(seq, pages, *, count=True):
        if seq.num_preemptions and pages:
            resumed_hits.append(len(pages))
        return acquire(seq, pages, count=count)

    small.cache.acquire = watch
    assert run_batched(small, prompts, [params] * 8, per_step=8) == expected
    sched = small.scheduler
    assert sched.preemptions[mode] > 0 and resumed_hits
    assert small.pool.num_used == 0 and sched.swap_used == 0


def test_a_failed_device_step_fails_its_requests_and_empties_the_cache(engines):
    """A call that raises ends the requests in it with an error and forgets every cached page
    (their contents are no longer known); the next request computes from scratch and gets
    the same answer as before."""
    _, on = engines
    prompt = random_ids(4, 70)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    before = on.add_request(prompt, greedy)
    on.run_until_done()
    assert on.pool.num_cached > 0
    launch = on.runner.launch

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    on.runner.launch = broken
    try:
        failed = on.add_request(prompt, greedy)
        on.run_until_done()
    finally:
        on.runner.launch = launch
    assert failed.finish_reason == "error" and failed.cached_tokens == 64
    assert on.pool.num_indexed == 0 and on.pool.num_cached == 0 and on.pool.num_used == 0
    after = on.add_request(prompt, greedy)
    on.run_until_done()
    assert after.cached_tokens == 0 and after.output_ids == before.output_ids
