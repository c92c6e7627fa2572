"""Which sequences run in the next step: queues, page allocation, chunking, preemption.

Never imports jax: it moves plain Sequence objects between two queues and hands
the runner a list of (sequence, start, length) items.

    waiting  requests not yet holding pages (new, or preempted and to be recomputed),
             served in the order of `order_key` (FCFS by default; pluggable so that
             priority classes can reorder it)
    running  sequences holding pages: mid-prefill (more than one token uncomputed)
             or decoding (exactly one)

Each step is either a prefill step (chunks of prompts, up to a batch and token
budget) or a decode step (one token for every decoding sequence). When both kinds
of work exist the scheduler alternates, so a long prompt arriving never stalls the
streams already running for more than one chunk; only a request more urgent than
every running stream skips its turn, so its first token waits for one step at most. When a decode step needs a page
and none is free, the sequence that `order_key` ranks last is preempted. When every
batch slot is taken and a waiting sequence is more urgent than a running one (a
lower priority value), the running one ranked last is preempted to free its slot,
at most `max_preemptions` times per sequence (so nothing thrashes).

A preemption is one of two kinds, per `preemption_mode`:

    recompute  free the pages; the sequence goes back to waiting with its tokens so
               far and is prefilled again later (costs compute, no memory)
    swap       its computed pages are copied to a host swap space of `swap_pages`
               pages, then freed; on resume it gets new pages, the copy goes back and
               it continues where it stopped (costs two copies and host memory)
    auto       swap when the sequence has at least `swap_min_tokens` computed tokens
               (recomputing those would take long prefill steps) and the swap space
               has room; recompute otherwise

The scheduler only decides: it lists the copies in the batch (`swap_out` before
`swap_in`, both before the step), and the engine has the runner make them.

With a prefix cache (engine/prefix_cache.py) a waiting sequence starts with the cached
pages of its prefix and prefills only the rest; cached pages count as free pages. A
swapped sequence resumes on whatever of its prefix is still cached and copies back only
the rest. Every sequence that lets go of its pages first indexes its full computed ones.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from jaxserve.engine.pages import PagePool
from jaxserve.engine.prefix_cache import PrefixCache
from jaxserve.engine.runner import ScheduledItem
from jaxserve.engine.sequence import Sequence, Status


def fcfs(seq: Sequence):
    """First come, first served."""
    return seq.arrival


def by_priority(seq: Sequence):
    """Lower priority values first (as vLLM), then first come, first served."""
    return seq.priority, seq.arrival


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int
    max_prefill_seqs: int  # rows of one prefill step
    max_prefill_chunk: int  # tokens of one sequence in one prefill step
    max_prefill_tokens: int  # rows x padded length of one prefill step
    watermark_pages: int = 1  # pages kept free at admission, so running sequences can grow
    max_preemptions: int = 3  # a sequence preempted this often is not chosen for a slot again
    preemption_mode: str = "recompute"  # recompute | swap | auto
    swap_pages: int = 0  # host swap space, in pages (0: recompute only)
    swap_min_tokens: int = 256  # auto mode swaps sequences with at least this many computed tokens

    def __post_init__(self):
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")


@dataclasses.dataclass
class ScheduledBatch:
    items: list[ScheduledItem]
    decode: bool
    preempted: list[Sequence]
    # Copies the runner makes before the step, in this order: device pages -> host for each
    # (sequence, pages) swapped out, then host -> the sequence's new pages for each swapped in.
    swap_out: list[tuple[Sequence, list[int]]] = dataclasses.field(default_factory=list)
    swap_in: list[Sequence] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: PagePool, order_key: Callable[[Sequence], object] = fcfs,
                 cache: PrefixCache | None = None):
        self.cfg = cfg
        self.pool = pool
        self.cache = cache
        self.order_key = order_key
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # preempted by swap: KV on the host, no device pages
        self.swap_used = 0  # host pages held by `swapped`
        self.preemptions = {"recompute": 0, "swap": 0}
        self._last_was_prefill = False
        self._swap_out: list[tuple[Sequence, list[int]]] = []  # copies decided during this schedule()
        self._swap_in: list[Sequence] = []

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    # Queue management -----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of whichever queue holds it and free its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swap_used -= seq.swap_pages
            seq.swap_pages, seq.swap_data = 0, None
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence off the device, by swap or by recompute (see the module doc)."""
        self.running.remove(seq)
        if seq in self._swap_in:  # swapped in during this very schedule(): its host copy is still there
            self._swap_in.remove(seq)
            self._release(seq, commit=False)  # its new pages were never written
            self._park(seq, seq.swap_pages)
            return
        seq.num_preemptions += 1
        seq.preempted_at.append(time.monotonic())
        mode = self._mode_for(seq)
        self.preemptions[mode] += 1
        if mode == "swap":
            n = self.pool.pages_needed(seq.num_computed)
            self._swap_out.append((seq, seq.pages[:n]))
            self._release(seq)
            self._park(seq, n)
        else:
            self._release(seq)
            seq.num_computed = 0
            self.add(seq)

    def _release(self, seq: Sequence, commit: bool = True) -> None:
        """Free `seq`'s pages; with a prefix cache its full computed pages stay cached."""
        if self.cache is not None and commit:
            self.cache.commit(seq)
        self.pool.release(seq.pages)
        seq.num_indexed_pages = 0
        seq.draft_computed, seq.draft_fed = 0, []  # a draft model's cache of it went with the pages

    def _mode_for(self, seq: Sequence) -> str:
        mode = self.cfg.preemption_mode
        n = self.pool.pages_needed(seq.num_computed)
        if mode == "recompute" or n == 0 or self.swap_used + n > self.cfg.swap_pages:
            return "recompute"
        if mode == "auto" and seq.num_computed < self.cfg.swap_min_tokens:
            return "recompute"
        return "swap"

    def _park(self, seq: Sequence, num_pages: int) -> None:
        seq.status = Status.SWAPPED
        seq.swap_pages = num_pages
        self.swap_used += num_pages
        self.swapped.append(seq)

    def _resume_swapped(self) -> None:
        """Give swapped sequences new pages, most urgent first, while slots and pages allow and
        no waiting request is more urgent; the batch carries the host -> device copies."""
        for seq in sorted(self.swapped, key=self.order_key):
            if len(self.running) >= self.cfg.max_num_seqs:
                return
            if self.waiting and min(map(self.order_key, self.waiting)) < self.order_key(seq):
                return
            hit = self.cache.match(seq, seq.num_computed) if self.cache is not None else []
            taking = self.pool.pages_to_take(hit, seq.num_computed)
            if not self.pool.can_allocate(taking + self.cfg.watermark_pages) and self.running:
                return
            if not self.pool.can_allocate(taking):
                return
            if hit:
                self.cache.acquire(seq, hit, count=False)
            self.pool.grow(seq.pages, seq.num_computed)
            seq.swap_skip = min(len(hit), seq.swap_pages)
            self.swapped.remove(seq)
            self.swap_used -= seq.swap_pages
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._swap_in.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # The decision -----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch; None when there is nothing to run. A batch may have no items
        and only copies (a sequence swapped itself out because the pool ran dry)."""
        self._swap_out, self._swap_in = [], []
        self._resume_swapped()
        batch = self._decide()
        if batch is None and (self._swap_out or self._swap_in):
            batch = ScheduledBatch(items=[], decode=True, preempted=[])
        if batch is not None:
            batch.swap_out, batch.swap_in = self._swap_out, self._swap_in
        return batch

    def _decide(self) -> ScheduledBatch | None:
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        prefill_ready = len(decoding) < len(self.running) or (self.waiting and (
            len(self.running) < self.cfg.max_num_seqs or self._urgent_waiting()))
        # Alternate with decode steps, except for a request more urgent than every stream.
        alternate = self._last_was_prefill and decoding and not self._outranks(decoding)
        if prefill_ready and not alternate:
            batch = self._schedule_prefill()
            if batch.items:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        if decoding:
            return self._schedule_decode()
        return None

    def _grow_preempting(self, seq: Sequence, num_tokens: int, items: list[ScheduledItem]) -> bool:
        """Pages for `seq`'s next chunk, preempting running sequences ranked after it while the
        pool is dry. Without this, prompts that are all mid-prefill can hold every page
        between them and none can take its next chunk: nothing would ever run again."""
        busy = {id(it.seq) for it in items}
        while not self.pool.grow(seq.pages, num_tokens):
            later = [s for s in self.running
                     if s is not seq and id(s) not in busy and self.order_key(s) > self.order_key(seq)]
            if not later:
                return False
            self.preempt(max(later, key=self.order_key))
        return True

    def _outranks(self, seqs: list[Sequence]) -> bool:
        """Some waiting sequence is more urgent (a lower priority value) than all of `seqs`."""
        return bool(self.waiting) and min(s.priority for s in self.waiting) < min(s.priority for s in seqs)

    def _schedule_prefill(self) -> ScheduledBatch:
        """Chunks in `order_key` order, mid-prompt sequences (holding pages) and waiting ones
        alike, so an urgent arrival goes before a less urgent prompt's next chunk. A waiting
        sequence that cannot start (no slot, no pages) lets no later waiting one overtake it,
        but mid-prompt ones still continue (they need no slot, and they end)."""
        cfg = self.cfg
        items: list[ScheduledItem] = []
        budget = cfg.max_prefill_tokens
        longest = 0

        def fits(length: int) -> bool:
            padded_rows = len(items) + 1
            return (padded_rows <= cfg.max_prefill_seqs
                    and padded_rows * max(longest, length) <= budget)

        mid = [s for s in self.running if s.num_uncomputed > 1]
        mid_ids = {id(s) for s in mid}
        cache = self.cache
        pending = cache.pending(mid) if cache is not None else set()
        # pages being scored: a scored prompt waits for the records of these, not for plain pages
        scoring = cache.pending([s for s in mid if s.logits_needed_from is not None]) if cache is not None else set()
        admitted: list[Sequence] = []
        blocked = False
        for seq in sorted(mid + self.waiting, key=self.order_key):
            if id(seq) in mid_ids:
                length = min(seq.num_uncomputed, cfg.max_prefill_chunk)
                if seq.status is not Status.RUNNING:
                    continue  # preempted in this very step to free a slot
                if not fits(length):
                    break
                if not self._grow_preempting(seq, seq.num_computed + length, items):
                    break
                items.append(ScheduledItem(seq, seq.num_computed, length))
            else:
                if blocked:
                    continue
                if cache is not None and seq.logits_needed_from is not None:
                    cache.find_scores(seq)  # prompt logprobs: records other prompts kept for its pages
                scored_from = seq.logits_needed_from  # prompt logprobs: no cached page past it
                hit = cache.match(seq, scored_from) if cache is not None else []
                if cache is not None and cache.waits(seq, len(hit), pending if scored_from is None else scoring):
                    continue  # its next page is being computed now: it shares that page a step later
                start = len(hit) * self.pool.page_size
                length = min(seq.num_tokens - start, cfg.max_prefill_chunk)
                if not fits(length):
                    break
                if len(self.running) + len(admitted) >= cfg.max_num_seqs and not self._free_slot_for(seq, items):
                    blocked = True
                    continue
                taking = self.pool.pages_to_take(hit, start + length)
                if (not self.pool.can_allocate(taking + cfg.watermark_pages) and (self.running or admitted)) \
                        or not self.pool.can_allocate(taking):
                    blocked = True
                    continue
                if cache is not None:
                    seq.num_computed = cache.acquire(seq, hit)
                    computing = cache.pending([seq])
                    pending.update(computing)
                    if seq.logits_needed_from is not None:
                        scoring.update(computing)
                self.pool.grow(seq.pages, start + length)
                admitted.append(seq)
                items.append(ScheduledItem(seq, start, length))
            longest = max(longest, length)
        for seq in admitted:
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
        return ScheduledBatch(items=items, decode=False, preempted=[])

    def _urgent_waiting(self) -> bool:
        """A waiting sequence is more urgent than some running one that may still be preempted."""
        preemptable = [s.priority for s in self.running if s.num_preemptions < self.cfg.max_preemptions]
        return bool(preemptable) and min(s.priority for s in self.waiting) < max(preemptable)

    def _free_slot_for(self, seq: Sequence, items: list[ScheduledItem]) -> bool:
        """All slots are taken: preempt the running sequence ranked last if `seq` is more urgent
        (a lower priority value; arrival order alone never preempts) and the victim is neither
        in this step nor already preempted max_preemptions times."""
        busy = {id(it.seq) for it in items} | {id(s) for s in self._swap_in}
        victims = [s for s in self.running if id(s) not in busy and s.num_preemptions < self.cfg.max_preemptions]
        victim = max(victims, key=self.order_key, default=None)
        if victim is None or not seq.priority < victim.priority:
            return False
        self.preempt(victim)
        return True

    def _schedule_decode(self) -> ScheduledBatch:
        preempted: list[Sequence] = []
        scheduled: list[Sequence] = []
        for seq in sorted((s for s in self.running if s.num_uncomputed == 1), key=self.order_key):
            if seq.status is not Status.RUNNING:
                continue  # preempted below to make room for an earlier sequence
            while not self.pool.grow(seq.pages, seq.num_tokens):
                victim = max((s for s in self.running if s is not seq and s not in scheduled),
                             key=self.order_key, default=None)
                if victim is None:
                    victim = seq
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                scheduled.append(seq)
            if len(scheduled) == self.cfg.max_num_seqs:
                break
        items = [ScheduledItem(s, s.num_computed, 1) for s in scheduled]
        return ScheduledBatch(items=items, decode=True, preempted=preempted)
