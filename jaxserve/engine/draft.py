"""The draft model of speculative decoding: a small model that proposes k tokens per sequence.

It runs on the target's machinery (a ModelRunner: the same model families, buckets and
compiled prefill steps) with its own KV cache, laid out over the *same page ids* as the
target's: a sequence's block table addresses both caches, so the draft needs no page
allocator, and preemption, swap and prefix caching move pages for both at once. The cache
is small because the draft model is (its layers x KV heads x head dim per page).

What the draft's cache holds is tracked per sequence: positions below
`Sequence.draft_computed` hold the draft's K/V of the sequence's own tokens, and
`Sequence.draft_fed` lists the drafts fed after them, which count once the sequence's tokens
turn out to equal them (`seen`). Whenever a sequence's pages change hands (preemption by
swap or recompute, finishing: Scheduler._release) both reset and the draft recomputes; a
shared prefix page is rewritten with the same K/V.

A proposal is one call per batch (`propose`): feed the one or two newest tokens the draft
has not seen (after a fully accepted step: the last draft and the bonus token), then draw
d_1 .. d_k one at a time in a loop on the device. The drafts come back to the host; the
distributions q_j they were drawn from [B, k, V] stay on the device for the verify call,
which judges them (speculative.accept_drafts). Longer gaps (a new sequence, or one that
decoded while the batch was too large to speculate) are first filled by the draft's
ordinary prefill calls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from jaxserve.engine.runner import ModelRunner, ScheduledItem, StepInputs, _bucket
from jaxserve.engine.sampler import SamplingArrays, argmax, gumbel_noise, probabilities
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.speculative import DRAFT_STREAM

FEED = 2  # tokens a propose call feeds before drafting (more are caught up by prefill first)


@struct.dataclass
class ProposeInputs:
    feed: StepInputs  # [B, FEED]: tokens the draft has not seen, the sequence's newest at last_index
    alloc: jax.Array  # [B] i32: tokens the row holds pages for (K/V past it is dropped); 0 = padding row


def seen(seq: Sequence) -> int:
    """Leading tokens of `seq` whose K/V the draft's cache holds."""
    n = seq.draft_computed
    for t in seq.draft_fed:
        if n >= seq.num_tokens or seq.token_at(n) != t:
            break
        n += 1
    return n


class DraftRunner(ModelRunner):
    """The draft model's parameters, KV cache and compiled calls: prefill (catching up) and
    propose (B, -FEED, P) for the batch sizes speculation runs at."""

    def __init__(self, model_cfg: ModelConfig, params: dict, cfg: EngineConfig, num_pages: int,
                 batches: tuple[int, ...], mesh=None, kv_scales=None):
        super().__init__(model_cfg, params, dataclasses.replace(cfg, speculative=SpeculativeConfig()), num_pages,
                         mesh, kv_scales=kv_scales)
        self.k = cfg.speculative.num_speculative_tokens
        self.propose_batches = batches
        self.prefill_batches = tuple(b for b in self.prefill_batches if b <= batches[-1]) or self.prefill_batches[:1]
        self.swap_enabled = False  # a swapped sequence's draft cache is recomputed, not copied
        self._jitted_propose = self._jit(self._propose_step)

    def buckets(self) -> list[tuple[int, int, int]]:
        prefill = [key for key in super().buckets() if key[1] > 0]
        return prefill + [(b, -FEED, p) for b in self.propose_batches for p in self.context_page_buckets]

    def _label(self, key: tuple[int, int, int]) -> str:
        return f"draft propose B={key[0]} P={key[2]}" if key[1] < 0 else "draft " + super()._label(key)

    def _lower(self, key: tuple[int, int, int]):
        if key[1] > 0:
            return super()._lower(key)
        params, kv, feed, samp = self._abstract_args(*key)
        inp = ProposeInputs(feed=feed, alloc=self._sds((key[0],), jnp.int32))
        return self._jitted_propose.lower(params, kv, inp, samp)

    def _propose_step(self, params, kv_cache, inp: ProposeInputs, sampling: SamplingArrays):
        """Feed inp.feed, then draw k drafts, each fed back to draw the next (the last is not
        fed). Draft j is drawn from q_j = sampler.probabilities (the request's sampling
        parameters on the draft's logits) with noise of DRAFT_STREAM at counter + j, so it
        is independent of the target's draws. Returns (drafts [B, k] i32, q [B, k, V] f32)
        and the cache."""
        feed, k = inp.feed, self.k
        hidden, kv_cache = self.model.forward_hidden(params, self.model_cfg, feed.tokens, self._meta(feed), kv_cache)
        B = hidden.shape[0]
        rows = jnp.arange(B)
        logits = self._logits(params, hidden[rows, feed.last_index])
        V = logits.shape[1]
        start = feed.context_lens  # position of d_1: the sequence's length

        def draw(j, logits, hist, drafts, qs):
            s = sampling.replace(counters=sampling.counters + j, history=hist)
            q = probabilities(logits, s)
            noisy = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf) + gumbel_noise(s, V, DRAFT_STREAM)
            d = jnp.where(s.temperature > 0, argmax(noisy), argmax(q))
            hist = hist.at[rows, start + j].set(d, mode="drop")  # the penalties of the next draft see it
            return d, hist, drafts.at[:, j].set(d), qs.at[:, j].set(q)

        def one(j, carry):
            kv, logits, hist, drafts, qs = carry
            d, hist, drafts, qs = draw(j, logits, hist, drafts, qs)
            logits, kv = self._forward_one(params, kv, d, start + j, inp.alloc, feed.block_tables)
            return kv, logits, hist, drafts, qs

        carry = (kv_cache, logits, sampling.history, jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k, V), jnp.float32))
        kv_cache, logits, hist, drafts, qs = jax.lax.fori_loop(0, k - 1, one, carry)
        _, _, drafts, qs = draw(k - 1, logits, hist, drafts, qs)
        return (drafts, qs), kv_cache

    def propose(self, items: list[ScheduledItem], active: list[bool]) -> tuple[np.ndarray, jax.Array]:
        """k drafts for each active row of a decode batch (each feeding its sequence's newest
        token, items[i].start): drafts [n, k] on the host (rows not active are zeros) and
        their distributions q [B, k, V] on the device, rows as the verify call's (same bucket)."""
        ps, k = self.page_size, self.k
        n = len(items)
        spans = []  # (seq, first position to feed, first position the propose call feeds)
        for it, on in zip(items, active):
            if on:
                seq, L = it.seq, it.seq.num_tokens
                a = seen(seq)
                spans.append((seq, a, min(max(a, L - FEED), L - 1)))
        self._catch_up([(seq, a, b) for seq, a, b in spans if a < b])
        B = _bucket(n, self.propose_batches)
        P = _bucket(min(-(-(max(it.seq.num_tokens for it in items) + k) // ps), self.max_pages_per_seq),
                    self.context_page_buckets)
        tokens, positions = np.zeros((B, FEED), np.int32), np.zeros((B, FEED), np.int32)
        slots = np.full((B, FEED), self.drop_slot, np.int32)
        tables = np.zeros((B, P), np.int32)
        ctx, last, alloc = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        rows = {id(it.seq): i for i, it in enumerate(items)}
        for seq, _, f in spans:
            i, L = rows[id(seq)], seq.num_tokens
            pages = np.asarray(seq.pages, np.int32)
            pos = np.arange(f, L, dtype=np.int32)
            tokens[i, :L - f] = seq.tokens[f:L]
            positions[i, :L - f] = pos
            slots[i, :L - f] = pages[pos // ps] * ps + pos % ps
            tables[i, :min(len(pages), P)] = pages[:P]
            ctx[i], last[i], alloc[i] = L, L - f - 1, min(len(pages), P) * ps
        feed = StepInputs(tokens=tokens, positions=positions, slot_mapping=slots, block_tables=tables,
                          context_lens=ctx, last_index=last)
        samp = self._sampling_arrays(items, B, P * ps, [it.seq.num_tokens for it in items])
        with jax.profiler.TraceAnnotation("jaxserve.draft", seqs=len(spans)):
            (drafts, q), self.kv_cache = self.executable((B, -FEED, P))(
                self.params, self.kv_cache, ProposeInputs(feed=feed, alloc=alloc), samp)
        drafts = np.asarray(drafts)[:n]
        for seq, _, _ in spans:  # d_1 .. d_{k-1} were fed (where the row had pages for them)
            i, L = rows[id(seq)], seq.num_tokens
            seq.draft_computed = L
            seq.draft_fed = drafts[i, :max(0, min(k - 1, int(alloc[i]) - L))].tolist()
        return drafts, q

    def _catch_up(self, spans: list[tuple[Sequence, int, int]]) -> None:
        """Prefill the draft's cache with tokens [a, b) of each sequence: one chunk of each per
        call (a chunk attends to the one before it, which must be written already)."""
        chunk, width = self.prefill_lengths[-1], self.prefill_batches[-1]
        while spans:
            items = [ScheduledItem(seq, a, min(chunk, b - a)) for seq, a, b in spans]
            for i in range(0, len(items), width):
                self._launch_prefill(items[i:i + width])
            spans = [(seq, a + chunk, b) for seq, a, b in spans if a + chunk < b]
