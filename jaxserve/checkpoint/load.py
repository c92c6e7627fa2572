"""Restore a converted model directory: config, parameter pytree (Orbax), tokenizer."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig


def load_params(model_dir: str | Path, dtype: str | None = None) -> dict:
    """Restore `model_dir/params` as a pytree of device arrays, optionally cast to `dtype`."""
    import orbax.checkpoint as ocp

    path = Path(model_dir).absolute() / "params"
    if not path.is_dir():
        raise FileNotFoundError(f"{model_dir}: no params/ checkpoint (convert the model with `jaxserve convert`)")
    params = ocp.StandardCheckpointer().restore(path)
    # Orbax hands back host numpy arrays; put them on the device once, or every jitted
    # call would copy the whole model again.
    # Quantized weights (int8, packed int4) keep their integer type; only floats are cast.
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype if jnp.issubdtype(a.dtype, jnp.floating) else None),
                        params)


def load_model(model_dir: str | Path, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, params) of a converted model directory."""
    return ModelConfig.from_dir(model_dir), load_params(model_dir, dtype)
