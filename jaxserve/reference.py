"""One-sequence generation, the plain way: the reference path the batch engine is checked against.

One sequence owns a contiguous run of pages, the prompt is prefilled in one step
(padded to a power-of-two length so a handful of shapes get compiled), then tokens
are decoded one by one. No batching, no scheduling: easy to trust.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models import family


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << math.ceil(math.log2(max(n, 1))))


class ReferenceGenerator:
    """Greedy or sampled generation of a single sequence over its own paged KV cache."""

    def __init__(self, cfg: ModelConfig, params: dict, max_len: int | None = None, page_size: int = 16):
        self.cfg, self.params, self.page_size = cfg, params, page_size
        self.max_len = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.num_pages = -(-self.max_len // page_size)
        self.model = family(cfg)
        self._step = jax.jit(self._step_fn, donate_argnums=(4,))

    def _new_cache(self):
        dtype = self.params["final_norm"].dtype
        shape = (self.cfg.num_layers, self.num_pages, self.page_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def _step_fn(self, params, tokens, positions, last, kv_cache):
        """tokens, positions [1, T]; last: index of the token whose logits we want; -> (logits [V], cache)."""
        n_slots = self.num_pages * self.page_size
        valid = positions < n_slots
        meta = AttentionMetadata(
            positions=positions,
            context_lens=positions[:, last] + 1,
            slot_mapping=jnp.where(valid, positions, n_slots),
            block_tables=jnp.arange(self.num_pages, dtype=jnp.int32)[None, :],
            sliding_window=self.cfg.sliding_window,
        )
        hidden, kv_cache = self.model.forward_hidden(params, self.cfg, tokens, meta, kv_cache)
        logits = self.model.logits_from_hidden(params, hidden[0, last])
        return logits, kv_cache

    def stream(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               stop_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """Yield generated ids one at a time; stops at a stop id (yielded) or after max_new_tokens."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds max length {self.max_len}")
        T = _bucket(n)
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :n] = prompt_ids
        positions = np.arange(T, dtype=np.int32)[None, :]
        cache = self._new_cache()
        logits, cache = self._step(self.params, tokens, positions, n - 1, cache)
        key = jax.random.key(seed)
        for i in range(max_new_tokens):
            if temperature > 0:
                key, sub = jax.random.split(key)
                tok = int(jax.random.categorical(sub, logits / temperature))
            else:
                tok = int(jnp.argmax(logits))
            yield tok
            if tok in stop_ids or i == max_new_tokens - 1:
                return
            pos = np.array([[n + i]], np.int32)
            logits, cache = self._step(self.params, np.array([[tok]], np.int32), pos, 0, cache)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
        return list(self.stream(prompt_ids, max_new_tokens, **kwargs))


def paged_logits(params, cfg: ModelConfig, tokens: list[int], kv_cache_dtype: str = "auto", dtype: str = "float32",
                 page_size: int = 16, kv_scales: np.ndarray | None = None) -> np.ndarray:
    """Teacher-forced logits [T, V] of one sequence through the paged path, as the engine runs it:
    every key and value is written to a KV cache stored as `kv_cache_dtype` and read back from
    it (quantized, for int8 / fp8; `kv_scales` [2, L] are an fp8 cache's per-layer scales)
    before attention."""
    return paged_forward(params, cfg, tokens, kv_cache_dtype, dtype, page_size, kv_scales)[0]


def paged_forward(params, cfg: ModelConfig, tokens: list[int], kv_cache_dtype: str = "auto",
                  dtype: str = "float32", page_size: int = 16, kv_scales: np.ndarray | None = None):
    """`paged_logits` and the cache after it: (logits [T, V], kv_cache), the sequence's tokens in
    slots 0 .. T-1. One prefill over the whole sequence, padded to a multiple of 256 tokens
    (padding writes nothing) so few lengths compile."""
    from jaxserve.layers.attention import fp8_bits, init_kv_cache

    n = len(tokens)
    T = -(-n // 256) * 256
    num_pages = -(-T // page_size)
    platform = jax.default_backend()
    kv = init_kv_cache(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, kv_cache_dtype,
                       platform)
    pos = np.arange(T, dtype=np.int32)
    meta = AttentionMetadata(positions=jnp.asarray(pos[None]), context_lens=jnp.asarray([n], jnp.int32),
                             slot_mapping=jnp.asarray(np.where(pos < n, pos, num_pages * page_size)[None]),
                             block_tables=jnp.arange(num_pages, dtype=jnp.int32)[None],
                             sliding_window=cfg.sliding_window,
                             kv_scales=None if kv_scales is None else jnp.asarray(kv_scales, jnp.float32),
                             fp8_bits=fp8_bits(kv_cache_dtype, platform))
    padded = np.zeros((1, T), np.int32)
    padded[0, :n] = tokens
    logits, kv = _paged_forward(family(cfg).forward, params, cfg, jnp.asarray(padded), meta, kv)
    return np.asarray(logits[0, :n]), kv


@functools.partial(jax.jit, static_argnums=(0, 2))
def _paged_forward(forward, params, cfg, tokens, meta, kv):
    return forward(params, cfg, tokens, meta, kv)
