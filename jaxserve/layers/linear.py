"""The one dispatch point for matmuls with weights: float, int8 or int4 weight-only.

A weight is a float array [K, N], or a quantized dict (jaxserve/checkpoint/quantize.py):
{"q8", "scale"} or {"q4", "scale", "low"}. `impl` picks how a quantized weight is multiplied:
  "pallas"  the Pallas kernels (pallas_kernels/quantized_matmul), which read the
            quantized bytes and widen them in registers: the GPU path;
  "xla"     dequantize inside the jitted step and run one XLA dot (the reference,
            and the path everywhere but a GPU);
  "auto"    pallas on a GPU, xla elsewhere.
Float weights always take a plain XLA dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import int4_matmul, int8_matmul, unpack_int4

IMPLS = ("auto", "pallas", "xla")


def resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r} (choose from {', '.join(IMPLS)})")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def linear(x: jax.Array, w, impl: str = "xla", interpret: bool = False) -> jax.Array:
    """x [..., K] @ w -> [..., N] in x's dtype."""
    if not isinstance(w, dict):
        return x @ w
    lead, K = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, K)
    if "q8" in w:
        if impl == "pallas":
            y = int8_matmul(flat, w["q8"], w["scale"], interpret=interpret)
        else:
            y = (flat @ w["q8"].astype(x.dtype)) * w["scale"].astype(x.dtype)
    else:
        if impl == "pallas":
            y = int4_matmul(flat, w["q4"], w["scale"], w["low"], interpret=interpret)
        else:
            y = flat @ unpack_int4(w["q4"], w["scale"], w["low"]).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1]).astype(x.dtype)


def embed(table, tokens: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Embedding lookup; an int8 table {"q8" [V, D], "scale" [V]} is dequantized row by row."""
    if not isinstance(table, dict):
        return table[tokens]
    return (table["q8"][tokens].astype(dtype) * table["scale"][tokens][..., None].astype(dtype))


def tied_logits(hidden: jax.Array, table) -> jax.Array:
    """hidden [..., D] against the embedding table [V, D] (tied lm_head) -> [..., V].

    An int8 table's per-row scales are per output channel of this product, so they are
    applied after the dot. (Always XLA: the table is [V, D], not the kernels' [K, N].)"""
    if not isinstance(table, dict):
        return jnp.einsum("...D,VD->...V", hidden, table)
    out = jnp.einsum("...D,VD->...V", hidden, table["q8"].astype(hidden.dtype))
    return out * table["scale"].astype(hidden.dtype)
