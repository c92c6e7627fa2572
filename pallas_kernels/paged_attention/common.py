"""What the decode and prefill kernels share: reading one page of K/V, and one page's step
of the online softmax (running max m, running sum l, accumulator acc; rows are queries)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG = -1e30


def whole(x):
    """A block that is the whole array (the kernel indexes it itself, e.g. pages of the cache)."""
    return pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n)


def load_page(k_ref, v_ref, scale_refs, layer, page, h):
    """K and V of one page for KV head h, float32 [PS, D]; int8 pages are scaled per token."""
    k = k_ref[layer, page, :, h, :].astype(jnp.float32)
    v = v_ref[layer, page, :, h, :].astype(jnp.float32)
    if scale_refs:
        ks_ref, vs_ref = scale_refs
        k = k * ks_ref[layer, page, :, h].astype(jnp.float32)[:, None]
        v = v * vs_ref[layer, page, :, h].astype(jnp.float32)[:, None]
    return k, v


def online_softmax_step(carry, s, visible, soft_cap, weighted_values):
    """Fold one page's scores s [R, PS] (visible [R, PS] or broadcastable) into the carry;
    weighted_values(p [R, PS]) -> [R, D] is p @ V of the page."""
    m, l, acc = carry
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[:, None] + weighted_values(p)


def initial_carry(rows: int, D: int):
    return jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, D), jnp.float32)


def normalised(l, acc, dtype):
    """acc / l, with rows that saw no key left at 0 instead of NaN."""
    return (acc / jnp.maximum(l, 1e-30)[:, None]).astype(dtype)
