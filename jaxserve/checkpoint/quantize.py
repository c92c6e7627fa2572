"""Weight-only quantization of a converted parameter pytree (formats: pallas_kernels/quantized_matmul/ref.py).

The seven matmul weights of every decoder layer (wq, wk, wv, wo, w_gate, w_up, w_down)
and an untied lm_head become dicts the quantized linear layer recognises:
    int8  {"q8": int8 [.., K, N], "scale": float32 [.., N]}
    int4  {"q4": uint8 [.., K/2, N], "scale", "low": float32 [.., K/G, N]}
Norms and biases stay float. An untied embedding stays float (a gather, a small share of
a big model); a tied one is also the lm_head, a quarter of a small model like SmolLM2,
so it becomes int8 with one scale per row: {"q8": int8 [V, D], "scale": [V]} (also in
int4 mode). Stacked layer weights [L, K, N] are quantized layer by layer.

For W8A8 (`rotate=True`, int8 only) each weight is quantized rotated, as R^T W, and keeps the
signs of its rotation beside it ("signs": float32 [.., K]; the tied table is quantized as E R,
signs [D]): int8 activations lose far less to outlier channels in that basis
(jaxserve/layers/rotation.py).
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxserve.layers.rotation import block_size, input_signs, rotate_weight, unrotate_weight
from pallas_kernels.quantized_matmul.ref import quantize_int4, quantize_int8, unpack_int4

log = logging.getLogger(__name__)

MODES = ("int8", "int4")
LAYER_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _quantize(w: np.ndarray, mode: str, group_size: int, refine_steps: int) -> dict:
    """[K, N] or stacked [L, K, N] float -> the quantized dict (stacked the same way)."""
    if mode == "int8":
        names, fn = ("q8", "scale"), quantize_int8
    else:
        names, fn = ("q4", "scale", "low"), lambda a: quantize_int4(a, group_size, refine_steps)
    if w.ndim == 2:
        return {n: np.asarray(a) for n, a in zip(names, fn(w))}
    parts = [fn(w[i]) for i in range(w.shape[0])]
    return {n: np.stack([np.asarray(p[j]) for p in parts]) for j, n in enumerate(names)}


def quantize_params(params: dict, mode: str, group_size: int = 128, refine_steps: int = 8,
                    rotate: bool = False) -> dict:
    """`refine_steps`: int4's least-squares rounds (pallas_kernels/quantized_matmul/ref.py);
    0 keeps plain min/max scaling, which scripts/quant_quality.py measures against.
    `rotate`: quantize int8 weights in the rotated basis W8A8 multiplies in (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unsupported quantization {mode!r} (supported: {', '.join(MODES)})")
    if rotate and mode != "int8":
        raise ValueError("rotated weights are for W8A8, whose weights are int8")

    def quantize(w: np.ndarray, mode: str = mode) -> dict:  # [.., K, N]
        w = np.asarray(w, np.float32)
        K = w.shape[-2]
        if not rotate or block_size(K) < 2:
            return _quantize(w, mode, group_size, refine_steps)
        signs = input_signs(K)
        q = _quantize(rotate_weight(w, signs), mode, group_size, refine_steps)
        return {**q, "signs": np.broadcast_to(signs, (*w.shape[:-2], K)).copy()}

    out = dict(params)
    out["layers"] = dict(params["layers"])
    for name in LAYER_WEIGHTS:
        out["layers"][name] = quantize(params["layers"][name])
    if "lm_head" in params:
        out["lm_head"] = quantize(params["lm_head"])
    else:
        # Tied: the table [V, D] is both the lookup and the lm_head; int8 with one scale per
        # row (per token: a row scale for the lookup, an output-channel scale for the head).
        # Quantized as its transpose [D, V], so rotated it is (R^T E^T)^T = E R.
        q = quantize(np.asarray(params["embed"], np.float32).T, "int8")
        out["embed"] = {"q8": np.asarray(q["q8"]).T.copy(), "scale": np.asarray(q["scale"])}
        if "signs" in q:
            out["embed"]["signs"] = q["signs"]
    return out


def quantize_at_load(params: dict, mode: str | None) -> dict:
    """The engine's `quantization` option over a loaded pytree: "int8" and "w8a8" both need int8
    weights, so a float checkpoint is quantized here (per channel, as `convert --quantize int8`
    does, in a second or two) and an int8 one is kept; an int4 checkpoint is refused. For
    "w8a8" a float checkpoint is quantized rotated; an int8 one was quantized unrotated and is
    run so (requantizing it would round twice), with a warning: its quality is lower."""
    if mode is None:
        return params
    wq = params["layers"]["wq"]
    if isinstance(wq, dict):
        if "q8" not in wq:
            raise ValueError(f"quantization={mode!r} needs float or int8 weights; this checkpoint is int4")
        if mode == "w8a8" and "signs" not in wq:
            log.warning("w8a8 over an int8 checkpoint: its weights were quantized unrotated, so int8 activations "
                        "lose more (BENCHMARKS.md); a float checkpoint is quantized rotated at load")
        return params
    rotate = mode == "w8a8"
    return jax.tree.map(jax.numpy.asarray, quantize_params(jax.tree.map(np.asarray, params), "int8", rotate=rotate))


def dequantize(w: dict) -> np.ndarray:
    """One quantized weight dict [K, N] -> the float32 [K, N] it stands for (a rotated one,
    R^T W, is rotated back: W = R (R^T W))."""
    if "q8" in w:
        got = np.asarray(w["q8"], np.float32) * np.asarray(w["scale"], np.float32)
        return unrotate_weight(got, np.asarray(w["signs"])) if "signs" in w else got
    return np.asarray(unpack_int4(w["q4"], w["scale"], w["low"]))


def param_bytes(params: dict) -> int:
    return sum(np.asarray(a).nbytes for a in jax.tree.leaves(params))
