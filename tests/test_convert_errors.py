"""Bad input to `jaxserve convert`: one line naming the problem, a non-zero exit, nothing at DST.

Runs the real command line in a subprocess (`python -m jaxserve convert`), as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_models import build


def run_convert(src, dst, *args):
    return subprocess.run([sys.executable, "-m", "jaxserve", "convert", str(src), str(dst), "--quiet", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tiny"
    build("llama").save_pretrained(d)
    return d


def _check_refused(proc, dst, *words):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("jaxserve convert: error:")
    for w in words:
        assert w in lines[0], lines[0]
    assert not dst.exists()
    assert not list(dst.parent.glob(f".{dst.name}.tmp-*"))


def test_directory_without_config(tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    _check_refused(run_convert(src, tmp_path / "out"), tmp_path / "out", "no config.json", str(src))


def test_unsupported_architecture(tmp_path, hf_dir):
    src = tmp_path / "gpt"
    src.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    _check_refused(run_convert(src, tmp_path / "out"), tmp_path / "out", "unsupported architecture", "GPTNeoXForCausalLM")


def test_truncated_safetensors(tmp_path, hf_dir):
    src = tmp_path / "trunc"
    src.mkdir()
    (src / "config.json").write_text((hf_dir / "config.json").read_text())
    data = (hf_dir / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    _check_refused(run_convert(src, tmp_path / "out"), tmp_path / "out", "truncated safetensors", "model.safetensors")


def test_existing_destination(tmp_path, hf_dir):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    proc = run_convert(hf_dir, dst)
    assert proc.returncode != 0
    assert "already exists" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]  # untouched


def test_sharded_checkpoint_converts(tmp_path):
    """A sharded save (index + several files) converts to the same parameters as a single file."""
    import numpy as np

    from jaxserve.checkpoint.load import load_params

    model = build("qwen2")
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for name in ("one", "sharded"):
        assert run_convert(tmp_path / name, tmp_path / f"{name}-out").returncode == 0
    a, b = load_params(tmp_path / "one-out"), load_params(tmp_path / "sharded-out")
    np.testing.assert_array_equal(np.asarray(a["layers"]["wq"]), np.asarray(b["layers"]["wq"]))
    np.testing.assert_array_equal(np.asarray(a["embed"]), np.asarray(b["embed"]))


def test_kv_calibration_without_its_text_or_a_tokenizer(tmp_path, hf_dir):
    """A calibration file that is not there is refused before any weight is read; one that is
    there needs the model's tokenizer, which this source lacks."""
    dst = tmp_path / "out"
    _check_refused(run_convert(hf_dir, dst, "--kv-calibration", str(tmp_path / "nowhere.txt")), dst,
                   "--kv-calibration", "nowhere.txt")
    text = tmp_path / "calibration.txt"
    text.write_text("Some text to calibrate on. " * 20)
    _check_refused(run_convert(hf_dir, dst, "--kv-calibration", str(text)), dst, "tokenizer.json")
