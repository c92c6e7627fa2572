# The two commands a newcomer needs: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL := checkpoints/smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: serve cluster generate test install install-test install-cluster install-bench install-gpu-aot gpu-aot model bench-latency bench-throughput bench-compare clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test,cluster]'
	touch $@

$(VENV)/.installed-cluster: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[cluster]'
	touch $@

# Debian's Prometheus and Chromium, for the tests that scrape a live server with a real
# Prometheus and load its dashboard in a real browser.
/usr/bin/prometheus /usr/bin/chromium:
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(notdir $@) >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(notdir $@) >/dev/null; }

# A second environment with jax's CUDA plugin at the project's own jax version, for compiling the
# Pallas kernels and engine steps for A100/H100 without a GPU (jaxserve/aot.py, tests/test_gpu_aot.py).
# Kept apart so the CPU test run never sees the plugin.
GPU_AOT := .venv-gpu-aot
$(GPU_AOT)/.installed: pyproject.toml $(VENV)/.installed
	test -x $(GPU_AOT)/bin/python || $(PYTHON) -m venv $(GPU_AOT)
	$(GPU_AOT)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_AOT)/bin/python -m pip install --quiet -e . "jax[cuda12]==$$($(PY) -c 'import jax; print(jax.__version__)')"
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test /usr/bin/prometheus /usr/bin/chromium
install-bench: $(VENV)/.installed-bench
install-cluster: $(VENV)/.installed-cluster
install-gpu-aot: $(GPU_AOT)/.installed

$(MODEL)/params: $(VENV)/.installed
	$(PY) scripts/fetch_default_model.py

model: $(MODEL)/params

serve: install model
	$(VENV)/bin/jaxserve serve --config configs/server.toml --model $(MODEL) --host $(HOST) --port $(PORT)

# Two CPU replicas of the default model on a local Ray cluster, behind one ingress (configs/cluster.toml).
cluster: install-cluster model
	$(VENV)/bin/jaxserve cluster --config configs/cluster.toml --host $(HOST) --port $(PORT)

generate: install model
	$(VENV)/bin/jaxserve generate --model $(MODEL) --chat "$(PROMPT)"

bench-throughput: install model
	$(PY) scripts/bench_throughput.py

bench-latency: install model
	$(PY) scripts/bench_latency.py

# jaxserve vs the naive transformers server vs llama.cpp's llama-server; writes BENCHMARKS.md.
bench-compare: install-bench model
	$(PY) scripts/bench_compare.py

test: install-test install-gpu-aot model
	$(PY) -m pytest -q

# The GPU check `make test` runs (every kernel configuration and engine step bucket for both GPUs),
# then the AOT report (BENCHMARKS.md).
gpu-aot: install-gpu-aot
	$(GPU_AOT)/bin/python scripts/gpu_aot_check.py
	$(GPU_AOT)/bin/python scripts/gpu_aot_report.py

clean:
	rm -rf $(VENV) $(GPU_AOT) $(MODEL)
