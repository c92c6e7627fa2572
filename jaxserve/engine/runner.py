"""The only bridge between host lists and the device: buckets, AOT compilation, jitted steps.

A step is one call of one compiled executable:

    prefill  (params, kv_cache, StepInputs, SamplingArrays) -> (SampleOutput, kv_cache)
    decode   (params, kv_cache, DecodeInputs, SamplingArrays, chain [k, R]) -> (SampleOutput [k, B], kv_cache)

with the KV cache donated, so XLA updates it in place. Host-side sequences are
padded into the smallest bucket that holds them:

    decode   tokens [B]      B in decode_batch_buckets, k in (1, decode_steps): one call runs
             k decode steps in a loop on the device, each feeding the token the last one
             sampled; block tables [B, P] over the smallest context bucket that holds the
             longest context the call reaches (attention reads P pages per row)
    prefill  tokens [B, T]   B in prefill_batch_buckets, T in prefill_length_buckets (those
             up to the first that holds max_model_len),
             block tables [B, P] over the smallest context bucket that holds T
             tokens, or (for a later chunk of a long prompt) over max_model_len

Every bucket is compiled at start-up (`warmup`), with compile times logged; JAX's
persistent compilation cache makes the next start-up cheap. Padding rows and
padding tokens write to a slot past the last page (dropped by the scatter) and have
context length 0, so they neither touch nor see anyone's pages.

Calls are asynchronous: `launch` dispatches one and returns a `Launched` whose device
outputs are being copied to the host; `Launched.result()` waits for them. A decode call
may be *chained* on one still in flight (`launch(..., chain=previous)`): its rows take
their input token, and the tokens the previous call sampled for their penalty history,
from the previous call's device output [k, R] (R = max_num_seqs rows), so the host
never waits for a token before launching the next call. The engine then postprocesses
the previous call while this one runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.sampler import (NUM_TOP_LOGPROBS, STOP_ID_SLOTS, SampleOutput, SamplingArrays, gumbel_noise,
                                     probabilities, ranked_token_logprobs, sample, uniform_noise)
from jaxserve.engine.sequence import SamplingParams, Sequence
from jaxserve.engine.speculative import ACCEPT_STREAM, accept_drafts, accepted_lengths
from jaxserve.layers import cpu_attention, cpu_gemv, parallel
from jaxserve.layers.attention import AttentionMetadata, fp8_bits, init_kv_cache, kv_storage, pallas_reads_kv
from jaxserve.layers.linear import W8A8_MIN_ROWS
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


@struct.dataclass
class DecodeInputs:
    """A k-step decode call. Row b's step i feeds position start[b] + i and samples the next token."""

    tokens: jax.Array  # [B] i32, the token at position start (ignored where chain_row >= 0)
    chain_row: jax.Array  # [B] i32, row of the chained call's output holding this row's tokens, or -1
    start: jax.Array  # [B] i32, position of the first token fed
    alloc: jax.Array  # [B] i32, tokens the row holds pages for: K/V of positions >= alloc is dropped
    block_tables: jax.Array  # [B, P] i32, P = max pages per sequence


@dataclasses.dataclass(frozen=True)
class ScheduledItem:
    """One sequence's share of a step: feed tokens[start:start+length]; sample if it reaches the end."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


@struct.dataclass
class PromptScores:
    """A scored prefill's per-position outputs: at position t of row b, the raw log-probability
    of the token after it (`targets[b, t]`), its rank there and the 20 most likely tokens."""

    logprobs: jax.Array  # [B, T] f32
    ranks: jax.Array  # [B, T] i32, 1 = the most likely token
    top_ids: jax.Array  # [B, T, 20] i32
    top_logprobs: jax.Array  # [B, T, 20] f32


SCORE_ROWS = 256  # a scored prefill computes the logits of this many positions at a time ([256, V])


def needs_scores(it: ScheduledItem) -> bool:
    """The item feeds prompt positions whose logprobs its request asked for and has not got."""
    start = it.seq.logits_needed_from
    return start is not None and it.start + it.length > start


@dataclasses.dataclass
class StepResult:
    """k sampled tokens per item: a prefill step has k = 1 (meaningful where item.samples);
    of a k-step decode call, item i's first `valid[i]` are real (its pages held them).
    A scored prefill (prompt logprobs) adds `scores`, PromptScores' arrays cut to [n, T, ...]."""

    tokens: np.ndarray  # [n, k] sampled ids
    logprobs: np.ndarray  # [n, k]
    top_ids: np.ndarray  # [n, k, 20]
    top_logprobs: np.ndarray  # [n, k, 20]
    valid: np.ndarray  # [n] i32
    scores: PromptScores | None = None


class Launched:
    """A dispatched call: its items, and its outputs on their way to the host. A verify call
    (speculative decoding) carries its drafts [n, k - 1] and num_drafts [n]: how many of its
    k samples each row keeps is known once they are read (`valid` is None until then)."""

    def __init__(self, items: list[ScheduledItem], decode: bool, k: int, out: SampleOutput,
                 valid: np.ndarray | None, chain_tokens: jax.Array | None, drafts: np.ndarray | None = None,
                 num_drafts: np.ndarray | None = None, scores: PromptScores | None = None):
        self.items, self.decode, self.k = items, decode, k
        self._out, self.valid = out, valid
        self._scores = scores
        self.drafts, self.num_drafts = drafts, num_drafts
        self.chain_tokens = chain_tokens  # [k, R] device tokens a next call may chain on (decode only)
        self.rows = {id(it.seq): i for i, it in enumerate(items)}
        for leaf in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs, *jax.tree.leaves(scores)):
            leaf.copy_to_host_async()
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """Wait for the outputs (the first call blocks until the device is done)."""
        if self._result is None:
            n, o = len(self.items), self._out
            if self.decode:  # [K, B, ...] -> [n, k, ...]
                take = lambda a: np.swapaxes(np.asarray(a), 0, 1)[:n]  # noqa: E731
            else:
                take = lambda a: np.asarray(a)[:n, None]  # noqa: E731
            tokens = take(o.tokens)
            if self.drafts is not None:
                self.valid = accepted_lengths(tokens, self.drafts, self.num_drafts)
            scores = None if self._scores is None else jax.tree.map(lambda a: np.asarray(a)[:n], self._scores)
            self._result = StepResult(tokens=tokens, logprobs=take(o.logprobs), top_ids=take(o.top_ids),
                                      top_logprobs=take(o.top_logprobs), valid=self.valid, scores=scores)
            self._out = self._scores = None
        return self._result


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


def resolve_attention(cfg: EngineConfig, ahead_of_time: bool = False) -> str:
    """The attention kernel a step uses: `cfg.attention_impl`, with "auto" resolved to Pallas on a
    GPU and, on a CPU, to the C++ decode kernel (layers/cpu_attention.py) where it is built and the
    pages are float32, else XLA. Steps compiled for another device (`ahead_of_time`) never use it."""
    store = kv_storage(cfg.kv_cache_dtype, cfg.dtype)[0]
    if cfg.attention_impl == "cpu":
        if ahead_of_time or jax.default_backend() != "cpu" or not cpu_attention.reads(store):
            raise ValueError(f"attention_impl cpu runs on a CPU over float32 KV pages; these are {store} "
                             f"on {'another target' if ahead_of_time else jax.default_backend()}")
        if cpu_attention.unavailable():
            raise ValueError(f"attention_impl cpu: the kernel is unavailable ({cpu_attention.unavailable()})")
        return "cpu"
    impl = resolve_impl(cfg.attention_impl)
    if (cfg.attention_impl == "auto" and impl == "xla" and not ahead_of_time and cpu_attention.reads(store)
            and cpu_attention.available()):
        return "cpu"
    return impl


class ModelRunner:
    """Owns the parameters, the KV cache and the compiled step executables."""

    @staticmethod
    def uses_cpu_matmul_kernel(cfg: EngineConfig, mesh: Mesh | None, target) -> bool:
        """W8A8 on this CPU, one device, not compiled for another target, and the kernel built."""
        return (cfg.quantization == "w8a8" and cfg.cpu_matmul_kernel and mesh is None and target is None
                and jax.default_backend() == "cpu" and not cpu_gemv.unavailable())

    def __init__(self, model_cfg: ModelConfig, params: dict, cfg: EngineConfig, num_pages: int,
                 mesh: Mesh | None = None, target: jax.sharding.Sharding | None = None,
                 kv_scales: np.ndarray | None = None):
        """`target`: compile ahead of time for another device (a GPU described
        by a compile-only topology: jaxserve/aot.py), placing every input there; params are ShapeDtypeStructs with
        that sharding and the KV cache stays abstract. Such a runner compiles but never runs.
        `kv_scales` [2, L]: an fp8 cache's per-layer K and V scales (checkpoint/kv_scales.py), constants
        of every step; None: 1.0."""
        self.model_cfg, self.cfg = model_cfg, cfg
        self.kv_scales = kv_scales
        # Tensor parallelism (layers/parallel.py): weights and KV cache split over `mesh` by heads;
        # every other input and output of a call is replicated. None: one device, no shardings.
        self.mesh = mesh
        if mesh is not None:
            parallel.check_divisible(model_cfg, mesh.size)
            params = jax.device_put(params, parallel.param_shardings(params, mesh))  # a no-op where placed
        self.params = params
        self.model = family(model_cfg)
        self.attention_impl = resolve_attention(cfg, target is not None)
        device = next(iter(target.device_set)) if target is not None else \
            mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
        if self.attention_impl == "pallas" and not pallas_reads_kv(cfg.kv_cache_dtype, device):
            why = (f"the Pallas attention kernels cannot read {cfg.kv_cache_dtype} KV pages on {device.device_kind} "
                   f"(compute capability {device.compute_capability}; float8 e4m3 needs 8.9)")
            if cfg.attention_impl != "auto":
                raise ValueError(f"{why}: use kv_cache_dtype int8 or fp8_e5m2, or attention_impl xla")
            log.warning("%s: attention runs on XLA", why)
            self.attention_impl = "xla"
        self.matmul_impl = "w8a8" if cfg.quantization == "w8a8" else resolve_impl(cfg.matmul_impl)
        if self.uses_cpu_matmul_kernel(cfg, mesh, target):  # few-row W8A8 products in the C++ kernel
            self.params = cpu_gemv.with_tiles(self.params)
            tiles = sum(a.nbytes for path, a in jax.tree_util.tree_leaves_with_path(self.params)
                        if "tiles" in jax.tree_util.keystr(path))
            log.info("W8A8 products of fewer than %d rows run in the CPU int8 kernel (%.0f MB of relaid weights)",
                     W8A8_MIN_ROWS, tiles / 2**20)
        # The platform the steps run on (an AOT target's): on a CPU fp8 pages are uint8 bits (`fp8_bits`).
        self.platform = device.platform
        self.fp8_bits = fp8_bits(cfg.kv_cache_dtype, self.platform)
        self.num_pages = num_pages
        self.page_size = cfg.page_size
        self.drop_slot = num_pages * cfg.page_size
        self.max_pages_per_seq = -(-cfg.max_model_len // cfg.page_size)
        if self.attention_impl == "pallas":
            # Context buckets pay where attention reads a bucket's whole width (XLA gathers and
            # attends over every slot of it). The Pallas kernels walk each sequence's block table
            # only up to its own length, so a wider table costs them nothing: one width serves
            # every context, and the narrower ones would only be compiled (the default buckets on a
            # GPU: 13 steps instead of 37).
            ctx_pages = [self.max_pages_per_seq]
        else:
            ctx_pages = sorted({-(-c // cfg.page_size) for c in cfg.context_buckets if c <= cfg.max_model_len})
            if not ctx_pages or ctx_pages[-1] < self.max_pages_per_seq:
                ctx_pages.append(self.max_pages_per_seq)
        self.context_page_buckets = tuple(ctx_pages)
        self.decode_batches = tuple(b for b in cfg.decode_batch_buckets if b < cfg.max_num_seqs) + (cfg.max_num_seqs,)
        self.prefill_batches = tuple(b for b in cfg.prefill_batch_buckets if b <= cfg.max_num_seqs)
        # No chunk is longer than a prompt, nor a prompt than max_model_len: lengths past the first
        # that holds max_model_len would compile steps that never run (with the default lengths
        # and max_model_len 128, every [B, 512] prefill).
        fits = [t for t in cfg.prefill_length_buckets if t >= cfg.max_model_len][:1]
        self.prefill_lengths = tuple(t for t in cfg.prefill_length_buckets if t < cfg.max_model_len) + tuple(fits)
        # (k, v) [L, NP, PS, K, D], and for an int8 cache (k_scale, v_scale) [L, NP, PS, K]
        init = functools.partial(init_kv_cache, model_cfg.num_layers, num_pages, cfg.page_size,
                                 model_cfg.num_kv_heads, model_cfg.head_dim, cfg.dtype, cfg.kv_cache_dtype,
                                 self.platform)
        # Under tensor parallelism each device creates only its KV heads' share of the pages.
        if target is not None:
            self.kv_cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target),
                                         jax.eval_shape(init))
        elif mesh is None:
            self.kv_cache = init()
        else:
            self.kv_cache = jax.jit(init, out_shardings=parallel.kv_shardings(jax.eval_shape(init), mesh))()
        # where a call's host inputs go: replicated over the mesh, on the AOT target, or jax's default
        self.input_sharding = target if target is not None else None if mesh is None else parallel.replicated(mesh)
        self._jitted = self._jit(self._step)
        self._jitted_decode = self._jit(self._decode_step)
        self._jitted_verify = self._jit(self._verify_step)
        self._jitted_scored = self._jit(self._scored_step)
        # Scored prefills (prompt logprobs, rare) are compiled when first asked for, not at warm-up.
        self._scored_executables: dict[tuple[int, int, int], object] = {}
        spec = cfg.speculative
        # Verify calls feed k + 1 tokens per row, for the batch sizes speculation runs at.
        self.verify_width = spec.num_speculative_tokens + 1 if spec.enabled else 0
        top = _bucket(min(spec.disable_above_batch_size, cfg.max_num_seqs), self.decode_batches)
        self.verify_batches = tuple(b for b in self.decode_batches if b <= top) if spec.enabled else ()
        self.judges_drafts = spec.method == "draft"  # verify calls take the draft's distributions
        self.max_decode_steps = cfg.decode_steps
        self.chain_rows = self.decode_batches[-1]  # rows of every decode call's chain output
        # prefill keys (B, T, P); decode keys (B, 0, P): any number of steps up to max_decode_steps
        self._executables: dict[tuple[int, int, int], object] = {}
        # Swap copies move whole pages; their page counts are padded to powers of two.
        self.swap_enabled = cfg.preemption_mode != "recompute" and cfg.swap_space_gib > 0
        self.swap_buckets = tuple(sorted({min(2**i, self.max_pages_per_seq)
                                          for i in range(self.max_pages_per_seq.bit_length() + 1)}))
        self._gather = jax.jit(lambda kv, ids: jax.tree.map(lambda c: c[:, ids], kv))
        self._scatter = jax.jit(
            lambda kv, ids, data: jax.tree.map(lambda c, d: c.at[:, ids].set(d, mode="drop"), kv, data),
            donate_argnums=(0,), **({} if mesh is None else {"out_shardings": self._kv_shardings()}))
        self._copy_executables: dict[tuple[str, int], object] = {}
        self.compile_seconds = 0.0

    # The jitted step --------------------------------------------------------------------

    def _jit(self, fn):
        """jit a step fn(params, kv_cache, ...) -> (outputs, kv_cache), the cache donated; under
        tensor parallelism the outputs are replicated and the cache keeps its sharding."""
        if self.mesh is None:
            return jax.jit(fn, donate_argnums=(1,))
        return jax.jit(fn, donate_argnums=(1,), out_shardings=(parallel.replicated(self.mesh), self._kv_shardings()))

    def _kv_shardings(self):
        return parallel.kv_shardings(self.kv_cache, self.mesh)

    def _logits(self, params, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> float32 logits [..., V], whole on every device (the sampler's input;
        under tensor parallelism each device computed its vocabulary shard)."""
        logits = self.model.logits_from_hidden(params, hidden, self.matmul_impl, self.cfg.interpret, self.mesh)
        if self.mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, parallel.replicated(self.mesh))
        return logits

    def _meta(self, inp: StepInputs) -> AttentionMetadata:
        return AttentionMetadata(positions=inp.positions, context_lens=inp.context_lens,
                                 slot_mapping=inp.slot_mapping, block_tables=inp.block_tables,
                                 sliding_window=self.model_cfg.sliding_window, attention_impl=self.attention_impl,
                                 matmul_impl=self.matmul_impl, interpret=self.cfg.interpret, mesh=self.mesh,
                                 kv_scales=self.kv_scales, fp8_bits=self.fp8_bits)

    def _prefill(self, params, kv_cache, inp: StepInputs, sampling: SamplingArrays):
        """The model over a prefill's tokens, sampling after each row's last one:
        (SampleOutput, hidden states [B, T, D], cache)."""
        meta = self._meta(inp)
        with jax.named_scope("model"):  # names the ops in a profile: model/..., sample/...
            hidden, kv_cache = self.model.forward_hidden(params, self.model_cfg, inp.tokens, meta, kv_cache)
            B = hidden.shape[0]
            last = hidden[jnp.arange(B), inp.last_index]  # [B, D]
            logits = self._logits(params, last)  # [B, V]
        with jax.named_scope("sample"):
            return sample(logits, sampling), hidden, kv_cache

    def _step(self, params, kv_cache, inp: StepInputs, sampling: SamplingArrays):
        out, _, kv_cache = self._prefill(params, kv_cache, inp, sampling)
        return out, kv_cache

    def _scored_step(self, params, kv_cache, inp: StepInputs, sampling: SamplingArrays, targets: jax.Array):
        """A prefill step that also scores every position: targets [B, T] are the tokens that
        follow each fed one (prompt logprobs). Returns ((SampleOutput, PromptScores), cache).
        The logits of all B * T positions are computed SCORE_ROWS at a time, so a [4, 512]
        prefill holds [256, V] of them at once rather than [2048, V]."""
        out, hidden, kv_cache = self._prefill(params, kv_cache, inp, sampling)
        B, T, D = hidden.shape
        with jax.named_scope("score"):
            rows = max(c for c in range(1, min(B * T, SCORE_ROWS) + 1) if B * T % c == 0)
            chunks = (hidden.reshape(B * T // rows, rows, D), targets.reshape(B * T // rows, rows))
            chosen, rank, top_lp, top_ids = jax.lax.map(
                lambda c: ranked_token_logprobs(self._logits(params, c[0]), c[1]), chunks)
            scores = PromptScores(logprobs=chosen.reshape(B, T), ranks=rank.reshape(B, T),
                                  top_ids=top_ids.reshape(B, T, -1),
                                  top_logprobs=top_lp.reshape(B, T, -1))
        return (out, scores), kv_cache

    def _verify_step(self, params, kv_cache, inp: StepInputs, sampling: SamplingArrays, draft_probs=None):
        """Speculative verification: feed [B, T] tokens (each row's last token, then its drafts)
        and sample after every one of them, as T decode steps would: position j with the
        row's counter + j and, for the penalties, a history holding the drafts before it.
        With a draft model's distributions draft_probs [B, T - 1, V], a draft is judged by
        speculative.accept_drafts instead of by equality with the sample. Returns
        SampleOutput laid out [T, B, ...] like a decode call's, and the cache."""
        meta = self._meta(inp)
        with jax.named_scope("model"):
            hidden, kv_cache = self.model.forward_hidden(params, self.model_cfg, inp.tokens, meta, kv_cache)
            B, T, D = hidden.shape
            logits = self._logits(params, hidden.reshape(B * T, D))  # [B * T, V]
        with jax.named_scope("sample"):
            H = sampling.history.shape[1]
            j = jnp.arange(T)
            # history of position j: the host's (through the row's last token) + drafts 1 .. j
            feeds = (j[None, :, None] >= j[None, None, :]) & (j[None, None, :] >= 1)  # [1, T (j), T (i)]
            at = jnp.where(feeds, inp.positions[:, None, :], H)  # [B, T, T], H: dropped
            history = jnp.broadcast_to(sampling.history[:, None, :], (B, T, H))
            history = history.at[jnp.arange(B)[:, None, None], j[None, :, None], at].set(
                jnp.broadcast_to(inp.tokens[:, None, :], (B, T, T)), mode="drop")
            flat = jax.tree.map(lambda a: jnp.repeat(a, T, axis=0), sampling).replace(
                counters=(sampling.counters[:, None] + j[None, :]).reshape(B * T),
                history=history.reshape(B * T, H))
            out = sample(logits, flat)
            if draft_probs is not None:
                out = self._judge_drafts(logits, flat, out, inp, draft_probs)
        return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(B, T, *a.shape[1:]), 0, 1), out), kv_cache

    @staticmethod
    def _judge_drafts(logits, flat: SamplingArrays, out: SampleOutput, inp: StepInputs, q) -> SampleOutput:
        """Replace the plain samples [B * T] at draft positions by rejection sampling's tokens
        (accepted draft or residual draw) and give the logprobs of the tokens kept."""
        B, T = inp.tokens.shape
        V = logits.shape[1]
        p = probabilities(logits, flat).reshape(B, T, V)
        gumbel = gumbel_noise(flat, V).reshape(B, T, V)
        uniform = uniform_noise(flat, ACCEPT_STREAM).reshape(B, T)[:, :T - 1]
        num_drafts = jnp.maximum(inp.context_lens - inp.positions[:, 0] - 1, 0)
        tokens = accept_drafts(p, q, inp.tokens[:, 1:], num_drafts, uniform, gumbel, out.tokens.reshape(B, T))
        tokens = tokens.reshape(B * T)
        chosen = jax.lax.cond(flat.logprobs.any(),
                              lambda: jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, None], -1)[:, 0],
                              lambda: out.logprobs)
        return out.replace(tokens=tokens, logprobs=chosen)

    def _forward_one(self, params, kv_cache, tokens: jax.Array, pos: jax.Array, alloc: jax.Array,
                     block_tables: jax.Array):
        """One token per row: tokens [B] at positions pos [B] -> logits [B, V] and the cache. A row's
        K/V is written where pos < alloc[b] (the tokens it holds pages for) and dropped past it;
        a row with alloc 0 (padding) sees nothing."""
        ps = self.page_size
        page = jnp.take_along_axis(block_tables, jnp.minimum(pos // ps, block_tables.shape[1] - 1)[:, None],
                                   axis=1)[:, 0]
        slot = jnp.where(pos < alloc, page * ps + pos % ps, self.drop_slot)
        ctx = jnp.where(alloc > 0, pos + 1, 0)
        meta = AttentionMetadata(positions=pos[:, None], context_lens=ctx, slot_mapping=slot[:, None],
                                 block_tables=block_tables, sliding_window=self.model_cfg.sliding_window,
                                 attention_impl=self.attention_impl, matmul_impl=self.matmul_impl,
                                 interpret=self.cfg.interpret, mesh=self.mesh, kv_scales=self.kv_scales,
                                 fp8_bits=self.fp8_bits)
        with jax.named_scope("model"):
            hidden, kv_cache = self.model.forward_hidden(params, self.model_cfg, tokens[:, None], meta, kv_cache)
            logits = self._logits(params, hidden[:, 0])
        return logits, kv_cache

    def _decode_step(self, params, kv_cache, inp: DecodeInputs, sampling: SamplingArrays, chain: jax.Array,
                     num_steps: jax.Array):
        """`num_steps` (<= K = max decode_steps) decode steps in one call, a loop on the device.
        chain [K, R]: the sampled tokens of the K-step call this one is chained on (rows named
        by inp.chain_row; zeros when none is). Returns SampleOutput with a leading step axis
        [K, B, ...] (steps past num_steps are zeros), its tokens padded to [K, R] for the next
        call to chain on, and the cache."""
        B = inp.tokens.shape[0]
        K = chain.shape[0]
        rows = jnp.arange(B)
        chained = inp.chain_row >= 0
        src = jnp.maximum(inp.chain_row, 0)
        tokens = jnp.where(chained, chain[-1, src], inp.tokens)  # [B]
        # The chained call's K tokens sit at positions start - K + 1 .. start of the history.
        hist_pos = inp.start[:, None] - K + 1 + jnp.arange(K)[None, :]  # [B, K]
        hist_pos = jnp.where(chained[:, None], hist_pos, sampling.history.shape[1])  # out of range: dropped
        history = sampling.history.at[rows[:, None], hist_pos].set(chain[:, src].T, mode="drop")
        n = min(NUM_TOP_LOGPROBS, self.model_cfg.vocab_size)
        outs = SampleOutput(tokens=jnp.zeros((K, B), jnp.int32), logprobs=jnp.zeros((K, B), jnp.float32),
                            top_ids=jnp.zeros((K, B, n), jnp.int32), top_logprobs=jnp.zeros((K, B, n), jnp.float32))

        def one(i, carry):
            kv, tok, hist, outs = carry
            pos = inp.start + i  # [B]
            logits, kv = self._forward_one(params, kv, tok, pos, inp.alloc, inp.block_tables)
            with jax.named_scope("sample"):
                out = sample(logits, sampling.replace(counters=sampling.counters + i, history=hist))
            hist = hist.at[rows, pos + 1].set(out.tokens, mode="drop")
            outs = jax.tree.map(lambda acc, x: jax.lax.dynamic_update_index_in_dim(acc, x, i, 0), outs, out)
            return kv, out.tokens, hist, outs

        kv_cache, _, _, outs = jax.lax.fori_loop(0, num_steps, one, (kv_cache, tokens, history, outs))
        chain_out = jnp.zeros_like(chain).at[:, :B].set(outs.tokens)  # [K, R]: what a next call chains on
        return (outs, chain_out), kv_cache

    # Buckets and compilation ----------------------------------------------------------

    def buckets(self) -> list[tuple[int, int, int]]:
        """Every shape a call can take: (B, T, P) of a prefill step, (B, 0, P) of a decode call,
        (B, -T, P) of a verify call (T = num_speculative_tokens + 1, speculation on)."""
        decode = [(b, 0, p) for b in self.decode_batches for p in self.context_page_buckets]
        prefill = [(b, t, p) for b in self.prefill_batches for t in self.prefill_lengths
                   for p in self.prefill_page_buckets(t)]
        verify = [(b, -self.verify_width, p) for b in self.verify_batches for p in self.context_page_buckets]
        return decode + prefill + verify

    def prefill_page_buckets(self, T: int) -> tuple[int, ...]:
        """Context widths (in pages) a [B, T] prefill compiles for: every context bucket from
        the smallest that holds T tokens (a fresh prompt, start 0) up to max_model_len (a later
        chunk of a long prompt, or the new tokens after a cached prefix). A prefill attends
        over the smallest that holds its rows' contexts: 130 new tokens after 400 cached ones
        read 512 slots, not 2048 (XLA's prefill attention is dense over every slot it reads)."""
        ps = self.page_size
        fresh = next(p for p in self.context_page_buckets if p * ps >= min(T, self.cfg.max_model_len))
        return tuple(p for p in self.context_page_buckets if p >= fresh)

    def _sds(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """An abstract host input of a call: replicated over the mesh under tensor parallelism."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.input_sharding)

    def _abstract_args(self, B: int, T: int, P: int):
        i32, f32 = jnp.int32, jnp.float32
        sds = self._sds
        NB = SamplingParams.MAX_LOGIT_BIAS
        if T == 0:  # a decode call
            inp = DecodeInputs(tokens=sds((B,), i32), chain_row=sds((B,), i32), start=sds((B,), i32),
                               alloc=sds((B,), i32), block_tables=sds((B, P), i32))
        else:  # prefill, or verify (T < 0)
            T = abs(T)
            inp = StepInputs(tokens=sds((B, T), i32), positions=sds((B, T), i32), slot_mapping=sds((B, T), i32),
                             block_tables=sds((B, P), i32), context_lens=sds((B,), i32), last_index=sds((B,), i32))
        H = P * self.page_size
        samp = SamplingArrays(
            temperature=sds((B,), f32), top_k=sds((B,), i32), top_p=sds((B,), f32), min_p=sds((B,), f32),
            presence_penalty=sds((B,), f32), frequency_penalty=sds((B,), f32), repetition_penalty=sds((B,), f32),
            seeds=sds((B,), jnp.uint32), counters=sds((B,), i32), history=sds((B, H), i32),
            prompt_lens=sds((B,), i32), logprobs=sds((B,), jnp.bool_),
            bias_ids=sds((B, NB), i32), bias_values=sds((B, NB), f32),
            min_tokens=sds((B,), i32), stop_ids=sds((B, STOP_ID_SLOTS), i32))
        like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)  # noqa: E731
        params, kv = jax.tree.map(like, self.params), jax.tree.map(like, self.kv_cache)
        if T == 0:
            return params, kv, inp, samp, sds((self.max_decode_steps, self.chain_rows), i32), sds((), i32)
        return params, kv, inp, samp

    def _label(self, key: tuple[int, int, int]) -> str:
        B, T, P = key
        return f"decode B={B} P={P}" if T == 0 else f"verify B={B} T={-T} P={P}" if T < 0 \
            else f"prefill B={B} T={T} P={P}"

    def _lower(self, key: tuple[int, int, int]):
        """The step of bucket `key` lowered for the abstract arguments (jax.stages.Lowered)."""
        fn = self._jitted_decode if key[1] == 0 else self._jitted_verify if key[1] < 0 else self._jitted
        args = self._abstract_args(*key)
        if key[1] < 0 and self.judges_drafts:  # a draft model's distributions [B, k, V]
            args += (self._sds((key[0], -key[1] - 1, self.model_cfg.vocab_size), jnp.float32),)
        return fn.lower(*args)

    def _compile(self, key: tuple[int, int, int]):
        return self._lower(key).compile()

    def warmup(self) -> float:
        """Compile every bucket ahead of time; returns the seconds it took."""
        t_all = time.perf_counter()
        for key in self.buckets():
            if key in self._executables:
                continue
            t0 = time.perf_counter()
            self._executables[key] = self._compile(key)
            log.info("compiled %s in %.2fs", self._label(key), time.perf_counter() - t0)
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
            kv = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.kv_cache)
            ids = self._sds((n,), jnp.int32)
            if kind == "out":
                exe = self._gather.lower(kv, ids).compile()
            else:
                data = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], n, *a.shape[2:]), a.dtype,
                                                                   sharding=a.sharding), kv)
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

    def run(self, items: list[ScheduledItem], decode: bool, k: int = 1) -> StepResult:
        """Launch a call and wait for its result (`launch` + `Launched.result`)."""
        return self.launch(items, decode, k).result()

    def executable(self, key: tuple[int, int, int]):
        exe = self._executables.get(key)
        if exe is None:  # not warmed up (tests may run a cold runner); compiled once, then kept
            exe = self._executables[key] = self._compile(key)
        return exe

    def launch(self, items: list[ScheduledItem], decode: bool, k: int = 1, chain: Launched | None = None) -> Launched:
        """Pad `items` into a bucket and dispatch the call; nothing waits for the device.
        A decode call runs k steps (k in `decode_steps`); `chain` (a decode call with the same
        k, still in flight or not) supplies the input tokens of the items that were in it.
        In a profile the whole of it is one `jaxserve.decode` or `jaxserve.prefill` scope."""
        with jax.profiler.TraceAnnotation("jaxserve.decode" if decode else "jaxserve.prefill", seqs=len(items)):
            if decode:
                return self._launch_decode(items, k, chain)
            return self._launch_prefill(items, score=any(needs_scores(it) for it in items))

    def _launch_prefill(self, items: list[ScheduledItem], score: bool = False) -> Launched:
        """A prefill call; `score`: the scored step, whose Launched carries each position's
        logprob of the token after it (prompt logprobs)."""
        B = _bucket(len(items), self.prefill_batches)
        T = _bucket(max(it.length for it in items), self.prefill_lengths)
        P = _bucket(max(-(-(it.start + it.length) // self.page_size) for it in items), self.prefill_page_buckets(T))
        inp, samp = self._host_arrays(items, B, T, P)
        valid = np.ones(len(items), np.int32)
        if score:
            targets = np.zeros((B, T), np.int32)
            for i, it in enumerate(items):
                nxt = it.seq.tokens[it.start + 1:it.start + it.length + 1]
                targets[i, :len(nxt)] = nxt
            (out, scores), self.kv_cache = self.scored_executable((B, T, P))(self.params, self.kv_cache, inp, samp,
                                                                             targets)
            return Launched(items, False, 1, out, valid, None, scores=scores)
        out, self.kv_cache = self.executable((B, T, P))(self.params, self.kv_cache, inp, samp)
        return Launched(items, False, 1, out, valid, None)

    def scored_executable(self, key: tuple[int, int, int]):
        """The scored prefill of bucket `key`, compiled on first use (a few seconds, once per
        bucket; the persistent compilation cache keeps it for the next start)."""
        exe = self._scored_executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            args = self._abstract_args(*key) + (self._sds(key[:2], jnp.int32),)
            exe = self._scored_executables[key] = self._jitted_scored.lower(*args).compile()
            log.info("compiled %s with prompt logprobs in %.2fs (first request that asked)", self._label(key),
                     time.perf_counter() - t0)
        return exe

    def _launch_decode(self, items: list[ScheduledItem], k: int, chain: Launched | None) -> Launched:
        """Row i feeds position items[i].start (its token: the host's, or the chained call's
        last sample when items[i].seq was in `chain`) and runs k steps; the steps whose K/V
        fall past the pages the sequence holds are not valid."""
        n, ps = len(items), self.page_size
        B = _bucket(n, self.decode_batches)
        # Pages up to the last position a step may write, within max_model_len (steps past a
        # row's pages are not valid: their K/V is dropped and their tokens discarded).
        P = _bucket(min(-(-(max(it.start for it in items) + k) // ps), self.max_pages_per_seq),
                    self.context_page_buckets)
        samp = self._sampling_arrays(items, B, P * ps, [it.seq.num_tokens for it in items])
        tokens, chain_row = np.zeros(B, np.int32), np.full(B, -1, np.int32)
        start, alloc = np.zeros(B, np.int32), np.zeros(B, np.int32)
        tables = np.zeros((B, P), np.int32)
        for i, it in enumerate(items):
            seq = it.seq
            start[i] = it.start
            alloc[i] = min(len(seq.pages), P) * ps
            tables[i, :min(len(seq.pages), P)] = seq.pages[:P]
            row = chain.rows.get(id(seq)) if chain is not None else None
            if row is None:
                tokens[i] = seq.token_at(it.start)
            else:
                chain_row[i] = row
        valid = np.clip(alloc[:n] - start[:n], 1, k).astype(np.int32)
        dinp = DecodeInputs(tokens=tokens, chain_row=chain_row, start=start, alloc=alloc, block_tables=tables)
        K = self.max_decode_steps
        chain_in = chain.chain_tokens if chain is not None else np.zeros((K, self.chain_rows), np.int32)
        (out, chain_tokens), self.kv_cache = self.executable((B, 0, P))(self.params, self.kv_cache, dinp, samp,
                                                                        chain_in, np.int32(k))
        return Launched(items, True, k, out, valid, chain_tokens)

    def launch_verify(self, items: list[ScheduledItem], drafts: list[list[int]], draft_probs=None) -> Launched:
        """Dispatch a verify call: row i feeds its last token (position items[i].start) and then
        drafts[i], which must fit in the pages the sequence holds; rows with fewer drafts than
        the call's width are padded with tokens that write nothing and are never kept.
        draft_probs [B, k, V] (a draft model's, on the device, rows as the call's): required
        with method "draft", whose drafts are judged by rejection sampling."""
        n, ps, T = len(items), self.page_size, self.verify_width
        k = T - 1
        B = _bucket(n, self.verify_batches)
        P = _bucket(min(-(-(max(it.start for it in items) + T) // ps), self.max_pages_per_seq),
                    self.context_page_buckets)
        tokens, positions = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
        slots = np.full((B, T), self.drop_slot, np.int32)
        tables, ctx = np.zeros((B, P), np.int32), np.zeros(B, np.int32)
        draft_ids, num_drafts = np.zeros((n, k), np.int32), np.zeros(n, np.int32)
        for i, (it, d) in enumerate(zip(items, drafts)):
            seq, s, m = it.seq, it.start, len(d)
            assert m <= k and s + m < len(seq.pages) * ps, "drafts past the call's width or the row's pages"
            pages = np.asarray(seq.pages, np.int32)
            tokens[i, 0] = seq.token_at(s)
            tokens[i, 1:m + 1] = d
            positions[i] = np.arange(s, s + T)
            pos = positions[i, :m + 1]
            slots[i, :m + 1] = pages[pos // ps] * ps + pos % ps
            tables[i, :min(len(pages), P)] = pages[:P]
            ctx[i] = s + m + 1
            draft_ids[i, :m], num_drafts[i] = d, m
        inp = StepInputs(tokens=tokens, positions=positions, slot_mapping=slots, block_tables=tables,
                         context_lens=ctx, last_index=np.zeros(B, np.int32))
        samp = self._sampling_arrays(items, B, P * ps, [it.seq.num_tokens for it in items])
        with jax.profiler.TraceAnnotation("jaxserve.verify", seqs=n):
            extra = (draft_probs,) if self.judges_drafts else ()
            out, self.kv_cache = self.executable((B, -T, P))(self.params, self.kv_cache, inp, samp, *extra)
        return Launched(items, True, T, out, None, None, draft_ids, num_drafts)

    def _host_arrays(self, items: list[ScheduledItem], B: int, T: int, P: int):
        """A prefill step's inputs: items[i] feeds tokens[start:start + length] of its sequence."""
        ps = self.page_size
        tokens = np.zeros((B, T), np.int32)
        positions = np.zeros((B, T), np.int32)
        slots = np.full((B, T), self.drop_slot, np.int32)
        tables = np.zeros((B, P), np.int32)
        ctx = np.zeros(B, np.int32)
        last = np.zeros(B, np.int32)
        for i, it in enumerate(items):
            seq, s, n = it.seq, it.start, it.length
            pages = np.asarray(seq.pages, np.int32)
            pos = np.arange(s, s + n, dtype=np.int32)
            tokens[i, :n] = seq.tokens[s:s + n]
            positions[i, :n] = pos
            slots[i, :n] = pages[pos // ps] * ps + pos % ps
            tables[i, :len(pages)] = pages[:P]
            ctx[i] = s + n
            last[i] = n - 1
        inp = StepInputs(tokens=tokens, positions=positions, slot_mapping=slots, block_tables=tables,
                         context_lens=ctx, last_index=last)
        # Tokens up to each chunk's end: the context bucket (the history's width) covers them;
        # a sample is only kept at the prompt's end, where they are all the tokens.
        return inp, self._sampling_arrays(items, B, P * ps, [it.start + it.length for it in items])

    def _sampling_arrays(self, items: list[ScheduledItem], B: int, H: int, known: list[int]) -> SamplingArrays:
        """Per-row sampling parameters; row i's history [H] holds the first known[i] tokens of
        its sequence. Its counter is the number of tokens it has made before this call's first
        sample: for a decode row fed position start, that is start + 1 - prompt length (tokens
        the host has not read yet, from a chained call, count too)."""
        f32 = np.float32
        temp, top_p, min_p = np.zeros(B, f32), np.ones(B, f32), np.zeros(B, f32)
        pres, freq, rep = np.zeros(B, f32), np.zeros(B, f32), np.ones(B, f32)
        top_k, counters, prompt_lens = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        seeds = np.zeros(B, np.uint32)
        want_logprobs = np.zeros(B, np.bool_)
        history = np.full((B, H), -1, np.int32)
        bias_ids = np.full((B, SamplingParams.MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((B, SamplingParams.MAX_LOGIT_BIAS), f32)
        min_tokens, stop_ids = np.zeros(B, np.int32), np.full((B, STOP_ID_SLOTS), -1, np.int32)
        for i, it in enumerate(items):
            seq, p = it.seq, it.seq.params
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            pres[i], freq[i], rep[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            prompt_lens[i] = len(seq.prompt_ids)
            seeds[i], counters[i] = seq.seed, max(it.start + it.length - prompt_lens[i], 0)
            want_logprobs[i] = p.logprobs is not None
            if p.logit_bias:
                bias_ids[i, :len(p.logit_bias)], bias_values[i, :len(p.logit_bias)] = zip(*p.logit_bias)
            if p.min_tokens:
                min_tokens[i] = p.min_tokens
                stop_ids[i, :len(seq.held_stop_ids)] = seq.held_stop_ids
            if pres[i] or freq[i] or rep[i] != 1:  # only penalties read the history
                history[i, :known[i]] = seq.tokens[:known[i]]
        return SamplingArrays(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=pres,
                              frequency_penalty=freq, repetition_penalty=rep, seeds=seeds, counters=counters,
                              history=history, prompt_lens=prompt_lens, logprobs=want_logprobs,
                              bias_ids=bias_ids, bias_values=bias_values, min_tokens=min_tokens, stop_ids=stop_ids)
