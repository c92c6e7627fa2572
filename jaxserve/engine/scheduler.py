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
streams already running for more than one chunk. When a decode step needs a page
and none is free, the sequence that `order_key` ranks last is preempted by
recompute: its pages are freed and it goes back to waiting with its output so far,
to be prefilled again later. When every batch slot is taken and a waiting sequence
is more urgent than a running one (a lower priority value), the running one ranked
last is preempted the same way to free its slot, at most `max_preemptions` times.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxserve.engine.pages import PagePool
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


@dataclasses.dataclass
class ScheduledBatch:
    items: list[ScheduledItem]
    decode: bool
    preempted: list[Sequence]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: PagePool, order_key: Callable[[Sequence], object] = fcfs):
        self.cfg = cfg
        self.pool = pool
        self.order_key = order_key
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._last_was_prefill = False
        self.num_preemptions = 0

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
        self.pool.release(seq.pages)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def preempt(self, seq: Sequence) -> None:
        """Recompute mode: drop the cache, keep the tokens, queue again."""
        self.running.remove(seq)
        self.pool.release(seq.pages)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # The decision -----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        prefill_ready = len(decoding) < len(self.running) or (self.waiting and (
            len(self.running) < self.cfg.max_num_seqs or self._urgent_waiting()))
        if prefill_ready and not (self._last_was_prefill and decoding):
            batch = self._schedule_prefill()
            if batch.items:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        if decoding:
            return self._schedule_decode()
        return None

    def _schedule_prefill(self) -> ScheduledBatch:
        cfg = self.cfg
        items: list[ScheduledItem] = []
        budget = cfg.max_prefill_tokens
        longest = 0

        def fits(length: int) -> bool:
            padded_rows = len(items) + 1
            return (padded_rows <= cfg.max_prefill_seqs
                    and padded_rows * max(longest, length) <= budget)

        # Sequences already holding pages and mid-prompt continue first.
        for seq in sorted((s for s in self.running if s.num_uncomputed > 1), key=self.order_key):
            length = min(seq.num_uncomputed, cfg.max_prefill_chunk)
            if not fits(length):
                break
            if not self.pool.grow(seq.pages, seq.num_computed + length):
                break
            items.append(ScheduledItem(seq, seq.num_computed, length))
            longest = max(longest, length)

        # Then new (or preempted) sequences, while slots, pages and budget allow.
        admitted = []
        for seq in sorted(self.waiting, key=self.order_key):
            if len(self.running) + len(admitted) >= cfg.max_num_seqs and not self._free_slot_for(seq, items):
                break
            length = min(seq.num_uncomputed, cfg.max_prefill_chunk)
            if not fits(length):
                break
            need = self.pool.pages_needed(length)
            if not self.pool.can_allocate(need + cfg.watermark_pages) and (self.running or admitted):
                break
            if not self.pool.grow(seq.pages, length):
                break
            admitted.append(seq)
            items.append(ScheduledItem(seq, 0, length))
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
        busy = {id(it.seq) for it in items}
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
