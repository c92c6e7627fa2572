"""Hugging Face (safetensors) or GGUF -> Orbax checkpoint directory.

Layout of a converted model directory (what `jaxserve.checkpoint.load` reads):

    DST/config.json              HF config (architecture, shapes, rope, special ids)
    DST/tokenizer.json           HF `tokenizers` file
    DST/tokenizer_config.json    chat template, special tokens
    DST/generation_config.json
    DST/params/                  Orbax checkpoint of the stacked parameter pytree
                                 (see jaxserve.models.llama for its shapes)

Everything is first written to a hidden temporary directory beside DST and renamed
at the end, so a failed conversion never leaves a half-written DST.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np
from tqdm import tqdm

from jaxserve.checkpoint.errors import ConversionError
from jaxserve.checkpoint.safetensors_io import checkpoint_files, iter_tensors
from jaxserve.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json")

# HF name inside a decoder block -> (our name, transpose to input-major)
_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False), "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def expected_shapes(cfg: ModelConfig) -> dict:
    """The parameter pytree's shapes for `cfg` (stacked layers; see jaxserve.models.llama)."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {"attn_norm": (L, D), "mlp_norm": (L, D), "wq": (L, D, Q), "wk": (L, D, KV), "wv": (L, D, KV),
              "wo": (L, Q, D), "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
    if cfg.qkv_bias:
        layers.update(bq=(L, Q), bk=(L, KV), bv=(L, KV))
    shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def build_params(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype) -> dict:
    """Place HF-named tensors ([out, in] layout) into the stacked, input-major pytree."""
    shapes = expected_shapes(cfg)
    params = {"layers": {k: np.zeros(s, dtype) for k, s in shapes["layers"].items()}}
    seen = set()

    def put(key, arr, target, index=None):
        want = shapes["layers"][key][1:] if index is not None else shapes[key]
        if tuple(arr.shape) != tuple(want):
            raise ConversionError(f"tensor {name} has shape {tuple(arr.shape)}, expected {tuple(want)}")
        if index is None:
            target[key] = np.asarray(arr, dtype=dtype)
        else:
            target[key][index] = arr

    for name, arr in tensors:
        m = _LAYER_RE.match(name)
        if m:
            layer, rest = int(m.group(1)), m.group(2)
            if rest.endswith("rotary_emb.inv_freq"):
                continue
            if rest not in _LAYER_MAP or layer >= cfg.num_layers:
                raise ConversionError(f"unexpected tensor {name}")
            key, transpose = _LAYER_MAP[rest]
            if key not in shapes["layers"]:
                raise ConversionError(f"unexpected tensor {name} for this config")
            put(key, arr.T if transpose else arr, params["layers"], layer)
            seen.add((key, layer))
        elif name == "model.embed_tokens.weight":
            put("embed", arr, params)
        elif name == "model.norm.weight":
            put("final_norm", arr, params)
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue  # a tied model may still store the copy
            put("lm_head", arr.T, params)
        else:
            raise ConversionError(f"unexpected tensor {name}")
    missing = [f"model.layers.{i}.{hf}" for hf, (key, _) in _LAYER_MAP.items() if key in shapes["layers"]
               for i in range(cfg.num_layers) if (key, i) not in seen]
    missing += [k for k in ("embed", "final_norm", "lm_head") if k in shapes and k not in params]
    if missing:
        raise ConversionError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    return params


def _read_source(src: Path):
    """(hf config dict, tensor iterator, number of tensors, {tokenizer file name: text or path})."""
    if src.is_file() and src.suffix == ".gguf":
        from jaxserve.checkpoint.gguf_io import GGUFCheckpoint

        g = GGUFCheckpoint(src)
        return g.hf_config(), g.tensors(), len(g.reader.tensors), g.tokenizer_files()
    if not src.exists():
        raise ConversionError(f"{src}: no such file or directory")
    if not src.is_dir():
        raise ConversionError(f"{src}: expected a Hugging Face model directory or a .gguf file")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{src}: no config.json (expected a Hugging Face model directory or a .gguf file)")
    try:
        hf = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ConversionError(f"{cfg_path}: not valid JSON ({e})") from None
    files = checkpoint_files(src)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for f in files:
            yield from iter_tensors(f)

    from jaxserve.checkpoint.safetensors_io import read_header
    count = sum(len(read_header(f)[0]) for f in files)  # also checks every file for truncation
    tok_files = {n: src / n for n in TOKENIZER_FILES if (src / n).is_file()}
    return hf, tensors(), count, tok_files


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "float32", progress: bool = True,
            quantize: str | None = None, group_size: int = 128, kv_calibration: str | os.PathLike | None = None,
            kv_calibration_tokens: int = 2048) -> Path:
    """Convert SRC (HF dir or .gguf) into an Orbax model directory at DST; returns DST.

    `quantize` = "int8" | "int4" stores the matmul weights weight-only quantized
    (jaxserve/checkpoint/quantize.py); config.json records it under "jaxserve_quantization".
    `kv_calibration`, a text file: the converted model runs over its first
    `kv_calibration_tokens` tokens and writes per-layer fp8 KV scales and key transforms
    (checkpoint/kv_scales.py)."""
    from jaxserve.checkpoint.quantize import MODES, quantize_params

    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"unsupported --dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if quantize is not None and quantize not in MODES:
        raise ConversionError(f"unsupported --quantize {quantize!r} (supported: {', '.join(MODES)})")
    if dst.exists():
        raise ConversionError(f"{dst}: already exists; remove it or choose another destination")
    calibration_text = _calibration_text(kv_calibration, kv_calibration_tokens)
    hf, tensors, count, tok_files = _read_source(src)
    if calibration_text is not None and "tokenizer.json" not in tok_files:
        raise ConversionError(f"--kv-calibration needs the model's tokenizer; {src} has no tokenizer.json")
    if quantize == "int4" and (hint := int4_group_hint(src, group_size)):
        log.warning(hint)
    try:
        cfg = ModelConfig.from_hf(hf)
    except ConfigError as e:
        raise ConversionError(f"{src}: {e}") from None
    bar = tqdm(tensors, total=count, desc=f"converting {src.name}", unit="tensor", disable=not progress)
    params = build_params(cfg, bar, DTYPES[dtype])
    if quantize is not None:
        params = quantize_params(params, quantize, group_size)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        hf = dict(hf, torch_dtype=dtype)
        if quantize is not None:
            hf["jaxserve_quantization"] = {"mode": quantize, "group_size": group_size}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, default=_json_default))
        for name, content in tok_files.items():
            if isinstance(content, Path):
                shutil.copyfile(content, tmp / name)
            else:
                (tmp / name).write_text(content)
        save_params(tmp / "params", params)
        if calibration_text is not None:
            _calibrate_kv(tmp, cfg, params, calibration_text, Path(kv_calibration).name, kv_calibration_tokens)
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _calibration_text(path: str | os.PathLike | None, tokens: int) -> str | None:
    """The calibration file's text, checked before any weight is read."""
    if path is None:
        return None
    if tokens < 16:
        raise ConversionError(f"--kv-calibration-tokens must be at least 16, got {tokens}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"--kv-calibration {path}: {e}") from None
    if not text.strip():
        raise ConversionError(f"--kv-calibration {path}: the file is empty")
    return text


def _calibrate_kv(model_dir: Path, cfg: ModelConfig, params, text: str, name: str, max_tokens: int) -> None:
    from jaxserve.checkpoint import kv_scales
    from jaxserve.tokenizer import Tokenizer

    tokens = Tokenizer(model_dir).encode(text, add_special_tokens=False)[:min(max_tokens, cfg.max_position_embeddings)]
    if len(tokens) < 16:
        raise ConversionError(f"--kv-calibration {name}: {len(tokens)} tokens; give a text of at least 16")
    scales, keys = kv_scales.calibrate(params, cfg, tokens)
    path = kv_scales.save(model_dir, scales, {"text": name, "tokens": len(tokens)}, keys)
    log.info("fp8 KV scales and key transforms from %d tokens of %s written to %s and %s", len(tokens), name,
             path.name, kv_scales.KEYS_FILE)


def int4_group_hint(src: Path, group_size: int) -> str | None:
    """A word for someone quantizing a 4-bit GGUF to int4 with groups larger than its blocks."""
    if not (src.is_file() and src.suffix == ".gguf"):
        return None
    from jaxserve.checkpoint.gguf_io import GGUFCheckpoint

    block = GGUFCheckpoint(src).four_bit_block()
    if block is None or group_size <= block:
        return None
    return (f"{src.name} holds its weights as 4-bit blocks of {block}: int4 with groups of {group_size} rounds "
            f"them again onto a coarser grid and loses accuracy; --group-size {block} keeps them as they are")


def save_params(path: Path, params: dict) -> None:
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path.absolute(), params)
    ckptr.wait_until_finished()


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
