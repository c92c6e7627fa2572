"""The only bridge between host lists and the device: buckets, AOT compilation, jitted steps.

A step is one call of one compiled executable:

    (params, kv_cache, StepInputs, SamplingArrays) -> (SampleOutput, kv_cache)

with the KV cache donated, so XLA updates it in place. Host-side sequences are
padded into the smallest bucket that holds them:

    decode   tokens [B, 1]   B in decode_batch_buckets, block tables [B, P] with P
             pages covering the smallest context bucket >= the longest context
    prefill  tokens [B, T]   B in prefill_batch_buckets, T in prefill_length_buckets,
             block tables [B, P] over the smallest context bucket that holds T
             tokens, or (for a later chunk of a long prompt) over max_model_len

Every bucket is compiled at start-up (`warmup`), with compile times logged; JAX's
persistent compilation cache makes the next start-up cheap. Padding rows and
padding tokens write to a slot past the last page (dropped by the scatter) and have
context length 0, so they neither touch nor see anyone's pages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.sampler import SampleOutput, SamplingArrays, sample
from jaxserve.engine.sequence import SamplingParams, Sequence
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.linear import resolve as resolve_impl
from jaxserve.models import family

log = logging.getLogger(__name__)


@struct.dataclass
class StepInputs:
    tokens: jax.Array  # [B, T] i32
    positions: jax.Array  # [B, T] i32
    slot_mapping: jax.Array  # [B, T] i32, num_pages * page_size = dropped
    block_tables: jax.Array  # [B, P] i32
    context_lens: jax.Array  # [B] i32
    last_index: jax.Array  # [B] i32, which of the T tokens to sample after


@dataclasses.dataclass(frozen=True)
class ScheduledItem:
    """One sequence's share of a step: feed tokens[start:start+length]; sample if it reaches the end."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # [n] sampled ids, one per item (meaningful where item.samples)
    logprobs: np.ndarray  # [n]
    top_ids: np.ndarray  # [n, 20]
    top_logprobs: np.ndarray  # [n, 20]


def enable_compilation_cache(path: str | None) -> None:
    if not path:
        return
    path = os.path.expanduser(path)
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class ModelRunner:
    """Owns the parameters, the KV cache and the compiled step executables."""

    def __init__(self, model_cfg: ModelConfig, params: dict, cfg: EngineConfig, num_pages: int):
        self.model_cfg, self.params, self.cfg = model_cfg, params, cfg
        self.model = family(model_cfg)
        self.attention_impl = resolve_impl(cfg.attention_impl)
        self.matmul_impl = resolve_impl(cfg.matmul_impl)
        self.num_pages = num_pages
        self.page_size = cfg.page_size
        self.drop_slot = num_pages * cfg.page_size
        self.max_pages_per_seq = -(-cfg.max_model_len // cfg.page_size)
        ctx_pages = sorted({-(-c // cfg.page_size) for c in cfg.context_buckets if c <= cfg.max_model_len})
        if not ctx_pages or ctx_pages[-1] < self.max_pages_per_seq:
            ctx_pages.append(self.max_pages_per_seq)
        self.context_page_buckets = tuple(ctx_pages)
        self.decode_batches = tuple(b for b in cfg.decode_batch_buckets if b < cfg.max_num_seqs) + (cfg.max_num_seqs,)
        self.prefill_batches = tuple(b for b in cfg.prefill_batch_buckets if b <= cfg.max_num_seqs)
        self.prefill_lengths = cfg.prefill_length_buckets
        dtype = jnp.dtype(cfg.dtype)
        shape = (model_cfg.num_layers, num_pages, cfg.page_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        self._jitted = jax.jit(self._step, donate_argnums=(1,))
        self._executables: dict[tuple[int, int, int], object] = {}
        # Swap copies move whole pages; their page counts are padded to powers of two.
        self.swap_enabled = cfg.preemption_mode != "recompute" and cfg.swap_space_gib > 0
        self.swap_buckets = tuple(sorted({min(2**i, self.max_pages_per_seq)
                                          for i in range(self.max_pages_per_seq.bit_length() + 1)}))
        self._gather = jax.jit(lambda kv, ids: jax.tree.map(lambda c: c[:, ids], kv))
        self._scatter = jax.jit(
            lambda kv, ids, data: jax.tree.map(lambda c, d: c.at[:, ids].set(d, mode="drop"), kv, data),
            donate_argnums=(0,))
        self._copy_executables: dict[tuple[str, int], object] = {}
        self.compile_seconds = 0.0

    # The jitted step --------------------------------------------------------------------

    def _step(self, params, kv_cache, inp: StepInputs, sampling: SamplingArrays):
        meta = AttentionMetadata(positions=inp.positions, context_lens=inp.context_lens,
                                 slot_mapping=inp.slot_mapping, block_tables=inp.block_tables,
                                 sliding_window=self.model_cfg.sliding_window, attention_impl=self.attention_impl,
                                 matmul_impl=self.matmul_impl, interpret=self.cfg.interpret)
        with jax.named_scope("model"):  # names the ops in a profile: model/..., sample/...
            hidden, kv_cache = self.model.forward_hidden(params, self.model_cfg, inp.tokens, meta, kv_cache)
            B = hidden.shape[0]
            last = hidden[jnp.arange(B), inp.last_index]  # [B, D]
            logits = self.model.logits_from_hidden(params, last, self.matmul_impl, self.cfg.interpret)  # [B, V]
        with jax.named_scope("sample"):
            return sample(logits, sampling), kv_cache

    # Buckets and compilation ----------------------------------------------------------

    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (B, T, P) shape a step can take."""
        decode = [(b, 1, p) for b in self.decode_batches for p in self.context_page_buckets]
        prefill = [(b, t, p) for b in self.prefill_batches for t in self.prefill_lengths
                   for p in self.prefill_page_buckets(t)]
        return decode + prefill

    def prefill_page_buckets(self, T: int) -> tuple[int, ...]:
        """Context widths (in pages) a [B, T] prefill compiles for: the smallest context
        bucket that holds T tokens (a fresh prompt, start 0) and the whole max_model_len
        (a later chunk of a long prompt). A short prompt so never attends over 2048 slots."""
        ps = self.page_size
        fresh = next(p for p in self.context_page_buckets if p * ps >= min(T, self.cfg.max_model_len))
        return tuple(sorted({fresh, self.max_pages_per_seq}))

    def _abstract_args(self, B: int, T: int, P: int):
        i32, f32 = jnp.int32, jnp.float32
        sds = jax.ShapeDtypeStruct
        NB = SamplingParams.MAX_LOGIT_BIAS
        inp = StepInputs(tokens=sds((B, T), i32), positions=sds((B, T), i32), slot_mapping=sds((B, T), i32),
                         block_tables=sds((B, P), i32), context_lens=sds((B,), i32), last_index=sds((B,), i32))
        samp = SamplingArrays(
            temperature=sds((B,), f32), top_k=sds((B,), i32), top_p=sds((B,), f32), min_p=sds((B,), f32),
            presence_penalty=sds((B,), f32), frequency_penalty=sds((B,), f32), repetition_penalty=sds((B,), f32),
            seeds=sds((B,), jnp.uint32), counters=sds((B,), i32), history=sds((B, P * self.page_size), i32),
            prompt_lens=sds((B,), i32), logprobs=sds((B,), jnp.bool_),
            bias_ids=sds((B, NB), i32), bias_values=sds((B, NB), f32))
        params = jax.tree.map(lambda a: sds(a.shape, a.dtype), self.params)
        kv = jax.tree.map(lambda a: sds(a.shape, a.dtype), self.kv_cache)
        return params, kv, inp, samp

    def warmup(self) -> float:
        """Compile every bucket ahead of time; returns the seconds it took."""
        t_all = time.perf_counter()
        for key in self.buckets():
            if key in self._executables:
                continue
            t0 = time.perf_counter()
            self._executables[key] = self._jitted.lower(*self._abstract_args(*key)).compile()
            log.info("compiled step B=%d T=%d P=%d in %.2fs", *key, time.perf_counter() - t0)
        if self.swap_enabled:
            for n in self.swap_buckets:
                self._copy_executable("out", n)
                self._copy_executable("in", n)
        self.compile_seconds = time.perf_counter() - t_all
        log.info("compiled %d step buckets in %.1fs", len(self._executables), self.compile_seconds)
        return self.compile_seconds

    # Swap copies ------------------------------------------------------------------------

    def _copy_executable(self, kind: str, n: int):
        exe = self._copy_executables.get((kind, n))
        if exe is None:
            kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.kv_cache)
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            if kind == "out":
                exe = self._gather.lower(kv, ids).compile()
            else:
                data = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], n, *a.shape[2:]), a.dtype), kv)
                exe = self._scatter.lower(kv, ids, data).compile()
            self._copy_executables[(kind, n)] = exe
        return exe

    def copy_out(self, pages: list[int]):
        """Device -> host copy of `pages` of every layer's K and V: a pytree of numpy
        arrays [L, len(pages), page_size, kv_heads, head_dim] (the swap space's entry)."""
        n = len(pages)
        b = _bucket(n, self.swap_buckets)
        ids = np.zeros(b, np.int32)
        ids[:n] = pages
        out = self._copy_executable("out", b)(self.kv_cache, ids)
        return jax.tree.map(lambda a: np.asarray(a)[:, :n].copy(), out)

    def copy_in(self, pages: list[int], data) -> None:
        """Host -> device: write `data` (from `copy_out`) into `pages`, in place."""
        n = len(pages)
        b = _bucket(n, self.swap_buckets)
        ids = np.full(b, self.num_pages, np.int32)  # padding rows land past the cache and are dropped
        ids[:n] = pages
        padded = jax.tree.map(lambda a: np.pad(a, [(0, 0), (0, b - n)] + [(0, 0)] * (a.ndim - 2)), data)
        self.kv_cache = self._copy_executable("in", b)(self.kv_cache, ids, padded)

    # One step -------------------------------------------------------------------------

    @property
    def num_compiled(self) -> int:
        """Step executables compiled so far (warm-up compiles every bucket; a cold runner on demand)."""
        return len(self._executables)

    def run(self, items: list[ScheduledItem], decode: bool) -> StepResult:
        """Pad `items` into a bucket, run the step, bring the sampled tokens back to the host.
        In a profile the whole of it is one `jaxserve.decode` or `jaxserve.prefill` scope."""
        with jax.profiler.TraceAnnotation("jaxserve.decode" if decode else "jaxserve.prefill", seqs=len(items)):
            return self._run(items, decode)

    def _run(self, items: list[ScheduledItem], decode: bool) -> StepResult:
        n = len(items)
        if decode:
            B = _bucket(n, self.decode_batches)
            T = 1
            P = _bucket(max(-(-(it.start + it.length) // self.page_size) for it in items), self.context_page_buckets)
        else:
            B = _bucket(n, self.prefill_batches)
            T = _bucket(max(it.length for it in items), self.prefill_lengths)
            P = _bucket(max(-(-(it.start + it.length) // self.page_size) for it in items),
                        self.prefill_page_buckets(T))
        inp, samp = self._host_arrays(items, B, T, P)
        exe = self._executables.get((B, T, P))
        if exe is None:  # not warmed up (tests may run a cold runner); compiled once, then kept
            exe = self._executables[(B, T, P)] = self._jitted.lower(*self._abstract_args(B, T, P)).compile()
        out, self.kv_cache = exe(self.params, self.kv_cache, inp, samp)
        out: SampleOutput
        for leaf in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs):
            leaf.copy_to_host_async()
        return StepResult(tokens=np.asarray(out.tokens)[:n], logprobs=np.asarray(out.logprobs)[:n],
                          top_ids=np.asarray(out.top_ids)[:n], top_logprobs=np.asarray(out.top_logprobs)[:n])

    def _host_arrays(self, items: list[ScheduledItem], B: int, T: int, P: int):
        ps = self.page_size
        tokens = np.zeros((B, T), np.int32)
        positions = np.zeros((B, T), np.int32)
        slots = np.full((B, T), self.drop_slot, np.int32)
        tables = np.zeros((B, P), np.int32)
        ctx = np.zeros(B, np.int32)
        last = np.zeros(B, np.int32)
        f32 = np.float32
        temp, top_p, min_p = np.zeros(B, f32), np.ones(B, f32), np.zeros(B, f32)
        pres, freq, rep = np.zeros(B, f32), np.zeros(B, f32), np.ones(B, f32)
        top_k, counters, prompt_lens = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        seeds = np.zeros(B, np.uint32)
        want_logprobs = np.zeros(B, np.bool_)
        history = np.full((B, P * ps), -1, np.int32)
        bias_ids = np.full((B, SamplingParams.MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((B, SamplingParams.MAX_LOGIT_BIAS), f32)
        for i, it in enumerate(items):
            seq, s, n = it.seq, it.start, it.length
            all_tokens = seq.tokens
            pages = np.asarray(seq.pages, np.int32)
            pos = np.arange(s, s + n, dtype=np.int32)
            tokens[i, :n] = all_tokens[s:s + n]
            positions[i, :n] = pos
            slots[i, :n] = pages[pos // ps] * ps + pos % ps
            tables[i, :len(pages)] = pages[:P]
            ctx[i] = s + n
            last[i] = n - 1
            p = seq.params
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            pres[i], freq[i], rep[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            seeds[i], counters[i], prompt_lens[i] = seq.seed, len(seq.output_ids), len(seq.prompt_ids)
            want_logprobs[i] = p.logprobs is not None
            if p.logit_bias:
                bias_ids[i, :len(p.logit_bias)], bias_values[i, :len(p.logit_bias)] = zip(*p.logit_bias)
            # Tokens up to this chunk's end: the context bucket (the history's width) covers
            # them; a sample is only kept at the prompt's end, where they are all the tokens.
            history[i, :s + n] = all_tokens[:s + n]
        inp = StepInputs(tokens=tokens, positions=positions, slot_mapping=slots, block_tables=tables,
                         context_lens=ctx, last_index=last)
        samp = SamplingArrays(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=pres,
                              frequency_penalty=freq, repetition_penalty=rep, seeds=seeds, counters=counters,
                              history=history, prompt_lens=prompt_lens, logprobs=want_logprobs,
                              bias_ids=bias_ids, bias_values=bias_values)
        return inp, samp
