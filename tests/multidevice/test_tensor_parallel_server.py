"""`jaxserve serve --tensor-parallel-size 3` on the default model (three forced host devices)
passes the API's streaming tests of tests/test_server.py, run here against this server."""

from __future__ import annotations

import jax
import openai
import pytest

from jaxserve.tokenizer import Tokenizer
from server_proc import ServerProcess
from test_server import test_chat_whole_and_streamed_agree, test_completions_whole_streamed_and_batched  # noqa: F401

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (forced host) devices")

CONFIG = """
[server]
max_n = 4
[engine]
tensor_parallel_size = 1
max_num_seqs = 8
decode_batch_buckets = [1, 8]
context_buckets = [256]
max_model_len = 256
prefill_length_buckets = [32, 128]
prefill_batch_buckets = [1, 4]
compilation_cache_dir = "{cache}"
"""


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("tp-server")
    # --tensor-parallel-size over the preset's 1: the flag reaches the engine
    srv = ServerProcess(default_model_dir, work, CONFIG.format(cache=work / "xla"), ("--tensor-parallel-size", "3"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return Tokenizer(default_model_dir)


def test_the_server_runs_on_three_devices(server):
    assert "tensor parallel over 3 devices" in server.log_path.read_text()
