"""Calibration of an fp8 KV cache, done once and kept in the checkpoint: a scale per layer for
keys and one for values, and a key transform per layer and KV head.

An fp8 cache stores each layer's keys as k / s_k and values as v / s_v (both Hadamard-rotated,
layers/attention.py). Without calibration s = 1: values are kept as they are, which suits a
model whose K/V stay well inside e4m3's range (|x| <= 448) but leaves a model with larger
activations clipped, and small ones in fp8's coarse subnormals. `jaxserve convert
--kv-calibration TEXT` runs the converted model over a calibration text, takes each layer's
largest stored |K| and |V| and writes s = amax / 448, so that text's largest value is stored
as e4m3's largest (e5m2 holds it too). Values past it at serving time saturate.

The key transform. A float format rounds every element to the same relative precision (e4m3:
3 mantissa bits), so rescaling channels changes nothing, but the basis keys are stored in
does: a key stored as k M and read back as (k M + e) M^-1 errs in the score q . k by
(q M^-T) . e, each element of e proportional to the stored element it rounds. With M = W H
(H the Hadamard matrix, W symmetric) the expected squared score error is, per channel i of the
stored basis, (H W^-1 Q W^-1 H)_ii (H W K W H)_ii (Q = E[q q^T] over the layer's queries of
that KV head, K = E[k k^T] over its keys). Hadamard alone (W = I) spreads both over every
channel: about tr(Q) tr(K) / D. `key_balance` picks W with W^-1 Q W^-1 and W K W one matrix (up
to a factor), which makes it tr((K^1/2 Q K^1/2)^1/2)^2 / D, smaller unless Q and K have the
same shape (Cauchy-Schwarz). A layer's queries and keys do not: over SmolLM2's layers and
heads the calibration predicts 1.3-4.9x less (median 2.4x). Queries are compared as q W^-1 H,
so scores are unchanged in exact arithmetic, and the step's matmul by H becomes one by W H: no
cost at serving time.
Measured (BENCHMARKS.md "Quantized KV cache quality"): the mean KL divergence from the float
cache falls by a third on chat prompts and by half on a 1,500-token passage.

    kv_scales.json  {"k": [L floats], "v": [L floats], "calibration": {"tokens": n, "text": name},
                     "keys": "kv_keys.npy"}
    kv_keys.npy     [L, K, D, D] float32: W of each layer and KV head ("keys" absent: W = I)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FILE = "kv_scales.json"
KEYS_FILE = "kv_keys.npy"
FP8_E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE = 2.0 ** -14  # a layer whose calibration K or V is all zero keeps a finite scale
# Added to Q and K before balancing, as a fraction of each one's mean eigenvalue: keys span few
# directions, and an undamped K^-1/2 would stretch the ones they never use without bound.
DAMPING = 0.03


def _sqrtm(a: np.ndarray, power: float = 0.5) -> np.ndarray:
    w, u = np.linalg.eigh(a)
    return (u * np.maximum(w, 0.0) ** power) @ u.T


def key_balance(q2: np.ndarray, k2: np.ndarray, damping: float = DAMPING) -> np.ndarray:
    """W [D, D], symmetric positive definite with determinant 1, such that W^-1 Q W^-1 and W K W
    are one matrix up to a factor, for the damped second moments Q = q2 and K = k2 [D, D]:
    S = W^2 solves S K S = Q, whose solution is K^-1/2 (K^1/2 Q K^1/2)^1/2 K^-1/2. The factor
    (determinant 1) keeps the keys' magnitudes; the fp8 scale is calibrated after it anyway."""
    D = q2.shape[0]
    q2 = q2 + (damping * np.trace(q2) / D + 1e-12) * np.eye(D)
    k2 = k2 + (damping * np.trace(k2) / D + 1e-12) * np.eye(D)
    kh, kih = _sqrtm(k2), _sqrtm(k2, -0.5)
    s = kih @ _sqrtm(kh @ q2 @ kh) @ kih
    w = _sqrtm((s + s.T) / 2)
    return w / np.exp(np.mean(np.log(np.linalg.eigvalsh(w))))


def _hadamard(D: int) -> np.ndarray:
    """The rotation `attention.rotate` applies: Hadamard, or none where D is not a power of 2."""
    from jaxserve.layers.rotation import hadamard

    h = hadamard(D)
    return np.eye(D) if h is None else h.astype(np.float64)


def key_transforms(keys: np.ndarray) -> np.ndarray:
    """keys [L, K, D, D] (W per layer and KV head) -> [L, 2, K, D, D]: the matrices a step
    multiplies keys (W H) and queries (W^-1 H) by, in place of H (layers/attention.py)."""
    w, h = keys.astype(np.float64), _hadamard(keys.shape[-1])
    return np.stack([w @ h, np.linalg.inv(w) @ h], axis=1).astype(np.float32)


def with_key_transforms(params: dict, keys: np.ndarray) -> dict:
    """params with the step matrices of `keys` [L, K, D, D] as a layer parameter (on the default
    device; the runner places them by KV head under tensor parallelism)."""
    import jax.numpy as jnp

    from jaxserve.layers.attention import KEY_TRANSFORM

    return {**params, "layers": {**params["layers"], KEY_TRANSFORM: jnp.asarray(key_transforms(keys))}}


def calibrate(params, cfg, tokens: list[int], balance: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(scales [2, L], keys [L, K, D, D]) over `tokens`, run cache-free in the params' dtype:
    each layer and KV head's `key_balance` from its queries' and keys' second moments (W = I
    without `balance`: Hadamard alone, for comparison), then amax / 448 of each layer's keys
    as stored (k W H) and values (v H)."""
    from jaxserve.models import family

    L, K, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    keys = np.zeros((L, K, D, D), np.float32)
    amax = np.zeros((2, L), np.float64)
    rotation = _hadamard(D)
    for layer, (q, k, v) in enumerate(family(cfg).activations(params, cfg, tokens)):
        q = np.asarray(q, np.float64).reshape(len(tokens), K, G, D)  # [T, Hq, D], grouped by KV head
        k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)  # [T, K, D]
        for h in range(K):
            qh = q[:, h].reshape(-1, D)
            keys[layer, h] = key_balance(qh.T @ qh / len(qh), k[:, h].T @ k[:, h] / len(k)) if balance else np.eye(D)
        stored_k = np.einsum("tkd,kde->tke", k, keys[layer] @ rotation)  # k W H, as `key_transforms` makes it
        amax[:, layer] = np.abs(stored_k).max(), np.abs(v @ rotation).max()
    return np.maximum(amax / FP8_E4M3_MAX, MIN_SCALE).astype(np.float32), keys


def save(model_dir: str | Path, scales: np.ndarray, calibration: dict, keys: np.ndarray | None = None) -> Path:
    """kv_scales.json, and kv_keys.npy when `keys` [L, K, D, D] are given."""
    raw = {"k": [float(x) for x in scales[0]], "v": [float(x) for x in scales[1]], "calibration": calibration}
    if keys is not None:
        np.save(Path(model_dir) / KEYS_FILE, np.asarray(keys, np.float32))
        raw["keys"] = KEYS_FILE
    path = Path(model_dir) / FILE
    path.write_text(json.dumps(raw, indent=2) + "\n")
    return path


def load(model_dir: str | Path, cfg) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The checkpoint's fp8 KV calibration, read once: (scales [2, L], or None without
    kv_scales.json; key transforms [L, K, D, D], or None where the file names none: W = I,
    Hadamard alone). A malformed scale file is a ValueError naming it (a wrong scale would
    quietly garble every fp8 page), and so is a named key file that is missing or of the wrong
    shape: the K scales were calibrated for those keys, so it is not a fallback."""
    raw = _read(model_dir)
    if raw is None:
        return None, None
    return _scales(raw, Path(model_dir) / FILE, cfg.num_layers), _keys(raw, Path(model_dir), cfg)


def _scales(raw: dict, path: Path, num_layers: int) -> np.ndarray:
    try:
        scales = np.asarray([raw["k"], raw["v"]], np.float64)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a KV scale file ({type(e).__name__}: {e})") from None
    if scales.shape != (2, num_layers) or not (np.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError(f"{path}: 'k' and 'v' must each hold {num_layers} positive finite scales, one per layer")
    return scales.astype(np.float32)


def _keys(raw: dict, model_dir: Path, cfg) -> np.ndarray | None:
    if "keys" not in raw:
        return None
    path = model_dir / str(raw["keys"])
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    try:
        keys = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir / FILE} names {path.name}, which cannot be read: {e}") from None
    if keys.shape != shape or not np.isfinite(keys).all():
        raise ValueError(f"{path}: key transforms must be finite, of shape {shape}; got {keys.shape}")
    return keys.astype(np.float32)


def _read(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a KV scale file ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a KV scale file (a JSON object expected)")
    return raw
