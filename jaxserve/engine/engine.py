"""The engine: Engine.step() = schedule -> run -> postprocess, and the bridges around it.

The life of a request inside the engine:

1. `add_request` validates it (non-empty, fits max_model_len and the page pool,
   token ids inside the vocabulary), draws a seed if it has none, and queues a
   `Sequence` as waiting.
2. `step` asks the scheduler for a batch: a prefill step (prompt chunks of waiting
   or mid-prompt sequences, pages allocated as the chunks arrive; a waiting one first
   takes the pages of its longest cached prefix, engine/prefix_cache.py) or a decode step
   (one token for every running sequence, preempting by recompute when pages run
   out).
3. The runner pads the batch to a compiled bucket and launches the jitted call (model +
   on-device sampling, KV cache donated); the sampled ids start their copy back. When no
   prompt waits, a decode call runs `decode_steps` steps on the device at once, and
   (with `overlap`) the next decode call is launched on the device-resident ids of the
   last one before the host reads them: the host postprocesses call N while call N + 1
   runs. A sequence that finished in call N has its tokens of call N + 1 discarded.
4. `postprocess` appends each sampled token, detokenizes incrementally, checks the
   stop conditions (EOS / stop ids, stop strings, max_tokens, max_model_len), indexes
   newly computed full pages in the prefix cache, frees the pages of finished sequences
   at once (their full pages stay cached) and returns one TokenEvent per request that
   made progress (with every token it made in the call).

No exception escapes `step`: a request that fails in postprocess fails alone, and
a failed device step finishes only the sequences that were in it, with an error.

`LLM` is the offline API (a list of prompts in, completions out); `AsyncEngine` runs
the same loop on a thread and hands each request's events to asyncio.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Iterable

import jax
import numpy as np

from jaxserve.checkpoint import kv_scales
from jaxserve.checkpoint.load import load_model
from jaxserve.checkpoint.quantize import quantize_at_load
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import faults
from jaxserve.engine.draft import DraftRunner
from jaxserve.engine.pages import PagePool, kv_bytes_per_page, pages_for_budget
from jaxserve.engine.prefix_cache import PrefixCache
from jaxserve.engine.limits import RequestLimits
from jaxserve.layers import parallel
from jaxserve.layers.attention import kv_storage
from jaxserve.engine.runner import (Launched, ModelRunner, PromptScores, ScheduledItem, StepResult,
                                    enable_compilation_cache)
from jaxserve.engine.sampler import STOP_ID_SLOTS
from jaxserve.engine.scheduler import Scheduler, SchedulerConfig, by_priority
from jaxserve.engine.sequence import InvalidRequest, SamplingParams, Sequence, Status, TokenEvent
from jaxserve.engine.speculative import propose
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


def kv_budget_bytes(config: EngineConfig) -> int:
    """The KV cache budget: `kv_cache_memory_fraction` of the device memory still free once
    the weights are loaded, where the device reports its memory (GPUs), else
    `kv_cache_memory_gib` (CPUs report nothing, and share memory with everything else)."""
    if config.kv_cache_memory_fraction is not None:
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            return int(config.kv_cache_memory_fraction * free)
        log.info("the device reports no memory size; using kv_cache_memory_gib=%s", config.kv_cache_memory_gib)
    return int(config.kv_cache_memory_gib * 2**30)


def fp8_kv_calibration(model_dir: Path, cfg: ModelConfig, params: dict,
                       what: str = "the model") -> tuple[np.ndarray | None, dict]:
    """The checkpoint's fp8 KV calibration (checkpoint/kv_scales.py): (per-layer scales, or None
    for 1.0; params with its key transforms, where it has them); says which."""
    scales, keys = kv_scales.load(model_dir, cfg)
    if scales is None:
        log.info("fp8 KV cache of %s: scale 1.0 (no %s in %s; `jaxserve convert --kv-calibration` writes one)",
                 what, kv_scales.FILE, model_dir)
    else:
        log.info("fp8 KV cache of %s: per-layer scales from %s (K %.3g to %.3g, V %.3g to %.3g), %s", what,
                 model_dir / kv_scales.FILE, scales[0].min(), scales[0].max(), scales[1].min(), scales[1].max(),
                 "Hadamard-rotated keys" if keys is None else f"keys through {kv_scales.KEYS_FILE}")
    return scales, params if keys is None else kv_scales.with_key_transforms(params, keys)


class Engine:
    """Continuous batching over a paged KV cache for one model. Not thread-safe: one thread drives it."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *, warmup: bool = True):
        config = config or EngineConfig()
        enable_compilation_cache(config.compilation_cache_dir)
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        # Tensor parallelism: the weights and the KV cache split over this mesh (layers/parallel.py).
        self.mesh = parallel.make_mesh(config.tensor_parallel_size)
        self.model_cfg, params = load_model(model_dir, dtype=config.dtype, mesh=self.mesh)
        params = quantize_at_load(params, config.quantization)
        max_len = min(config.max_model_len, self.model_cfg.max_position_embeddings)
        store, scale_bytes = kv_storage(config.kv_cache_dtype, config.dtype)
        page_bytes = kv_bytes_per_page(self.model_cfg.num_layers, config.page_size, self.model_cfg.num_kv_heads,
                                       self.model_cfg.head_dim, store.itemsize, scale_bytes)
        draft = self._load_draft(config) if config.speculative.method == "draft" else None
        # A draft model's cache has the same pages (engine/draft.py): the budget pays for both.
        draft_page_bytes = 0 if draft is None else kv_bytes_per_page(
            draft[0].num_layers, config.page_size, draft[0].num_kv_heads, draft[0].head_dim, store.itemsize,
            scale_bytes)
        # The budget is per device; each of the tensor_parallel_size devices holds its heads' share of a page.
        num_pages = config.num_pages or pages_for_budget(kv_budget_bytes(config) * config.tensor_parallel_size,
                                                         page_bytes + draft_page_bytes)
        if num_pages < 1:
            raise ValueError("the KV cache budget holds no page; raise kv_cache_memory_gib")
        self.config = dataclasses.replace(config, max_model_len=max_len)
        self.pool = PagePool(num_pages, config.page_size)
        self.limits = RequestLimits(self.model_cfg.vocab_size, max_len, self.pool.num_tokens)
        # What else makes a page's K/V: the weights (directory, quantization) and the cache dtype.
        self.cache = PrefixCache(self.pool, f"{self.model_dir.resolve()}|{config.dtype}|{config.quantization}|"
                                            f"{config.kv_cache_dtype}") \
            if config.enable_prefix_caching else None
        fp8 = config.kv_cache_dtype.startswith("fp8")
        scales = draft_scales = None
        if fp8:
            scales, params = fp8_kv_calibration(self.model_dir, self.model_cfg, params)
            if draft is not None:
                draft_scales, draft_params = fp8_kv_calibration(Path(config.speculative.draft_model), *draft,
                                                                "the draft model")
                draft = (draft[0], draft_params)
        self.runner = ModelRunner(self.model_cfg, params, self.config, num_pages, self.mesh, kv_scales=scales)
        self.draft = None if draft is None else DraftRunner(
            *draft, self.config, num_pages, self.runner.verify_batches, self.mesh, kv_scales=draft_scales)
        max_chunk = self.runner.prefill_lengths[-1]
        budget = self.config.prefill_token_budget or max(self.runner.prefill_batches) * max_chunk
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_prefill_seqs=max(self.runner.prefill_batches),
            max_prefill_chunk=min(max_chunk, budget),
            max_prefill_tokens=budget,
            watermark_pages=max(1, num_pages // 100),
            max_preemptions=self.config.max_preemptions,
            preemption_mode=self.config.preemption_mode,
            swap_pages=self.swap_pages_for(config, page_bytes),
            swap_min_tokens=self.config.swap_min_tokens), self.pool, order_key=by_priority, cache=self.cache)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_cfg.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._seqs: dict[str, Sequence] = {}
        self.page_bytes = page_bytes  # of one page, all layers' K and V
        self.metrics = None  # a jaxserve.metrics.EngineMetrics when served; called from the engine thread
        self._inflight: Launched | None = None  # a decode call launched, not yet postprocessed
        # speculative decoding so far: (rows with drafts, draft tokens, draft tokens accepted)
        self.spec_counts: tuple[int, int, int] = (0, 0, 0)
        self._inflight_started = 0.0
        if self.mesh is not None:
            log.info("tensor parallel over %d devices (%s): each holds %d of %d heads and %d of %d KV heads",
                     self.mesh.size, ", ".join(str(d) for d in self.mesh.devices.flat),
                     self.model_cfg.num_heads // self.mesh.size, self.model_cfg.num_heads,
                     self.model_cfg.num_kv_heads // self.mesh.size, self.model_cfg.num_kv_heads)
        self.compile_seconds = 0.0
        if warmup:
            self.warmup()
        log.info("engine ready: %d pages of %d tokens (%d tokens of KV cache, %s, %.1f KiB a page), "
                 "max_model_len %d, max_num_seqs %d", num_pages, config.page_size, self.pool.num_tokens,
                 config.kv_cache_dtype if config.kv_cache_dtype != "auto" else config.dtype,
                 (page_bytes + draft_page_bytes) / 1024, max_len, self.config.max_num_seqs)

    def warmup(self) -> None:
        """Compile every step bucket (and the draft model's) now, not when a step first needs it."""
        self.compile_seconds += self.runner.warmup()
        if self.draft is not None:
            self.compile_seconds += self.draft.warmup()

    def _load_draft(self, config: EngineConfig) -> tuple:
        """(ModelConfig, params) of the draft model, which must share the target's vocabulary."""
        path = Path(config.speculative.draft_model)
        if not (path / "config.json").is_file():
            raise ValueError(f"draft_model {str(path)!r} is not a model directory (no config.json); "
                             "convert one with `jaxserve convert`")
        cfg, params = load_model(path, dtype=config.dtype, mesh=self.mesh, what="the draft model")
        if cfg.vocab_size != self.model_cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {cfg.vocab_size} tokens and the target's "
                             f"{self.model_cfg.vocab_size}: a draft model must use the target's tokenizer")
        return cfg, quantize_at_load(params, config.quantization)

    @staticmethod
    def swap_pages_for(config: EngineConfig, page_bytes: int) -> int:
        """Host swap space in pages; 0 (recompute only) unless a swapping mode is chosen."""
        if config.preemption_mode == "recompute":
            return 0
        return pages_for_budget(int(config.swap_space_gib * 2**30), page_bytes)

    # Requests -----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, timeout: float | None = None,
                    arrival: float | None = None, cache_salt: str | None = None) -> Sequence:
        """Queue a request; `timeout` (seconds from `arrival`, a time.monotonic() that defaults to
        now; else the config's default) is its deadline. Requests with different `cache_salt`s
        never share a cached page."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._seqs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params.max_tokens)
        self.check_logit_bias(params)
        seq = Sequence(request_id, ids, params, priority=priority, arrival=arrival, cache_salt=cache_salt)
        timeout = self.config.default_timeout_s if timeout is None else timeout
        seq.deadline = None if timeout is None else seq.arrival + timeout
        seq.seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seq.seed &= 0xFFFFFFFF
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        if params.min_tokens:  # the ids the sampler bans until then
            eos = () if params.ignore_eos else tuple(sorted(self.eos_token_ids))
            seq.held_stop_ids = (params.stop_token_ids + eos)[:STOP_ID_SLOTS]
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold: the context length or the whole pool."""
        return self.limits.max_request_tokens

    def check_request(self, ids: list[int], max_tokens: int) -> None:
        """Raise InvalidRequest unless a prompt of `ids` with `max_tokens` can ever be served."""
        self.limits.check_request(ids, max_tokens)

    def check_logit_bias(self, params: SamplingParams) -> None:
        """Raise InvalidRequest unless every logit_bias token id is in the vocabulary."""
        self.limits.check_logit_bias(params)

    def abort(self, request_id: str) -> TokenEvent | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, "abort")
        return self._event(seq, [], "", None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # The loop body --------------------------------------------------------------------

    def expire(self, now: float | None = None) -> list[TokenEvent]:
        """End every request past its deadline, wherever it is (waiting, prefilling, decoding)."""
        now = time.monotonic() if now is None else now
        late = [s for s in self._seqs.values() if s.deadline is not None and s.deadline <= now]
        for seq in late:
            self.scheduler.finish(seq, "timeout")
            self._seqs.pop(seq.request_id, None)
        return [self._event(seq, [], "", None) for seq in late]

    def step(self) -> list[TokenEvent]:
        events = self.expire()
        if self._inflight is not None:
            events += self._step_overlapped()
            if self._inflight is not None:  # a chained call runs now
                return events
        batch = self.scheduler.schedule()
        if batch is None:
            return events
        return events + self._run(batch)

    def _only_decoding(self) -> bool:
        """No prompt waits to be prefilled and nothing is swapped out: the time for several
        decode steps per call, and for chaining calls (an arrival waits for one call at most)."""
        s = self.scheduler
        return not (s.waiting or s.swapped or any(seq.num_uncomputed > 1 for seq in s.running))

    def _step_overlapped(self) -> list[TokenEvent]:
        """Launch the next decode call chained on the one in flight (when nothing else needs the
        scheduler and every sequence gets pages for the whole call), then postprocess the one
        in flight while the new one runs."""
        prev = self._inflight
        nxt = self._chain(prev) if self.config.overlap else None
        self._inflight = None
        events = self._complete(prev, self._inflight_started)
        if nxt is not None:
            self._inflight, self._inflight_started = nxt
        return events

    def _chain(self, prev: Launched) -> tuple[Launched, float] | None:
        k = prev.k
        if k != self.config.decode_steps or not self._only_decoding() or (prev.valid < k).any():
            return None
        spec = self.config.speculative
        if spec.enabled and len(self.scheduler.running) <= spec.disable_above_batch_size:
            return None  # few enough to speculate: the next step looks for drafts first
        seqs = [it.seq for it in prev.items if not it.seq.is_finished]
        if not seqs or len(seqs) != len(self.scheduler.running):
            return None  # a sequence outside the call (a swapped-in one) needs the scheduler
        items = []
        for seq in seqs:
            start = prev.items[prev.rows[id(seq)]].start + k  # the position after the call in flight
            if start + k > self.config.max_model_len or not self.pool.grow(seq.pages, start + k):
                return None  # near the end of its context or out of pages: let the scheduler decide
            items.append(ScheduledItem(seq, start, 1))
        started = time.monotonic()
        try:
            return self.runner.launch(items, True, k, chain=prev), started
        except Exception:  # the unchained path will run (and report) it again
            log.exception("chained decode launch failed")
            return None

    def _swap(self, batch) -> None:
        """The batch's host copies: pages of swapped-out sequences first (their pages may be
        handed to someone else in this very batch), then swapped-in sequences' data back."""
        for seq, pages in batch.swap_out:
            seq.swap_data = self.runner.copy_out(pages)
        for seq in batch.swap_in:  # it may have grown since; its first swap_skip pages were cached
            skip = seq.swap_skip
            if skip < seq.swap_pages:
                data = jax.tree.map(lambda a: a[:, skip:], seq.swap_data) if skip else seq.swap_data
                self.runner.copy_in(seq.pages[skip:seq.swap_pages], data)
            seq.swap_data = None
            seq.swap_pages = seq.swap_skip = 0

    def _run(self, batch) -> list[TokenEvent]:
        started = time.monotonic()
        try:
            self._swap(batch)
            if not batch.items:
                return []
            for it in batch.items:
                if it.seq.scheduled_at is None:
                    it.seq.scheduled_at = started
                    if self.metrics is not None:
                        self.metrics.scheduled(it.seq, started)
            faults.check_step(it.seq.request_id for it in batch.items)
            proposal = self._drafts(batch.items) if batch.decode else None
            if proposal is not None:  # speculative: one verify call, read before the next step
                return self._complete(self.runner.launch_verify(batch.items, *proposal), started)
            steady = batch.decode and self._only_decoding()
            k = self.config.decode_steps if steady else 1
            if k > 1:  # pages for the whole call where the pool has them; the rest is not valid
                for it in batch.items:
                    self.pool.grow(it.seq.pages, min(it.seq.num_tokens + k - 1, self.config.max_model_len))
            launched = self.runner.launch(batch.items, batch.decode, k)
        except Exception as e:  # a failed device step ends the requests in it, and only them
            return self._fail(batch.items, batch.swap_in, e)
        if steady and self.config.overlap:
            self._inflight, self._inflight_started = launched, started
            return []
        return self._complete(launched, started)

    def _drafts(self, items: list[ScheduledItem]) -> tuple[list[list[int]], object] | None:
        """Each decoding sequence's proposal and, with a draft model, the distributions it was
        drawn from (on the device); None when this step should decode plainly (speculation off,
        too many sequences for it to pay, or nothing proposed). A proposal is cut to what the
        sequence may still generate and to the pages the pool can give it."""
        spec = self.config.speculative
        if not spec.enabled or len(items) > spec.disable_above_batch_size:
            return None
        rooms = []
        for it in items:
            seq = it.seq
            room = min(spec.num_speculative_tokens, self.config.max_model_len - seq.num_tokens,
                       seq.params.max_tokens - len(seq.output_ids) - 1) if seq.params.speculative else 0
            rooms.append(max(room, 0))
        if spec.method == "ngram":
            drafts = [propose(it.seq.tokens, r, spec.ngram_min, spec.ngram_max) if r else []
                      for it, r in zip(items, rooms)]
            drafts = [d[:self._fit(it.seq, len(d))] for it, d in zip(items, drafts)]
            return (drafts, None) if any(drafts) else None
        rooms = [self._fit(it.seq, r) for it, r in zip(items, rooms)]
        if not any(rooms):
            return None
        drafts, q = self.draft.propose(items, [r > 0 for r in rooms])
        return [d[:r].tolist() for d, r in zip(drafts, rooms)], q

    def _fit(self, seq: Sequence, n: int) -> int:
        """How many of n tokens past its end the sequence's pages can hold, growing them where
        the pool allows."""
        if n and not self.pool.grow(seq.pages, seq.num_tokens + n):
            n = min(n, max(0, len(seq.pages) * self.pool.page_size - seq.num_tokens))
        return n

    def _fail(self, items: list[ScheduledItem], extra: list[Sequence], e: Exception) -> list[TokenEvent]:
        seqs = list({id(s): s for s in [it.seq for it in items] + extra}.values())
        log.exception("step failed; finishing %d request(s) with an error", len(seqs))
        events = []
        for seq in seqs:
            if seq.is_finished:
                continue
            self.scheduler.finish(seq, "error")
            self._seqs.pop(seq.request_id, None)
            events.append(self._event(seq, [], "", None, error=f"{type(e).__name__}: {e}"))
        if self.cache is not None:  # what the failed call left in the cache is unknown: forget it all
            self.pool.clear_index()
        return events

    def _complete(self, launched: Launched, started: float) -> list[TokenEvent]:
        """Wait for a launched call's tokens and postprocess them."""
        try:
            result = launched.result()
        except Exception as e:
            return self._fail(launched.items, [], e)
        if launched.drafts is not None:
            counts = (int((launched.num_drafts > 0).sum()), int(launched.num_drafts.sum()),
                      int((result.valid - 1).sum()))
            self.spec_counts = tuple(a + b for a, b in zip(self.spec_counts, counts))
            if self.metrics is not None:
                self.metrics.speculated(*counts)
        if self.metrics is not None:
            self.metrics.step(launched.decode, len(launched.items),
                              sum(it.length for it in launched.items) * launched.k, time.monotonic() - started)
        return self.postprocess(launched.items, result)

    def postprocess(self, items: list[ScheduledItem], result: StepResult) -> list[TokenEvent]:
        """Append each item's sampled tokens (result.tokens[i, :valid[i]]) until its sequence
        stops; one event per sequence that made progress."""
        events = []
        for i, it in enumerate(items):
            seq = it.seq
            if seq.is_finished:  # aborted, or finished in the call before this chained one
                continue
            if result.scores is not None and seq.logits_needed_from is not None:
                self._score_prompt(seq, it, result.scores, i)
                if self.cache is not None:
                    self.cache.keep_scores(seq)
            if not it.samples:  # a prompt chunk short of the prompt's end
                seq.num_computed = it.start + it.length
                if self.cache is not None:
                    self.cache.commit(seq)
                continue
            try:
                tokens, text, logprobs, reason = [], "", [], None
                for j in range(int(result.valid[i])):
                    seq.num_computed = seq.num_tokens  # the token fed in step j is in the cache now
                    token = int(result.tokens[i, j])
                    piece, reason = self._append_token(seq, token)
                    tokens.append(token)
                    text += piece
                    if seq.params.logprobs is not None:
                        logprobs.append(self._logprobs(seq, result, i, j))
                    if reason is not None:
                        break
                if self.cache is not None and reason is None:  # a finished one indexed its pages on release
                    self.cache.commit(seq)
                events.append(self._event(seq, tokens, text, reason, logprobs=logprobs or None))
            except Exception as e:
                log.exception("postprocess failed for %s", seq.request_id)
                self.scheduler.finish(seq, "error")
                self._seqs.pop(seq.request_id, None)
                events.append(self._event(seq, [], "", None, error=f"{type(e).__name__}: {e}"))
        return events

    @staticmethod
    def _score_prompt(seq: Sequence, it: ScheduledItem, scores: PromptScores, i: int) -> None:
        """Record the prompt logprobs of the positions row i of a scored prefill fed that the
        sequence has no record for yet: position p's scores are prompt token p + 1's."""
        n = seq.params.prompt_logprobs
        assert it.start <= seq.logits_needed_from, "a scored prefill began past the first position it must score"
        end = min(it.start + it.length, len(seq.prompt_ids) - 1)
        for p in range(seq.logits_needed_from, end):
            t = p - it.start
            top = [(int(a), float(b)) for a, b in zip(scores.top_ids[i, t, :n], scores.top_logprobs[i, t, :n])]
            seq.prompt_logprobs.append({"token_id": seq.prompt_ids[p + 1], "logprob": float(scores.logprobs[i, t]),
                                        "rank": int(scores.ranks[i, t]), "top": top})

    def _logprobs(self, seq: Sequence, result: StepResult, i: int, j: int) -> dict:
        n = seq.params.logprobs
        top = [(int(t), float(lp)) for t, lp in zip(result.top_ids[i, j, :n], result.top_logprobs[i, j, :n])]
        return {"token_id": int(result.tokens[i, j]), "logprob": float(result.logprobs[i, j]), "top": top}

    def _append_token(self, seq: Sequence, token: int) -> tuple[str, str | None]:
        """Append one token; returns (the text it releases, the finish reason or None)."""
        p = seq.params
        seq.output_ids.append(token)
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.token(seq, now)
        seq.first_token_at = now if seq.first_token_at is None else seq.first_token_at
        seq.last_token_at = now
        reason = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
            if token not in self.eos_token_ids or p.ignore_eos:
                seq.stop_reason = token
            text = seq.detokenizer.flush()  # the stop token itself is not shown
        else:
            if faults.FAULTS:  # tests only
                faults.check_detokenize(seq.request_id)
            text = seq.detokenizer.add([token])
            if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
                reason = "length"
                text += seq.detokenizer.flush()
        full = seq.output_text + text
        n = len(seq.output_ids)
        if n < p.min_tokens:  # min_tokens: no stop string ends in its first min_tokens - 1 tokens' text
            if n == p.min_tokens - 1:
                seq.stop_floor = len(full)
            hit = None
        else:
            hit = min(((i, s) for s in p.stop if (i := full.find(s, max(0, seq.stop_floor - len(s) + 1))) >= 0),
                      default=None)
        if hit is not None:
            full, reason = full[:hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)], "stop"
            seq.stop_reason = hit[1]
        emit_upto = len(full)
        if reason is None and p.stop:
            # Hold back a tail that could still grow into a stop string.
            emit_upto -= max((k for s in p.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
        new_text = full[seq.emitted_chars:emit_upto]
        seq.emitted_chars = max(seq.emitted_chars, emit_upto)
        seq.output_text = full
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
        return new_text, reason

    def _event(self, seq: Sequence, token_ids, text, reason, logprobs=None, error=None) -> TokenEvent:
        done = seq.is_finished
        if done and self.metrics is not None:  # every way a request ends comes through here
            self.metrics.finished(seq, time.monotonic())
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent and seq.logits_needed_from is None:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return TokenEvent(request_id=seq.request_id, token_ids=token_ids, text=text,
                          finished=done, finish_reason=seq.finish_reason if done else reason,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs, prompt_tokens=len(seq.prompt_ids),
                          completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens or 0, error=error,
                          stop_reason=seq.stop_reason if done else None,
                          scheduled_at=seq.scheduled_at if done else None,
                          preempted_at=tuple(seq.preempted_at) if done else ())

    def run_until_done(self) -> list[TokenEvent]:
        events = []
        while self.has_unfinished:
            events.extend(self.step())
        return events


@dataclasses.dataclass
class Completion:
    """The offline result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None  # prompt tokens 1.. (SamplingParams.prompt_logprobs)


class LLM:
    """Offline batch generation: `LLM(model_dir, **engine_options).generate(prompts, sampling_params)`.

    `warmup=False` compiles each step bucket when a call first needs it instead of all at start
    (a short batch may use a few of them; nothing waits on a latency target offline)."""

    def __init__(self, model_dir: str | Path, *, warmup: bool = True, **engine_options):
        self.engine = Engine(model_dir, EngineConfig(**engine_options), warmup=warmup)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Iterable[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        seqs = [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        logprobs: dict[str, list] = {s.request_id: [] for s in seqs}
        for ev in self.engine.run_until_done():
            if ev.logprobs and ev.request_id in logprobs:
                logprobs[ev.request_id].extend(ev.logprobs)
        return [Completion(request_id=s.request_id, prompt_token_ids=s.prompt_ids, token_ids=s.output_ids,
                           text=s.output_text, finish_reason=s.finish_reason,
                           logprobs=logprobs[s.request_id] if s.params.logprobs is not None else None,
                           prompt_logprobs=s.prompt_logprobs)
                for s in seqs]


class AsyncEngine:
    """Runs an Engine on its own thread; asyncio code submits requests and reads their events.

    The engine thread owns the Engine. Requests and aborts reach it through a locked
    inbox; each request's events go back through `loop.call_soon_threadsafe` into an
    unbounded asyncio.Queue, so the engine thread never blocks on a slow client.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: list[tuple] = []
        self._cv = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.dead: str | None = None
        # time.monotonic() when the engine thread began the iteration it is in (None while it
        # waits for work): an iteration is one inbox drain and one step, so a large age means
        # the thread is stuck (a hung device call, a deadlock), which `stalled_for` reports.
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def _post(self, item: tuple) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify()

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0, timeout: float | None = None,
                       arrival: float | None = None, cache_salt: str | None = None) -> AsyncIterator[TokenEvent]:
        """Submit a request and iterate over its events; leaving the iteration early aborts it.
        `arrival` (time.monotonic(), default now) is when the deadline and FCFS order start."""
        request_id = request_id or uuid.uuid4().hex
        arrival = time.monotonic() if arrival is None else arrival
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, queue)
        self._post(("add", request_id, prompt, params, priority, timeout, arrival, cache_salt))
        finished = False
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, Exception):
                    raise ev
                yield ev
                if ev.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def call_in_engine_thread(self, fn) -> None:
        """Run `fn()` on the engine thread before its next step (tests use it to block the thread)."""
        self._post(("call", fn))

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds the engine thread has spent in its current iteration (0 while idle)."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, (time.monotonic() if now is None else now) - since)

    @property
    def busy(self) -> bool:
        """Some request is still open (submitted and its consumer not yet given its last event)."""
        return bool(self._queues)

    def failure(self, stall_limit: float) -> str | None:
        """Why this engine can no longer serve (its thread died or a step raised, or it has been
        stuck in one iteration for over `stall_limit` seconds), else None."""
        if self.dead:
            return self.dead
        if not self._thread.is_alive() and not self._stop:
            return "the engine thread is gone"
        stalled = self.stalled_for()
        if stalled > stall_limit:
            return f"the engine thread has made no progress for {stalled:.0f} s with work waiting"
        return None

    def end_all(self, reason: str, finish_reason: str = "error") -> int:
        """End every open request now, from any thread: each consumer gets a finishing event
        carrying `reason` (its stream ends with an error event), and the engine is asked to
        abort it (a stuck or dead engine never will, which is why the event does not wait for
        it). Returns how many requests were open."""
        open_ids = list(self._queues)
        for rid in open_ids:
            self._deliver(rid, TokenEvent(request_id=rid, token_ids=[], text="", finished=True,
                                          finish_reason=finish_reason, error=reason))
            self.abort(rid)
        return len(open_ids)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=1 if self.dead else 30)

    def _deliver(self, request_id: str, item) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread is ending: say why, to everyone
            self.dead = f"the engine thread died: {type(e).__name__}: {e}"
            log.critical("%s", self.dead, exc_info=not isinstance(e, faults.EngineThreadKilled))
            self.end_all(self.dead)

    def _serve(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                if not self._inbox and not eng.has_unfinished and not self._stop:
                    self._busy_since = None
                    while not self._inbox and not eng.has_unfinished and not self._stop:
                        self._cv.wait()
                if self._stop:
                    return
                self._busy_since = time.monotonic()
                inbox, self._inbox = self._inbox, []
            for item in inbox:
                if item[0] == "call":
                    try:
                        item[1]()
                    except Exception:  # noqa: BLE001 - a hook's failure is its own
                        log.exception("a call on the engine thread raised")
                elif item[0] == "add":
                    _, rid, prompt, params, priority, timeout, arrival, salt = item
                    faults.on_arrival(rid)
                    try:
                        eng.add_request(prompt, params, request_id=rid, priority=priority, timeout=timeout,
                                        arrival=arrival, cache_salt=salt)
                    except Exception as e:  # invalid request: its caller gets the exception
                        self._deliver(rid, e)
                else:
                    ev = eng.abort(item[1])
                    if ev is not None:
                        self._deliver(item[1], ev)
            try:
                events = eng.step()
            except Exception as e:  # step() catches per request, so this is a bug: stop serving
                log.exception("engine step raised")
                self.dead = f"the engine step raised {type(e).__name__}: {e}"
                self.end_all(self.dead)
                return
            for ev in events:
                self._deliver(ev.request_id, ev)
            time.sleep(0)
