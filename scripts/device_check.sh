#!/usr/bin/env bash
# The prepared GPU check (one H200, no network, Python 3.12, jax 0.11 + CUDA 13 plugin there):
# kernel tests with interpret=False (float, int8 and fp8 KV pages), the kernel benchmark (decode
# attention over int8 KV pages against bf16 ones among its rows), and end-to-end generation with the
# Pallas kernels against XLA at SmolLM2-135M and Llama-3-8B shapes (random weights: no
# checkpoint is carried), then the same split over every GPU where there are several (tensor
# parallelism; skipped with a message on one). Beside each measured decode step time, jaxserve/aot.py's
# roofline model of it (BENCHMARKS.md, "GPU steps compiled without a GPU"). Everything goes to one
# results file; it should finish in < 8 min.
#
#   scripts/device_check.sh [RESULTS_FILE]     (default: $OUT/device_results.txt or ./device_results.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-.}/device_results.txt}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PALLAS_INTERPRET=0
# What the project needs beyond jax that the device lacks, carried as wheels (if any).
[ -d .device_wheels ] && "$PY" -m pip install --quiet --no-index --find-links .device_wheels \
  flax orbax-checkpoint tokenizers jinja2 safetensors gguf tqdm pytest >/dev/null 2>&1
{
  echo "== $(date -u) $(hostname)"
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  echo "== kernel tests on the GPU (interpret=False)"
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -25
  echo "== kernel benchmark"
  timeout 150 "$PY" scripts/bench_kernels.py --peak-gbps 4800 --peak-tflops 989 2>&1
  echo "== end to end: pallas vs xla"
  timeout 120 "$PY" scripts/device_e2e.py 2>&1
  echo "== tensor parallel: pallas and xla split over every GPU against xla on one"
  NGPU=$("$PY" -c "import jax; print(jax.device_count())" 2>/dev/null || echo 1)
  if [ "${NGPU:-1}" -gt 1 ]; then
    timeout 150 "$PY" scripts/device_e2e.py --tensor-parallel "$NGPU" --shapes llama-3-8b 2>&1
  else
    echo "skipped: this machine has ${NGPU:-1} GPU (tensor parallelism needs 2 or more)"
  fi
  echo "== done $(date -u)"
} > "$RESULTS" 2>&1
cat "$RESULTS"
