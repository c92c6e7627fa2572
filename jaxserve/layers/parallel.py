"""Tensor parallelism: one model over a 1-D device mesh, Megatron's split expressed as shardings.

Every device holds 1/N of each layer's heads and of the MLP's hidden units:

    wq, wk, wv, w_gate, w_up   [L, D, N_out]  split by output columns  P(None, None, "tp")
    bq, bk, bv                 [L, N_out]     follow their columns     P(None, "tp")
    wo, w_down                 [L, N_in, D]   split by input rows      P(None, "tp", None)
    embed [V, D], lm_head [D, V]              split by vocabulary
    norms                                     replicated
    KV cache (k, v) [L, NP, PS, K, Dh]        split by KV heads        P(None, None, None, "tp", None)
             scales [L, NP, PS, K]                                     P(None, None, None, "tp")

so a layer's attention and MLP need no communication until the row-parallel projections,
whose partial sums XLA's partitioner all-reduces: two all-reduces per layer, and no weight
ever moves. Quantized weights are dicts whose scales follow their weight: a column-parallel
weight's per-output-channel scale is split with it, a row-parallel one's is whole on every
device (int4's per-group scales are split by input rows like the packed weight).

Attention runs per shard (`shard_map`) whatever the kernel: each device writes and reads its
own KV heads' pages. (The XLA path gathers pages as flat [page, PS*K*Dh] rows, a layout the
partitioner cannot split by head; per shard it is the single-device code unchanged.) The
Pallas matmul kernels run per shard too; XLA's dots go through the partitioner.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.layers.attention import KEY_TRANSFORM
from jaxserve.layers.rotation import unsigned

AXIS = "tp"
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")
BIASES = ("bq", "bk", "bv")


def make_mesh(n: int) -> Mesh | None:
    """A 1-D mesh over the first n local devices, or None for n = 1 (the single-device path)."""
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    if n == 1:
        return None
    devices = jax.local_devices()
    if len(devices) < n:
        raise ValueError(f"tensor_parallel_size {n} needs {n} devices; this process sees {len(devices)} "
                         f"({devices[0].platform})")
    return Mesh(np.asarray(devices[:n]), (AXIS,))


def check_divisible(cfg: ModelConfig, n: int, what: str = "the model") -> None:
    """Heads, KV heads and the MLP's hidden size must split evenly over n devices."""
    for name, value in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                        ("MLP hidden units (intermediate_size)", cfg.intermediate_size)):
        if value % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide {what}'s {value} {name}; "
                             f"choose a size that divides {cfg.num_heads} heads and {cfg.num_kv_heads} KV heads")


def _split(shape: tuple[int, ...], axis: int, n: int) -> P:
    """P with AXIS at `axis` (negative counts from the end), or replicated if that dim does not divide n."""
    axis %= len(shape)
    if shape[axis] % n:
        return P()
    return P(*([None] * axis), AXIS)


def weight_specs(split: str, w, n: int):
    """Specs of one matmul weight, float [.., K, N] or a quantized dict, split "column" (by
    outputs) or "row" (by inputs); a weight whose dimension does not divide n stays whole.
    A W8A8 weight's rotation signs are whole on every device (its inputs are rotated whole)."""
    if isinstance(w, dict) and "signs" in w:
        return {**weight_specs(split, unsigned(w), n), "signs": P()}
    if split == "column":  # outputs split: the weight's and every scale's last axis
        return jax.tree.map(lambda a: _split(a.shape, -1, n), w)
    if not isinstance(w, dict):  # ROW: inputs split
        return _split(w.shape, -2, n)
    if "q8" in w:  # a per-output-channel scale is whole on every shard
        return {"q8": _split(w["q8"].shape, -2, n), "scale": P()}
    specs = {k: _split(a.shape, -2, n) for k, a in w.items()}  # int4: packed rows and group scales by rows
    return specs if all(s != P() for s in specs.values()) else {k: P() for k in w}


def param_specs(params: dict, n: int) -> dict:
    """PartitionSpecs for a parameter pytree (layers stacked [L, ...]); leaves may be abstract."""
    layers = params["layers"]
    specs = {"layers": {}}
    for name, w in layers.items():
        if name in COLUMN or name in ROW:
            specs["layers"][name] = weight_specs("column" if name in COLUMN else "row", w, n)
        elif name in BIASES:
            specs["layers"][name] = _split(w.shape, -1, n)
        elif name == KEY_TRANSFORM:  # [L, 2, K, Dh, Dh]: each device its KV heads' transforms
            specs["layers"][name] = _split(w.shape, 2, n)
        else:
            specs["layers"][name] = P()
    # The vocabulary: embed [V, D] (int8: q8 [V, D], scale [V]) and lm_head [D, V] by V.
    specs["embed"] = jax.tree.map(lambda a: _split(a.shape, 0, n), params["embed"])
    if isinstance(params["embed"], dict) and "signs" in params["embed"]:  # W8A8's rotation: [D], whole
        specs["embed"]["signs"] = P()
    if "lm_head" in params:
        specs["lm_head"] = weight_specs("column", params["lm_head"], n)
    for name in params:
        specs.setdefault(name, P())
    return specs


def param_shardings(params: dict, mesh: Mesh) -> dict:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh.size),
                        is_leaf=lambda x: isinstance(x, P))


def kv_specs(kv_cache) -> tuple[P, ...]:
    """(k, v) [L, NP, PS, K, Dh] and int8 scales [L, NP, PS, K]: split by KV heads (axis 3)."""
    return tuple(P(None, None, None, AXIS) for _ in kv_cache)


def kv_shardings(kv_cache, mesh: Mesh):
    return tuple(NamedSharding(mesh, s) for s in kv_specs(kv_cache))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def bytes_per_device(tree) -> dict[int, int]:
    """Bytes each device holds of a pytree of arrays: {device id: bytes} from the shards."""
    out: dict[int, int] = {}
    for a in jax.tree.leaves(tree):
        for shard in a.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
