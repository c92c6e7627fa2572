"""Hadamard rotations: exact changes of basis that make int8 rounding cheaper.

Two users. The quantized KV cache stores keys and values rotated by one [D, D] Hadamard
matrix (layers/attention.py, `rotate`). W8A8 multiplies every weight's inputs rotated
(`rotate_inputs`): x @ W = (x R) @ (R^T W) for an orthonormal R, so the product is the same
function, but the int8 rounding is not. A decoder's activations have a few channels many
times larger than the rest; with one absmax scale per token they set the scale and the
other channels keep a handful of int8 levels. R mixes each channel into 64, so a token's
energy is spread evenly and its scale fits all of them. QuaRot (Ashkboos et al., 2024) does
this with whole-width rotations folded into the model; here R is a block-diagonal Hadamard
with random signs, R = diag(s) . blockdiag(H_b, ..., H_b) with b the largest power of two
dividing K, at most 64: applied online as a [.., K/b, b] x [b, b] product (a few percent of
a layer's multiply-adds, 9-15 % of a W8A8 layer stack's time at 64-256 rows on our CPUs),
and defined for any width a model has (576 and 1536 here).

On the default model (scripts/quant_quality.py's 8 chat prompts, teacher-forced, int8
weights and int8 activations in every matmul and the lm_head) the mean KL divergence from
the float32 model's next-token distribution falls from 0.0435 to 0.0054 with the rotation
(int8 weight-only: 0.0046), top-1 agreement from 89.6 % to 97.1 % (BENCHMARKS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MAX_BLOCK = 64


def hadamard(D: int) -> np.ndarray | None:
    """The orthonormal Hadamard matrix [D, D] (Sylvester's construction), None unless D is a power of 2."""
    if D < 2 or D & (D - 1):
        return None
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < D:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(D)


def block_size(K: int) -> int:
    """The Hadamard block for inputs of width K: the largest power of two dividing K, <= 64."""
    return min(K & -K, MAX_BLOCK)


def input_signs(K: int) -> np.ndarray:
    """The random signs s [K] of the rotation for width K: fixed (seeded by K), so every weight
    with K inputs is rotated the same way and a checkpoint need not store them to be read."""
    return np.random.default_rng(K).choice(np.array([-1.0, 1.0], np.float32), K)


def _blocks(x: jax.Array) -> jax.Array:
    """x [..., K] @ blockdiag(H_b, ...) (H_b is symmetric, so this is also its transpose)."""
    K = x.shape[-1]
    b = block_size(K)
    y = jnp.matmul(x.reshape(*x.shape[:-1], K // b, b), jnp.asarray(hadamard(b)), precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape)


def rotate_inputs(x: jax.Array) -> jax.Array:
    """x [..., K] -> x R in x's dtype: a rotated weight's inputs.

    The signs are a function of K, so they enter the step as a constant, not as the weight's
    "signs" leaf: XLA then computes one rotation per distinct input (wq, wk and wv share one,
    w_gate and w_up another) instead of one per weight. With one per weight, the rotations
    cost 40 % of a 64-row W8A8 layer stack on our CPUs (scripts/bench_matmul_paths.py)."""
    return _blocks(x.astype(jnp.float32) * input_signs(x.shape[-1])).astype(x.dtype)


def unrotate_rows(x: jax.Array) -> jax.Array:
    """x R [..., K] -> x: rows of a rotated embedding table back to the model's basis."""
    return (_blocks(x.astype(jnp.float32)) * input_signs(x.shape[-1])).astype(x.dtype)


def _mix_rows(w: np.ndarray) -> np.ndarray:
    """W [.., K, N] -> blockdiag(H_b, ...) @ W (numpy): rows mixed within each block of b."""
    K, N = w.shape[-2:]
    b = block_size(K)
    blocks = np.asarray(w, np.float32).reshape(*w.shape[:-2], K // b, b, N)
    return np.einsum("ij,...bjn->...bin", hadamard(b), blocks).reshape(w.shape)


def rotate_weight(w: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """W [.., K, N] -> R^T W (numpy, at load): rows scaled by s, then mixed within blocks."""
    return _mix_rows(np.asarray(w, np.float32) * signs[:, None])


def unrotate_weight(w: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """R^T W [.., K, N] -> W (numpy): mixed within blocks (H_b H_b = I), then rows scaled by s."""
    return _mix_rows(w) * signs[..., :, None]


def unsigned(w: dict) -> dict:
    """A rotated weight without its "signs" leaf: the arrays the products and shardings read."""
    return {k: a for k, a in w.items() if k != "signs"}
