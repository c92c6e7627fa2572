"""Restore a converted model directory: config, parameter pytree (Orbax), tokenizer."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.layers import parallel


def load_params(model_dir: str | Path, dtype: str | None = None, mesh: Mesh | None = None) -> dict:
    """Restore `model_dir/params` as a pytree of device arrays, optionally cast to `dtype`.

    With a tensor-parallel `mesh` every array is restored straight into its sharding
    (layers/parallel.py): each device reads only its shard, so a model larger than one
    device's memory loads."""
    import orbax.checkpoint as ocp

    path = Path(model_dir).absolute() / "params"
    if not path.is_dir():
        raise FileNotFoundError(f"{model_dir}: no params/ checkpoint (convert the model with `jaxserve convert`)")
    if mesh is not None:
        return _restore_sharded(ocp.StandardCheckpointer(), path, dtype, mesh)
    params = ocp.StandardCheckpointer().restore(path)
    # Orbax hands back host numpy arrays; put them on the device once, or every jitted
    # call would copy the whole model again.
    # Quantized weights (int8, packed int4) keep their integer type; only floats are cast.
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype if jnp.issubdtype(a.dtype, jnp.floating) else None),
                        params)


def _restore_sharded(checkpointer, path: Path, dtype: str | None, mesh: Mesh) -> dict:
    meta = checkpointer.metadata(path).item_metadata.tree
    shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), meta)
    shardings = parallel.param_shardings(shapes, mesh)
    cast = lambda dt: dtype if dtype is not None and jnp.issubdtype(dt, jnp.floating) else dt  # noqa: E731
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, cast(a.dtype), sharding=s), shapes, shardings)
    return checkpointer.restore(path, target)


def load_model(model_dir: str | Path, dtype: str | None = None, mesh: Mesh | None = None,
               what: str = "the model") -> tuple[ModelConfig, dict]:
    """(config, params) of a converted model directory, split over `mesh` when given: a model
    whose heads do not divide the mesh is refused (naming `what`) before any weight is read."""
    cfg = ModelConfig.from_dir(model_dir)
    if mesh is not None:
        parallel.check_divisible(cfg, mesh.size, what)
    return cfg, load_params(model_dir, dtype, mesh)
