"""Model families, looked up by the HF `architectures` name of a checkpoint."""

from __future__ import annotations

from types import ModuleType

from jaxserve.config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxserve.models import llama

# Every family module exposes forward(params, cfg, tokens, meta, kv_cache) and forward_hidden(...).
REGISTRY: dict[str, ModuleType] = {arch: llama for arch in SUPPORTED_ARCHITECTURES}


def family(cfg: ModelConfig) -> ModuleType:
    return REGISTRY[cfg.architecture]
