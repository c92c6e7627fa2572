"""Decode attention on a CPU through a small C++ kernel (kernels/paged_decode_attention.cc),
called from jitted steps as an XLA FFI custom call: `attention_impl = "cpu"`.

Why: XLA:CPU's gather-then-reduce decode attention reads K/V at a few GB/s and over every slot
of the context bucket; the kernel reads each sequence's pages in place, only up to its context
length, with all query heads of a KV head sharing each load (BENCHMARKS.md, issue 16).

The kernel is compiled on first use (layers/cpu_kernels.py: the machine's C++ compiler, for this
CPU, cached). Where it cannot be built (no compiler), `unavailable()` says why (logged once) and
"auto" falls back to XLA's attention.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers import cpu_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_decode_attention.cc"
TARGET = "jaxserve_paged_decode_attention"


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Build, load and register the kernel (once); None when it is ready, else why it is not."""
    why = cpu_kernels.load(SOURCE, "JaxservePagedDecodeAttention", TARGET)
    if why:
        log.warning("CPU decode attention kernel unavailable, attention runs on XLA: %s", why)
    return why


def available() -> bool:
    """Whether the kernel is built and registered."""
    return unavailable() is None


def reads(cache_dtype) -> bool:
    """The kernel reads float32 pages only (the model's dtype on a CPU); quantized and
    bfloat16 caches use XLA's attention."""
    return jnp.dtype(cache_dtype) == jnp.float32


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           context_lens: jax.Array, positions: jax.Array, layer: jax.Array,
                           sliding_window: int | None = None) -> jax.Array:
    """One query token per sequence against its pages.

    q [B, Hq, D] float32; k_cache, v_cache [L, NP, PS, K, D] float32 (whole: the kernel indexes
    the layer, so no slice is copied); block_tables [B, P], context_lens [B], positions [B]
    int32; layer [] int32. Returns [B, Hq, D] float32, attend_one's result (to float rounding);
    a row that sees no key gets zeros.
    """
    if unavailable():
        raise RuntimeError(f"CPU decode attention kernel unavailable: {unavailable()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return call(q.astype(jnp.float32), k_cache, v_cache, i32(block_tables), i32(context_lens), i32(positions),
                i32(layer), sliding_window=np.int64(sliding_window or 0))
