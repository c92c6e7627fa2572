"""Per-layer scales of an fp8 KV cache, calibrated once and kept in the checkpoint.

An fp8 cache stores each layer's keys as k / s_k and values as v / s_v (both Hadamard-rotated,
layers/attention.py). Without calibration s = 1: values are kept as they are, which suits a
model whose K/V stay well inside e4m3's range (|x| <= 448) but leaves a model with larger
activations clipped, and small ones in fp8's coarse subnormals. `jaxserve convert
--kv-calibration TEXT` runs the converted model over a calibration text, takes each layer's
largest |rotated K| and |rotated V| and writes s = amax / 448 to kv_scales.json in the
checkpoint, so that text's largest value is stored as e4m3's largest (e5m2 holds it too).
Values past it at serving time saturate. The engine reads the file whenever the cache is fp8.

    kv_scales.json  {"k": [L floats], "v": [L floats], "calibration": {"tokens": n, "text": name}}
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FILE = "kv_scales.json"
FP8_E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE = 2.0 ** -14  # a layer whose calibration K or V is all zero keeps a finite scale


def calibrate(params, cfg, tokens: list[int]) -> np.ndarray:
    """[2, L] float32: amax / 448 of each layer's rotated keys (row 0) and values (row 1) over
    `tokens`, run through the paged path with a float cache (float32 activations)."""
    from jaxserve.layers.attention import rotate
    from jaxserve.reference import paged_forward

    _, (k, v) = paged_forward(params, cfg, tokens)
    n = len(tokens)
    scales = []
    for cache in (k, v):  # [L, NP, PS, K, D]; the sequence fills slots 0 .. n-1
        L = cache.shape[0]
        x = cache.reshape(L, -1, *cache.shape[3:])[:, :n]
        amax = np.abs(np.asarray(rotate(x), np.float32)).max(axis=(1, 2, 3))
        scales.append(np.maximum(amax / FP8_E4M3_MAX, MIN_SCALE))
    return np.stack(scales).astype(np.float32)


def save(model_dir: str | Path, scales: np.ndarray, calibration: dict) -> Path:
    path = Path(model_dir) / FILE
    path.write_text(json.dumps({"k": [float(x) for x in scales[0]], "v": [float(x) for x in scales[1]],
                                "calibration": calibration}, indent=2) + "\n")
    return path


def load(model_dir: str | Path, num_layers: int) -> np.ndarray | None:
    """The checkpoint's [2, L] scales, or None without kv_scales.json; a malformed file is a
    ValueError naming it (a wrong scale would quietly garble every fp8 page)."""
    path = Path(model_dir) / FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        scales = np.asarray([raw["k"], raw["v"]], np.float64)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a KV scale file ({type(e).__name__}: {e})") from None
    if scales.shape != (2, num_layers) or not (np.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError(f"{path}: 'k' and 'v' must each hold {num_layers} positive finite scales, one per layer")
    return scales.astype(np.float32)
