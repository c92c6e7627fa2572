"""A small, strict reader for Hugging Face safetensors checkpoints (single file or sharded).

Written here rather than through `safetensors.numpy` because numpy has no bfloat16
(`ml_dtypes` gives us one) and because a truncated file must give an error that
names the file and the missing bytes, not a crash deep in a memory map.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from jaxserve.checkpoint.errors import ConversionError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_header(path: Path) -> tuple[dict, int]:
    """Return (tensor table, offset of the data section), checking the file holds all of it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConversionError(f"truncated safetensors file {path}: no header")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise ConversionError(f"truncated safetensors file {path}: header of {n} bytes, file is {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConversionError(f"corrupt safetensors file {path}: header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    data_start = 8 + n
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if data_start + end > size:
        raise ConversionError(
            f"truncated safetensors file {path}: tensors need {data_start + end} bytes, file has {size}")
    return header, data_start


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of one .safetensors file (memory-mapped)."""
    header, data_start = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ConversionError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        yield name, mm[data_start + a:data_start + b].view(dtype).reshape(info["shape"])


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The .safetensors files of a HF model directory: the index's shards, or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{index}: missing shard(s) {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{model_dir}: no .safetensors files")
    return files
