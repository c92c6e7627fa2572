"""Pure-jnp references for the paged attention kernels: gather every page, mask, softmax.

Shapes: q [B, T, Hq, D] (T = 1 for decode); caches [L, NP, PS, K, D]; scales
[L, NP, PS, K] or None; block_tables [B, P]; context_lens [B] (keys visible after
this step's writes); q_positions [B, T]. Returns [B, T, Hq, D] in q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_pages(cache: jax.Array, scales: jax.Array | None, layer, block_tables: jax.Array) -> jax.Array:
    """[L, NP, PS, K, D] -> this layer's keys of each sequence in order, float32 [B, P*PS, K, D]."""
    B, P = block_tables.shape
    _, _, PS, K, D = cache.shape
    pages = cache[layer][block_tables].astype(jnp.float32)  # [B, P, PS, K, D]
    if scales is not None:
        pages = pages * scales[layer][block_tables][..., None]
    return pages.reshape(B, P * PS, K, D)


def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, q_positions, *, layer=0, scale=None,
                        k_scales=None, v_scales=None, soft_cap=None, sliding_window=None):
    B, T, Hq, D = q.shape
    K = k_cache.shape[3]
    G = Hq // K
    scale = D ** -0.5 if scale is None else scale
    k = gather_pages(k_cache, k_scales, layer, block_tables)
    v = gather_pages(v_cache, v_scales, layer, block_tables)
    S = k.shape[1]
    qf = q.astype(jnp.float32).reshape(B, T, K, G, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k, precision="highest") * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    k_pos = jnp.arange(S)[None, None, :]
    visible = (k_pos <= q_positions[:, :, None]) & (k_pos < context_lens[:, None, None])  # [B, T, S]
    if sliding_window is not None:
        visible &= k_pos > q_positions[:, :, None] - sliding_window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(visible[:, None, None], p, 0.0)  # rows with nothing visible give 0, not NaN
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, precision="highest")
    return out.reshape(B, T, Hq, D).astype(q.dtype)
