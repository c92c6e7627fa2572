"""Request ids, trace context, OpenTelemetry spans and profiler capture, on a real uvicorn
server running in this process (so the SDK's in-memory exporter sees its spans and the
test can read the log records), serving the tiny random model over loopback HTTP.

Expected values are what the client sent: its `traceparent` must be the span's parent and
its `X-Request-Id` the id of the response header, the completion and the log lines.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_proc import free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tmp_path_factory):
    import uvicorn
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from jaxserve.config import EngineConfig, ModelSpec, ServerConfig
    from jaxserve.serving.app import build_app
    from jaxserve.serving.registry import ModelRegistry
    from jaxserve.serving.tracing import JsonFormatter, RequestIdFilter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = ServerConfig(models=(ModelSpec(path=str(tiny_model_dir), name="tiny"),), admin_api_keys=("admin-key",),
                       profile_dir=str(tmp_path_factory.mktemp("profiles")))
    engine_cfg = EngineConfig(max_num_seqs=4, decode_batch_buckets=(1, 4), context_buckets=(128,), max_model_len=128,
                              prefill_length_buckets=(32,), prefill_batch_buckets=(1,))
    app = build_app(ModelRegistry(cfg.models, engine_cfg), cfg, tracer=provider.get_tracer("test"))

    logs = io.StringIO()  # the JSON log format, as `--log-format json` writes it
    handler = logging.StreamHandler(logs)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process server did not come up"
        time.sleep(0.1)
    yield url, exporter, logs
    server.should_exit = True
    thread.join(timeout=30)
    root.removeHandler(handler)
    root.setLevel(old_level)


def spans_of(exporter, rid: str, timeout: float = 10.0):
    """The finished spans of request `rid` (a streamed one ends just after its last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.attributes.get("jaxserve.request_id") == rid]
        if spans or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_traceparent_parents_the_span_and_the_request_id_is_everywhere(traced, stream):
    url, exporter, logs = traced
    rid = f"client-id-{int(stream)}"
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": rid}
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    r = httpx.post(f"{url}/v1/completions", headers=headers, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    if stream:
        chunks = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert {c["id"] for c in chunks} == {f"cmpl-{rid}"}
    else:
        assert r.json()["id"] == f"cmpl-{rid}"

    [span] = spans_of(exporter, rid)
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID and span.parent.is_remote
    assert r.headers["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
    events = sorted(span.events, key=lambda e: e.timestamp)
    assert [e.name for e in events] == ["queued", "scheduled", "first_token", "finished"]
    assert span.attributes["gen_ai.request.model"] == "tiny"
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.usage.input_tokens"] == 4 and span.attributes["gen_ai.usage.output_tokens"] == 3
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("length",)

    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    mine = [line["message"] for line in lines if line["request_id"] == rid]
    assert any(m.startswith("POST /v1/completions: 1 choice(s), 4 prompt tokens") for m in mine), mine
    assert any(m.startswith("finished: length, 4 prompt + 3 generated tokens") for m in mine), mine


def test_without_trace_context_a_new_trace_and_id_are_made(traced):
    url, exporter, _ = traced
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [9, 10], "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and r.json()["id"] == f"cmpl-{rid}"
    [span] = spans_of(exporter, rid)
    assert span.parent is None
    ctx = span.context
    assert r.headers["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    bad = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": "x" * 500},
                     json={"prompt": [9], "max_tokens": 1}, timeout=60)
    assert bad.status_code == 200 and len(bad.headers["x-request-id"]) == 32  # an unusable id is replaced


def test_a_refused_request_ends_its_span_with_an_error(traced):
    url, exporter, _ = traced
    r = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": "too-long-1"},
                   json={"prompt": [5] * 120, "max_tokens": 50}, timeout=60)
    assert r.status_code == 400
    [span] = spans_of(exporter, "too-long-1")
    assert span.status.status_code.name == "ERROR" and "400" in span.status.description


def test_a_preempted_request_has_a_preempted_event(traced):
    """4 batch requests (priority 10) fill the 4 slots; an interactive one (priority 0) takes
    the latest one's slot: that span has a `preempted` event between `scheduled` and
    `finished`, and the interactive span has none. The tiny model makes 120 tokens in well under
    a second, so on a loaded machine a batch request can end before the interactive one arrives
    (a free slot, nothing to preempt: seen once in CI); such a round proves nothing and is run
    again, up to three times."""
    url, exporter, _ = traced

    def body(priority):
        return {"prompt": [5, 6, 7, 8], "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                "priority": priority}

    for round_ in range(3):
        results = {}

        def batch(i):
            results[i] = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": f"batch-{round_}-{i}"},
                                    json=body(10), timeout=120)

        workers = [threading.Thread(target=batch, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30
        while next(iter(httpx.get(f"{url}/stats", timeout=5).json()["models"].values()))["running"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        urgent = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": f"urgent-{round_}"}, json=body(0),
                            timeout=120)
        for w in workers:
            w.join()
        assert urgent.status_code == 200 and all(r.status_code == 200 for r in results.values())
        [span] = spans_of(exporter, f"urgent-{round_}")
        batches = [s for i in range(4) for s in spans_of(exporter, f"batch-{round_}-{i}")]
        if all(s.end_time > span.start_time for s in batches):  # every slot was still busy when it came
            break
    else:
        pytest.fail("in three rounds a batch request ended before the interactive one arrived")
    assert "preempted" not in [e.name for e in span.events]
    preempted = [s for s in batches if "preempted" in [e.name for e in s.events]]
    assert len(preempted) == 1
    names = [e.name for e in sorted(preempted[0].events, key=lambda e: e.timestamp)]
    assert names.index("scheduled") < names.index("preempted") < names.index("finished")


def test_a_profile_of_live_traffic_holds_the_prefill_and_decode_scopes(traced):
    """Requests stream while POST /debug/profile?seconds=0.5 captures; the Perfetto trace it
    writes names the engine's jaxserve.prefill and jaxserve.decode steps. Half a second holds
    several requests of the tiny model; writing the trace is what takes long (every XLA
    operation of every step is an event: BENCHMARKS.md, "What a profile costs to write"; with
    1.5 s this test took 24 s)."""
    url, _, _ = traced
    admin = {"Authorization": "Bearer admin-key"}
    assert httpx.post(f"{url}/debug/profile?seconds=1", timeout=30).status_code == 403
    assert httpx.post(f"{url}/debug/profile?seconds=-1", headers=admin, timeout=30).status_code == 400
    stop = threading.Event()

    def traffic():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                c.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 16, "ignore_eos": True})

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        r = httpx.post(f"{url}/debug/profile?seconds=0.5", headers=admin, timeout=120)
    finally:
        stop.set()
        worker.join()
    assert r.status_code == 200, r.text
    path = Path(r.json()["path"])
    traces = list(path.rglob("perfetto_trace.json.gz"))
    assert traces and any(f.endswith(".xplane.pb") for f in r.json()["files"])
    text = gzip.decompress(traces[0].read_bytes()).decode()
    assert "jaxserve.prefill" in text and "jaxserve.decode" in text
