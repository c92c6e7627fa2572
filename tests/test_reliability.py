"""A server that never falls over: real `jaxserve serve` processes of a tiny random model, driven
over HTTP, with test-only faults switched on by JAXSERVE_FAULTS (jaxserve/engine/faults.py).

- drain: SIGTERM lets running streams finish while new requests get 503; past the drain
  timeout what is left ends with an error event; the process exits 0;
- fault isolation: a failing detokenizer or device step fails its own requests only; a dead or
  stuck engine thread ends every stream with an error event and the process exits 1;
- inputs: a table of hand-written bad requests and a schemathesis fuzz over /openapi.json;
  no 5xx, and every 4xx in OpenAI's error shape;
- a storm of 200 clients that vanish at random moments leaves nothing behind;
- the log at the default level holds no prompt or completion text.

The module's main server is shared by the tests in file order; the one that kills its engine
thread comes last.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest

from server_proc import ServerProcess

FAULTS = "detokenize=fault-detok,step=fault-step,engine_thread=fault-kill,stall=fault-stall"
MARKER = "zebra-quokka"  # in every prompt this module sends: the log must never show it

CONFIG = """
[server]
max_n = 4
max_tokens_limit = {max_tokens}
drain_timeout_s = {drain}
watchdog_timeout_s = {watchdog}
[server.admission]
max_waiting = 256
max_in_flight = 256
[engine]
max_num_seqs = 16
decode_batch_buckets = [1, 4, 16]
context_buckets = [512]
max_model_len = 512
prefill_length_buckets = [32, 128]
prefill_batch_buckets = [1, 4]
kv_cache_memory_gib = 0.1
compilation_cache_dir = "{cache}"
"""


def config(cache, max_tokens=64, drain=30.0, watchdog=120.0) -> str:
    return CONFIG.format(cache=cache, max_tokens=max_tokens, drain=drain, watchdog=watchdog)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, xla_cache):
    srv = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("reliable"), config(xla_cache),
                        env={"JAXSERVE_FAULTS": FAULTS})
    yield srv
    srv.stop()


def completion(url: str, prompt: str, rid: str | None = None, **body) -> httpx.Response:
    headers = {"X-Request-Id": rid} if rid else {}
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, **body}, headers=headers, timeout=120)


async def read_stream(client: httpx.AsyncClient, url: str, prompt: str, rid: str, max_tokens: int,
                      first_token: asyncio.Event | None = None) -> list[dict]:
    """Every SSE event of a streamed completion (ignore_eos: it runs to max_tokens), parsed."""
    events = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if first_token is not None and events[-1].get("choices"):
                    first_token.set()
    return events


def finish_reason(events: list[dict]) -> str | None:
    return next((c["finish_reason"] for e in reversed(events) for c in e.get("choices", []) if c["finish_reason"]),
                None)


def error_events(events: list[dict]) -> list[dict]:
    return [e["error"] for e in events if "error" in e]


def assert_openai_error(r: httpx.Response, param=...) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, r.text
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not ...:
        assert err["param"] == param, r.text
    return err


def wait_idle(server: ServerProcess, within: float = 60.0) -> dict:
    """/stats once no sequence runs or waits and no page is in use (fails after `within` s)."""
    deadline = time.monotonic() + within
    while True:
        stats = server.stats()
        if stats["running"] == stats["waiting"] == stats["pages_used"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine never went idle: {stats}"
        time.sleep(0.1)


# The OpenAPI document and the fuzz over it ------------------------------------------------

ROUTES = {"/v1/chat/completions": "post", "/v1/completions": "post", "/v1/models": "get",
          "/v1/models/{name}": "get", "/health": "get", "/version": "get", "/stats": "get", "/metrics": "get",
          "/dashboard": "get", "/openapi.json": "get", "/debug/profile": "post", "/tokenize": "post",
          "/detokenize": "post", "/v1/responses": "post", "/v1/messages": "post",
          "/v1/messages/count_tokens": "post"}


def test_openapi_document_describes_every_route(server):
    import schemathesis

    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and doc["info"]["version"] == "0.1.0"
    assert {p: next(iter(ops)) for p, ops in doc["paths"].items()} == ROUTES
    schema = schemathesis.openapi.from_dict(doc)  # a document schemathesis can read, every operation
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) == len(ROUTES)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["properties"]["temperature"]["maximum"] == 2
    for name in ("ChatCompletion", "Completion", "Error"):
        assert name in doc["components"]["schemas"]


def test_fuzzing_the_openapi_document_finds_no_5xx_and_no_bad_error_shape(server):
    """Every operation, requests that fit the schema and requests that do not (schemathesis's
    positive and negative modes): none gets a 5xx or hangs past 60 s (but the 504 the API
    documents for a request whose own `timeout` ran out before its first token); every error
    is an OpenAI error; a 200 JSON answer matches its response schema."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode
    from schemathesis.specs.openapi.checks import response_schema_conformance

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    seen: dict[int, int] = {}
    tried: set = set()
    generated: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        negatable = bool(operation.body) or bool(operation.query) or bool(operation.path_parameters)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:1 + negatable]:

            @settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(operation.as_strategy(generation_mode=mode))
            def call(case):
                response = case.call(base_url=server.url, timeout=60)
                status = response.status_code
                seen[status] = seen.get(status, 0) + 1
                if status == 200 and case.method == "POST":
                    generated.append(case.path)
                where = f"{case.method} {case.path} {mode}: {case.body!r:.300} -> {status} {response.text[:300]}"
                if status == 504:  # the request's own `timeout` passed before its first token (documented)
                    assert isinstance(case.body, dict) and case.body.get("timeout") is not None, where
                    assert response.json()["error"]["code"] == "timeout", where
                else:
                    assert status < 500, where
                if status >= 400:
                    err = response.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"}, where
                elif "".join(response.headers.get("content-type", [])).startswith("application/json"):
                    case.validate_response(response, checks=[response_schema_conformance])

            try:
                call()
            except Unsatisfiable:  # nothing outside the schema to send (a path that takes any string)
                assert mode == GenerationMode.NEGATIVE and not operation.body, operation.label
                continue
            tried.add((operation.label, mode))
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert {(f"POST {path}", GenerationMode.POSITIVE), (f"POST {path}", GenerationMode.NEGATIVE)} <= tried
    # it reached the engine, and the checks refused
    assert generated.count("/v1/chat/completions") >= 10 and generated.count("/v1/completions") >= 10, seen
    assert generated.count("/v1/responses") >= 10 and generated.count("/v1/messages") >= 10, seen
    assert generated.count("/tokenize") >= 10 and generated.count("/detokenize") >= 5, seen
    assert seen.get(400, 0) > 50, seen
    wait_idle(server)


# Hand-written bad requests ------------------------------------------------------------

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
Q = [{"role": "user", "content": f"What is a {MARKER}?"}]


def _chat(**kw) -> dict:
    return {"messages": Q, "max_tokens": 4, **kw}


def _completion(**kw) -> dict:
    return {"prompt": f"A {MARKER} is", "max_tokens": 4, **kw}


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


BAD = [
    # (id, path, body: dict or raw bytes, extra headers, status, param)
    ("invalid-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe abc"}', {}, 400, None),
    ("lone-surrogate", COMPLETIONS, b'{"prompt": "a \\ud800 b"}', {}, 400, None),
    ("lone-low-surrogate-in-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', {}, 400, None),
    ("deep-nesting", COMPLETIONS, _nested(100_000), {}, 400, None),
    ("deep-object-nesting", COMPLETIONS, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, {}, 400, None),
    ("huge-integer-literal", COMPLETIONS, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, None),
    ("nan-literal", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', {}, 400, "temperature"),
    ("invalid-json", CHAT, b"{not json", {}, 400, None),
    ("empty-body", CHAT, b"", {}, 400, None),
    ("body-is-array", CHAT, b"[1, 2]", {}, 400, None),
    ("body-is-string", CHAT, b'"hello"', {}, 400, None),
    ("body-is-null", CHAT, b"null", {}, 400, None),
    ("ten-megabyte-body", COMPLETIONS, b'{"prompt": "' + b"a" * (10 * 2**20) + b'"}', {}, 413, None),
    ("wrong-content-type", COMPLETIONS, json.dumps(_completion()).encode(), {"Content-Type": "text/plain"}, 415,
     None),
    ("form-content-type", COMPLETIONS, b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}, 415,
     None),
    ("megabyte-header", COMPLETIONS, _completion(), {"X-Padding": "x" * 2**20}, 431, None),
    ("max-tokens-zero", CHAT, _chat(max_tokens=0), {}, 400, "max_tokens"),
    ("max-tokens-negative", CHAT, _chat(max_tokens=-1), {}, 400, "max_tokens"),
    ("completion-max-tokens-zero-without-echo", COMPLETIONS, _completion(max_tokens=0), {}, 400, "max_tokens"),
    ("min-tokens-above-max-tokens", CHAT, _chat(min_tokens=5), {}, 400, "min_tokens"),
    ("min-tokens-negative", CHAT, _chat(min_tokens=-1), {}, 400, "min_tokens"),
    ("min-tokens-past-the-context", COMPLETIONS, {"prompt": "hi", "min_tokens": 600}, {}, 400, "min_tokens"),
    ("max-tokens-trillion", CHAT, _chat(max_tokens=10**12), {}, 400, "max_tokens"),
    ("max-tokens-past-context", COMPLETIONS, _completion(max_tokens=512), {}, 400, "max_tokens"),
    ("max-tokens-over-server-cap", COMPLETIONS, _completion(max_tokens=100), {}, 400, "max_tokens"),
    ("max-tokens-float", CHAT, _chat(max_tokens=2.5), {}, 400, "max_tokens"),
    ("max-tokens-string", CHAT, _chat(max_tokens="4"), {}, 400, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, _chat(max_completion_tokens=0), {}, 400, "max_completion_tokens"),
    ("temperature-negative", CHAT, _chat(temperature=-0.5), {}, 400, "temperature"),
    ("temperature-above-two", CHAT, _chat(temperature=2.5), {}, 400, "temperature"),
    ("temperature-string", CHAT, _chat(temperature="hot"), {}, 400, "temperature"),
    ("temperature-infinite", CHAT, _chat(temperature=float("inf")), {}, 400, "temperature"),
    ("top-p-zero", CHAT, _chat(top_p=0), {}, 400, "top_p"),
    ("top-p-above-one", CHAT, _chat(top_p=1.5), {}, 400, "top_p"),
    ("top-k-below-minus-one", CHAT, _chat(top_k=-2), {}, 400, "top_k"),
    ("top-k-huge", CHAT, _chat(top_k=10**30), {}, 400, "top_k"),
    ("top-k-float", CHAT, _chat(top_k=1.5), {}, 400, "top_k"),
    ("min-p-negative", CHAT, _chat(min_p=-0.1), {}, 400, "min_p"),
    ("min-p-above-one", CHAT, _chat(min_p=1.5), {}, 400, "min_p"),
    ("presence-penalty-high", CHAT, _chat(presence_penalty=3), {}, 400, "presence_penalty"),
    ("presence-penalty-low", CHAT, _chat(presence_penalty=-3), {}, 400, "presence_penalty"),
    ("frequency-penalty-high", CHAT, _chat(frequency_penalty=2.5), {}, 400, "frequency_penalty"),
    ("repetition-penalty-zero", CHAT, _chat(repetition_penalty=0), {}, 400, "repetition_penalty"),
    ("repetition-penalty-nan", CHAT, _chat(repetition_penalty=float("nan")), {}, 400, "repetition_penalty"),
    ("n-zero", CHAT, _chat(n=0), {}, 400, "n"),
    ("n-above-server-max", CHAT, _chat(n=5), {}, 400, "n"),
    ("n-trillion", CHAT, _chat(n=10**12), {}, 400, "n"),
    ("seed-huge", CHAT, _chat(seed=10**30), {}, 400, "seed"),
    ("seed-string", CHAT, _chat(seed="abc"), {}, 400, "seed"),
    ("completion-logprobs-too-many", COMPLETIONS, _completion(logprobs=21), {}, 400, "logprobs"),
    ("completion-logprobs-negative", COMPLETIONS, _completion(logprobs=-1), {}, 400, "logprobs"),
    ("completion-logprobs-bool", COMPLETIONS, _completion(logprobs=True), {}, 400, "logprobs"),
    ("top-logprobs-too-many", CHAT, _chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("top-logprobs-alone", CHAT, _chat(top_logprobs=2), {}, 400, "top_logprobs"),
    ("logit-bias-too-big", CHAT, _chat(logit_bias={"5": 101}), {}, 400, "logit_bias"),
    ("logit-bias-huge-key", CHAT, _chat(logit_bias={"1" * 5000: 1}), {}, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", CHAT, _chat(logit_bias={"49152": -100}), {}, 400, "logit_bias"),
    ("logit-bias-word-key", CHAT, _chat(logit_bias={"hello": 1}), {}, 400, "logit_bias"),
    ("logit-bias-list", CHAT, _chat(logit_bias=[[5, 1]]), {}, 400, "logit_bias"),
    ("logit-bias-too-many", CHAT, _chat(logit_bias={str(t): 1 for t in range(301)}), {}, 400, "logit_bias"),
    ("ten-thousand-stop-strings", CHAT, _chat(stop=[f"s{i}" for i in range(10_000)]), {}, 400, "stop"),
    ("stop-empty-string", CHAT, _chat(stop=[""]), {}, 400, "stop"),
    ("stop-number", CHAT, _chat(stop=3), {}, 400, "stop"),
    ("stop-token-ids-strings", CHAT, _chat(stop_token_ids=["2"]), {}, 400, "stop_token_ids"),
    ("stop-token-ids-negative", CHAT, _chat(stop_token_ids=[-1]), {}, 400, "stop_token_ids"),
    ("timeout-negative", CHAT, _chat(timeout=-1), {}, 400, "timeout"),
    ("timeout-zero", CHAT, _chat(timeout=0), {}, 400, "timeout"),
    ("timeout-string", CHAT, _chat(timeout="soon"), {}, 400, "timeout"),
    ("priority-huge", CHAT, _chat(priority=2**40), {}, 400, "priority"),
    ("priority-unknown-class", CHAT, _chat(priority="urgent"), {}, 400, "priority"),
    ("x-priority-header-unknown", CHAT, _chat(), {"X-Priority": "urgent"}, 400, "X-Priority"),
    ("x-request-timeout-header-bad", CHAT, _chat(), {"X-Request-Timeout": "soon"}, 400, "X-Request-Timeout"),
    ("stream-not-bool", CHAT, _chat(stream="yes"), {}, 400, "stream"),
    ("stream-options-not-object", CHAT, _chat(stream=True, stream_options="usage"), {}, 400, "stream_options"),
    ("skip-special-tokens-string", CHAT, _chat(skip_special_tokens="no"), {}, 400, "skip_special_tokens"),
    ("json-mode", CHAT, _chat(response_format={"type": "json_object"}), {}, 400, "response_format"),
    ("tools", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400, "tools"),
    ("functions", CHAT, _chat(functions=[{"name": "f", "parameters": {"type": "object"}}]), {}, 400, "functions"),
    ("cache-salt-empty", CHAT, _chat(cache_salt=""), {}, 400, "cache_salt"),
    ("truncate-prompt-tokens-zero", COMPLETIONS, _completion(truncate_prompt_tokens=0), {}, 400,
     "truncate_prompt_tokens"),
    ("truncate-prompt-tokens-with-echo", COMPLETIONS, _completion(truncate_prompt_tokens=2, echo=True), {}, 400,
     "truncate_prompt_tokens"),
    ("return-token-ids-string", CHAT, _chat(return_token_ids="yes"), {}, 400, "return_token_ids"),
    ("continuous-usage-stats-string", CHAT, _chat(stream=True, stream_options={"include_usage": True,
                                                  "continuous_usage_stats": 1}), {}, 400, "continuous_usage_stats"),
    ("tool-choice-required-without-tools", CHAT, _chat(tool_choice="required"), {}, 400, "tool_choice"),
    ("audio-output", CHAT, _chat(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), {}, 400,
     "modalities"),
    ("request-chat-template", CHAT, _chat(chat_template="{{ messages[0].content }}"), {}, 400, "chat_template"),
    ("vllm-guided-choice", CHAT, _chat(guided_choice=["yes", "no"]), {}, 400, "guided_choice"),
    ("vllm-guided-json", COMPLETIONS, _completion(guided_json={"type": "object"}), {}, 400, "guided_json"),
    ("vllm-structured-outputs", CHAT, _chat(structured_outputs={"regex": "[0-9]+"}), {}, 400, "structured_outputs"),
    ("vllm-bad-words", COMPLETIONS, _completion(bad_words=["the"]), {}, 400, "bad_words"),
    ("vllm-allowed-token-ids", CHAT, _chat(allowed_token_ids=[1, 2]), {}, 400, "allowed_token_ids"),
    ("continue-with-generation-prompt", CHAT, _chat(messages=[*Q, {"role": "assistant", "content": "It"}],
                                                     continue_final_message=True), {}, 400, "add_generation_prompt"),
    ("continue-an-empty-user-message", CHAT, _chat(messages=[{"role": "user", "content": ""}],
                                                   continue_final_message=True, add_generation_prompt=False), {}, 400,
     "messages"),
    ("chat-template-kwargs-list", CHAT, _chat(chat_template_kwargs=["x"]), {}, 400, "chat_template_kwargs"),
    ("chat-template-kwargs-messages", CHAT, _chat(chat_template_kwargs={"messages": []}), {}, 400,
     "chat_template_kwargs"),
    ("suffix", COMPLETIONS, _completion(suffix=" end."), {}, 400, "suffix"),
    ("best-of-above-n", COMPLETIONS, _completion(best_of=3), {}, 400, "best_of"),
    ("echo-string", COMPLETIONS, _completion(echo="yes"), {}, 400, "echo"),
    ("chat-echo-string", CHAT, _chat(echo="yes"), {}, 400, "echo"),
    ("chat-documents-string", CHAT, _chat(documents="The lantern is in the shed."), {}, 400, "documents"),
    ("chat-documents-numbers", CHAT, _chat(documents=[{"title": "a", "page": 3}]), {}, 400, "documents"),
    ("prompt-logprobs-streamed", COMPLETIONS, _completion(prompt_logprobs=1, stream=True), {}, 400, "prompt_logprobs"),
    ("prompt-logprobs-whole-vocabulary", CHAT, _chat(prompt_logprobs=-1), {}, 400, "prompt_logprobs"),
    ("prompt-logprobs-above-20", COMPLETIONS, _completion(prompt_logprobs=21), {}, 400, "prompt_logprobs"),
    ("model-not-string", CHAT, _chat(model=5), {}, 400, "model"),
    ("model-unknown", CHAT, _chat(model="gpt-9"), {}, 404, "model"),
    ("messages-missing", CHAT, {"max_tokens": 4}, {}, 400, "messages"),
    ("messages-empty", CHAT, _chat(messages=[]), {}, 400, "messages"),
    ("messages-not-list", CHAT, _chat(messages="hi"), {}, 400, "messages"),
    ("ten-thousand-messages", CHAT, _chat(messages=[{"role": "user", "content": "hi"}] * 10_000), {}, 400,
     "messages"),
    ("unknown-role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400, "messages[0].role"),
    ("role-missing", CHAT, _chat(messages=[{"content": "x"}]), {}, 400, "messages[0].role"),
    ("message-not-object", CHAT, _chat(messages=["hello"]), {}, 400, "messages[0]"),
    ("content-number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), {}, 400, "messages[0].content"),
    ("content-missing", CHAT, _chat(messages=[{"role": "user"}]), {}, 400, "messages[0].content"),
    ("image-part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), {}, 400, "messages[0].content"),
    ("tool-message-without-call-id", CHAT, _chat(messages=[*Q, {"role": "tool", "content": "42"}]), {}, 400,
     "messages[1].tool_call_id"),
    ("prompt-missing", COMPLETIONS, {"max_tokens": 3}, {}, 400, "prompt"),
    ("prompt-empty-string", COMPLETIONS, _completion(prompt=""), {}, 400, "prompt"),
    ("prompt-empty-list", COMPLETIONS, _completion(prompt=[]), {}, 400, "prompt"),
    ("prompt-mixed-list", COMPLETIONS, _completion(prompt=["a", 1]), {}, 400, "prompt"),
    ("prompt-ids-out-of-vocab", COMPLETIONS, _completion(prompt=[1, 10**9]), {}, 400, "prompt"),
    ("prompt-ids-negative", COMPLETIONS, _completion(prompt=[1, -5]), {}, 400, "prompt"),
    ("prompt-too-long", COMPLETIONS, _completion(prompt=f"{MARKER} " * 600), {}, 400, "prompt"),
    ("tokenize-prompt-and-messages", "/tokenize", {"prompt": "a", "messages": Q}, {}, 400, "prompt"),
    ("tokenize-nothing", "/tokenize", {"return_token_strs": True}, {}, 400, "prompt"),
    ("tokenize-token-ids", "/tokenize", {"prompt": [1, 2]}, {}, 400, "prompt"),
    ("tokenize-chat-special-tokens", "/tokenize", {"messages": Q, "add_special_tokens": True}, {}, 400,
     "add_special_tokens"),
    ("tokenize-unknown-model", "/tokenize", {"prompt": "a", "model": "gpt-9"}, {}, 404, "model"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [1, 10**9]}, {}, 400, "tokens"),
    ("detokenize-text", "/detokenize", {"tokens": "hello"}, {}, 400, "tokens"),
    ("responses-previous-response-id", RESPONSES, {"input": "hi", "previous_response_id": "resp_1"}, {}, 400,
     "previous_response_id"),
    ("responses-tools", RESPONSES, {"input": "hi", "tools": [{"type": "function", "name": "f"}]}, {}, 400, "tools"),
    ("responses-json-schema", RESPONSES, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                             "schema": {}}}}, {}, 400, "text.format"),
    ("responses-image-input", RESPONSES, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, {}, 400, "input[0].content"),
    ("responses-function-call-output", RESPONSES, {"input": [{"type": "function_call_output", "call_id": "c",
                                                              "output": "1"}]}, {}, 400, "input[0]"),
    ("responses-input-missing", RESPONSES, {"instructions": "be brief"}, {}, 400, "input"),
    ("responses-max-output-tokens-zero", RESPONSES, {"input": "hi", "max_output_tokens": 0}, {}, 400,
     "max_output_tokens"),
    ("responses-max-output-tokens-over-the-cap", RESPONSES, {"input": "hi", "max_output_tokens": 65}, {}, 400,
     "max_output_tokens"),
    ("responses-include-search-results", RESPONSES, {"input": "hi", "include": ["file_search_call.results"]}, {},
     400, "include"),
    ("responses-background", RESPONSES, {"input": "hi", "background": True}, {}, 400, "background"),
    ("messages-max-tokens-missing", MESSAGES, {"messages": Q}, {}, 400, "max_tokens"),
    ("messages-system-role", MESSAGES, {"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, {}, 400,
     "messages[0].role"),
    ("messages-tool-result", MESSAGES, {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "1"}]}], "max_tokens": 4}, {}, 400,
     "messages[0].content"),
    ("messages-thinking", MESSAGES, {"messages": Q, "max_tokens": 4, "thinking": {"type": "enabled",
                                                                             "budget_tokens": 1024}}, {}, 400,
     "thinking"),
    ("messages-temperature-above-1", MESSAGES, {"messages": Q, "max_tokens": 4, "temperature": 1.5}, {}, 400,
     "temperature"),
    ("messages-stop-sequences-empty-string", MESSAGES, {"messages": Q, "max_tokens": 4, "stop_sequences": [""]}, {},
     400, "stop_sequences"),
    ("count-tokens-no-messages", MESSAGES + "/count_tokens", {"model": "x"}, {}, 400, "messages"),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, {}, 404, None),
    ("wrong-method", "/v1/models", {}, {}, 405, None),
    # Odd but valid: answered, not refused
    ("prompt-of-only-special-tokens", COMPLETIONS, _completion(prompt="<|im_start|><|im_end|><|endoftext|>"), {},
     200, None),
    ("tool-message-with-call-id", CHAT, _chat(messages=[*Q, {"role": "tool", "content": "42", "tool_call_id": "c1"}]),
     {}, 200, None),
    ("unknown-fields-ignored", CHAT, _chat(frobnicate=True, user=MARKER), {}, 200, None),
    ("best-of-equal-to-n-and-empty-suffix", COMPLETIONS, _completion(best_of=1, suffix=""), {}, 200, None),
    ("min-tokens-equal-to-max-tokens", COMPLETIONS, _completion(min_tokens=4), {}, 200, None),
    ("echo-with-logprobs", COMPLETIONS, _completion(max_tokens=1, echo=True, logprobs=1), {}, 200, None),
    ("chat-echo-with-truncation", CHAT, _chat(echo=True, truncate_prompt_tokens=2), {}, 200, None),
    ("chat-documents", CHAT, _chat(documents=[{"title": "Inventory", "text": "The lantern is in the shed."}]), {},
     200, None),
    ("tool-choice-none-and-text-modality", CHAT, _chat(tool_choice="none", modalities=["text"]), {}, 200, None),
    ("truncate-prompt-tokens-to-the-context", CHAT, _chat(truncate_prompt_tokens=-1), {}, 200, None),
    ("prompt-logprobs-zero", COMPLETIONS, _completion(max_tokens=1, prompt_logprobs=0), {}, 200, None),
]


def test_the_table_has_sixty_refusals():
    assert len({row[0] for row in BAD}) == len(BAD)
    assert sum(row[4] >= 400 for row in BAD) >= 60


@pytest.mark.parametrize("path,body,headers,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_their_status_and_param(server, path, body, headers, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    method = "GET" if path == "/v1/models" and status != 405 else "POST"
    r = httpx.request(method, f"{server.url}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, r.text[:500]
    if status >= 400:
        assert_openai_error(r, param)
    else:
        assert r.json()["choices"] and r.json()["usage"]["completion_tokens"] > 0


def test_the_server_still_answers_after_the_table(server):
    r = completion(server.url, f"The {MARKER} said", max_tokens=8, temperature=0)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    wait_idle(server)


# Faults in one request fail that request only --------------------------------------------

def test_a_raising_detokenizer_fails_its_request_and_no_other(server):
    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            normal = [asyncio.create_task(read_stream(c, server.url, f"{MARKER} {i}", f"normal-{i}", 48))
                      for i in range(4)]
            bad_stream = asyncio.create_task(read_stream(c, server.url, f"{MARKER} x", "fault-detok-stream", 48))
            bad_whole = await c.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "fault-detok-whole"},
                                     json={"prompt": f"{MARKER} y", "max_tokens": 8})
            return await asyncio.gather(*normal), await bad_stream, bad_whole

    normal, bad_stream, bad_whole = asyncio.run(run())
    for events in normal:
        assert finish_reason(events) == "length" and not error_events(events)
    assert bad_whole.status_code == 500 and "detokenizer" in assert_openai_error(bad_whole, None)["message"]
    assert error_events(bad_stream) and finish_reason(bad_stream) == "error"
    log = server.log_path.read_text()
    assert "fault-detok-whole" in log and "fault-detok-stream" in log  # the request ids, with the traceback
    wait_idle(server)


def test_a_raising_device_step_fails_the_sequences_in_it_and_later_requests_succeed(server):
    before = completion(server.url, f"{MARKER} before", max_tokens=12, temperature=0).json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            started = [asyncio.Event() for _ in range(3)]
            normal = [asyncio.create_task(read_stream(c, server.url, f"{MARKER} {i}", f"decoding-{i}", 64, started[i]))
                      for i in range(3)]
            for e in started:  # decoding before the faulty prefill comes: they are not in its step
                await e.wait()
            bad = await c.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "fault-step-1"},
                               json={"prompt": f"{MARKER} z", "max_tokens": 8})
            return await asyncio.gather(*normal), bad

    normal, bad = asyncio.run(run())
    assert bad.status_code == 500 and "device step" in assert_openai_error(bad, None)["message"]
    for events in normal:
        assert finish_reason(events) == "length" and not error_events(events)
    after = completion(server.url, f"{MARKER} before", max_tokens=12, temperature=0)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
    wait_idle(server)


# A storm of vanishing clients --------------------------------------------------------------

async def _vanishing_client(c: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> str:
    """One client that leaves at a random moment; returns how it left."""
    words = " ".join([MARKER] * rng.choice([4, 20, 80]))  # the longest take four prefill chunks
    body = {"prompt": f"{words} {i}", "max_tokens": rng.choice([16, 64]), "ignore_eos": True, "stream": True}
    how = rng.choice(["mid-request-body", "early", "mid-stream", "mid-stream", "finish"])
    if how == "mid-request-body":  # the body never fully arrives
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        payload = json.dumps(body).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload[:len(payload) // 2])
        await writer.drain()
        await asyncio.sleep(rng.random() * 0.2)
        writer.close()
        return how
    try:
        async with asyncio.timeout(rng.random() * 0.5 if how == "early" else None):  # queued, prefilling...
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                n, leave_after = 0, rng.randint(1, 8)
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if how == "mid-stream" and n >= leave_after:
                        return how  # leaving the block closes the connection
    except TimeoutError:
        pass
    return how


def test_a_storm_of_200_vanishing_clients_leaves_nothing_behind(server):
    greedy = completion(server.url, f"{MARKER} storm", max_tokens=16, temperature=0).json()["choices"][0]["text"]
    rss_before = server.rss_mib()

    async def storm():
        rng = random.Random(7)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=250)) as c:
            return await asyncio.gather(*(_vanishing_client(c, server.url, rng, i) for i in range(200)))

    ways = asyncio.run(storm())
    assert {"mid-request-body", "early", "mid-stream", "finish"} <= set(ways)
    stats = wait_idle(server)
    assert stats["running"] == stats["waiting"] == stats["pages_used"] == stats["swapped"] == 0
    rss_after = server.rss_mib()
    assert rss_after - rss_before < 100, (rss_before, rss_after)
    again = completion(server.url, f"{MARKER} storm", max_tokens=16, temperature=0)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == greedy


# The log ------------------------------------------------------------------------------------

def test_the_default_log_has_no_prompt_or_completion_text(server):
    """Every prompt of this module carried MARKER; the completions are known texts."""
    texts = [completion(server.url, f"{MARKER} log {i}", max_tokens=16, temperature=0).json()["choices"][0]["text"]
             for i in range(3)]
    log = server.log_path.read_text()
    assert "POST /v1/completions" in log and "finished: length" in log  # the log is there and busy
    assert MARKER not in log
    for text in texts:
        assert len(text.strip()) >= 8 and text not in log


# Last: a dead engine thread ends the process ------------------------------------------------

def test_a_dead_engine_thread_ends_every_stream_and_the_process_exits_1(server):
    health: list[int] = []

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(read_stream(c, server.url, f"{MARKER} {i}", f"victim-{i}", 64, started[i]))
                       for i in range(3)]
            for e in started:
                await e.wait()

            async def poll_health():
                while True:
                    try:
                        health.append((await c.get(f"{server.url}/health")).status_code)
                    except httpx.HTTPError:
                        return  # the server is gone
                    await asyncio.sleep(0.01)

            poller = asyncio.create_task(poll_health())
            killer = asyncio.create_task(read_stream(c, server.url, f"{MARKER} k", "fault-kill-1", 8))
            results = await asyncio.gather(*streams, killer)
            await asyncio.wait_for(poller, 30)
            return results

    results = asyncio.run(run())
    for events in results:
        assert error_events(events) and "engine thread died" in error_events(events)[0]["message"]
        assert finish_reason(events) == "error"
    assert server.proc.wait(timeout=30) == 1
    assert 503 in health
    log = server.log_path.read_text()
    assert "CRITICAL" in log and "exiting with status 1" in log


# Drain on SIGTERM ------------------------------------------------------------------------

def _sigterm_during_streams(srv: ServerProcess, n: int, max_tokens: int):
    """n streams, SIGTERM once each has a token; then a new request and /health. Returns
    (the streams' events, the new request's response, /health's, seconds from SIGTERM to exit)."""

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            started = [asyncio.Event() for _ in range(n)]
            streams = [asyncio.create_task(read_stream(c, srv.url, f"{MARKER} drain {i}", f"drain-{i}", max_tokens,
                                                       started[i])) for i in range(n)]
            for e in started:
                await e.wait()
            assert not any(s.done() for s in streams)
            srv.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            await asyncio.sleep(0.05)
            refused = await c.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            health = await c.get(f"{srv.url}/health")
            events = await asyncio.gather(*streams)
            return events, refused, health, t0

    events, refused, health, t0 = asyncio.run(run())
    code = srv.proc.wait(timeout=60)
    return events, refused, health, time.monotonic() - t0, code


def test_sigterm_lets_eight_streams_finish_refuses_new_requests_and_exits_0(tiny_model_dir, tmp_path, xla_cache):
    srv = ServerProcess(tiny_model_dir, tmp_path, config(xla_cache, max_tokens=480, drain=30),
                        extra_args=("--log-requests",))
    try:
        events, refused, health, took, code = _sigterm_during_streams(srv, 8, 400)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert assert_openai_error(refused, None)["code"] == "server_draining"
        assert health.status_code == 503 and health.json()["status"] == "draining"
        for e in events:
            assert finish_reason(e) == "length" and not error_events(e)
            assert sum(len(c.get("text", "")) > 0 for ev in e for c in ev.get("choices", [])) > 10
        assert code == 0 and took < 30 + 5
        log = srv.log_path.read_text()
        assert "log_requests is on" in log and MARKER in log  # --log-requests does log the text
    finally:
        srv.stop()


def test_past_the_drain_timeout_streams_end_with_an_error_event_and_exit_0(tiny_model_dir, tmp_path, xla_cache):
    srv = ServerProcess(tiny_model_dir, tmp_path, config(xla_cache, max_tokens=480, drain=0.3))
    try:
        events, refused, health, took, code = _sigterm_during_streams(srv, 8, 450)
        assert refused.status_code == 503
        for e in events:
            errors = error_events(e)
            assert errors and errors[0]["code"] == "server_shutting_down" and "drain_timeout_s" in errors[0]["message"]
            assert finish_reason(e) == "abort"
        assert code == 0 and took < 0.3 + 5
    finally:
        srv.stop()


def test_a_stalled_engine_thread_trips_the_watchdog(tiny_model_dir, tmp_path, xla_cache):
    srv = ServerProcess(tiny_model_dir, tmp_path, config(xla_cache, watchdog=2), env={"JAXSERVE_FAULTS": FAULTS})
    try:
        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                started = asyncio.Event()
                victim = asyncio.create_task(read_stream(c, srv.url, f"{MARKER} v", "victim", 64, started))
                await started.wait()
                stall = asyncio.create_task(read_stream(c, srv.url, f"{MARKER} s", "fault-stall-1", 8))
                return await asyncio.gather(victim, stall)

        t0 = time.monotonic()
        for events in asyncio.run(run()):
            assert "no progress" in error_events(events)[0]["message"] and finish_reason(events) == "error"
        assert srv.proc.wait(timeout=30) == 1
        assert time.monotonic() - t0 < 2 + 15
    finally:
        srv.stop()


def test_a_second_signal_exits_at_once(tiny_model_dir, tmp_path, xla_cache):
    """A request that can never finish (its engine thread is stuck, the watchdog far off) holds
    the drain; the second SIGTERM ends the process anyway."""
    srv = ServerProcess(tiny_model_dir, tmp_path, config(xla_cache, drain=60), env={"JAXSERVE_FAULTS": FAULTS})
    try:
        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                hanging = asyncio.create_task(c.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4},
                                                     headers={"X-Request-Id": "fault-stall-2"}))
                await asyncio.sleep(0.5)  # it reaches the engine thread, which stops there
                assert not hanging.done()
                srv.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                health = await c.get(f"{srv.url}/health")
                assert health.status_code == 503 and health.json()["status"] == "draining"
                t0 = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(srv.proc.wait, 30)
                hanging.cancel()
                return code, time.monotonic() - t0

        code, took = asyncio.run(run())
        assert code == 1 and took < 5
        assert "SIGTERM again: exiting now" in srv.log_path.read_text()
    finally:
        srv.stop()
