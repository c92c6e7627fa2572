"""`jaxserve serve --tensor-parallel-size 3` on the default model (three forced host devices)
passes the API's streaming tests of tests/test_server.py, run here against this server."""

from __future__ import annotations

import jax
import pytest

from server_proc import ServerProcess
# the tests, and their client, model and tokenizer fixtures (over this module's `server`)
from test_server import (client, first_answer, model, test_chat_whole_and_streamed_agree,  # noqa: F401
                         test_completions_whole_streamed_and_batched, tok)

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


def test_the_server_runs_on_three_devices(server):
    assert "tensor parallel over 3 devices" in server.log_path.read_text()
