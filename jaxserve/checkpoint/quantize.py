"""Weight-only quantization of a converted parameter pytree (formats: pallas_kernels/quantized_matmul/ref.py).

The seven matmul weights of every decoder layer (wq, wk, wv, wo, w_gate, w_up, w_down)
and an untied lm_head become dicts the quantized linear layer recognises:
    int8  {"q8": int8 [.., K, N], "scale": float32 [.., N]}
    int4  {"q4": uint8 [.., K/2, N], "scale", "low": float32 [.., K/G, N]}
Norms and biases stay float. An untied embedding stays float (a gather, a small share of
a big model); a tied one is also the lm_head, a quarter of a small model like SmolLM2,
so it becomes int8 with one scale per row: {"q8": int8 [V, D], "scale": [V]} (also in
int4 mode). Stacked layer weights [L, K, N] are quantized layer by layer.
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels.quantized_matmul.ref import quantize_int4, quantize_int8, unpack_int4

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


def quantize_params(params: dict, mode: str, group_size: int = 128, refine_steps: int = 8) -> dict:
    """`refine_steps`: int4's least-squares rounds (pallas_kernels/quantized_matmul/ref.py);
    0 keeps plain min/max scaling, which scripts/quant_quality.py measures against."""
    if mode not in MODES:
        raise ValueError(f"unsupported quantization {mode!r} (supported: {', '.join(MODES)})")
    out = dict(params)
    out["layers"] = dict(params["layers"])
    for name in LAYER_WEIGHTS:
        out["layers"][name] = _quantize(np.asarray(params["layers"][name], np.float32), mode, group_size, refine_steps)
    if "lm_head" in params:
        out["lm_head"] = _quantize(np.asarray(params["lm_head"], np.float32), mode, group_size, refine_steps)
    else:
        # Tied: the table [V, D] is both the lookup and the lm_head; int8 with one scale per
        # row (per token: a row scale for the lookup, an output-channel scale for the head).
        q, s = quantize_int8(np.asarray(params["embed"], np.float32).T)
        out["embed"] = {"q8": np.asarray(q).T.copy(), "scale": np.asarray(s)}
    return out


def quantize_at_load(params: dict, mode: str | None) -> dict:
    """The engine's `quantization` option over a loaded pytree: "int8" and "w8a8" both need int8
    weights, so a float checkpoint is quantized here (per channel, as `convert --quantize int8`
    does, in a second or two) and an int8 one is kept; an int4 checkpoint is refused."""
    if mode is None:
        return params
    wq = params["layers"]["wq"]
    if isinstance(wq, dict):
        if "q8" in wq:
            return params
        raise ValueError(f"quantization={mode!r} needs float or int8 weights; this checkpoint is int4")
    return jax.tree.map(jax.numpy.asarray, quantize_params(jax.tree.map(np.asarray, params), "int8"))


def dequantize(w: dict) -> np.ndarray:
    """One quantized weight dict [K, N] -> the float32 [K, N] it stands for."""
    if "q8" in w:
        return np.asarray(w["q8"], np.float32) * np.asarray(w["scale"], np.float32)
    return np.asarray(unpack_int4(w["q4"], w["scale"], w["low"]))


def param_bytes(params: dict) -> int:
    return sum(np.asarray(a).nbytes for a in jax.tree.leaves(params))
