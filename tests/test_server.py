"""A real `jaxserve serve` process on the default model, driven over loopback by the official
`openai` client, raw httpx and curl-like SSE reading.

Expected values are the server's own answers under other conditions: a greedy answer
streamed must equal the same answer whole; an answer among 32 concurrent streams must
equal that prompt's answer sent alone; a stop string must cut the free-running text
exactly where the string first appears; token counts must equal what the tokenizer
says the prompt is.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxserve.tokenizer import Tokenizer
from server_proc import ServerProcess, free_port, parse_samples

CONFIG = """
[server]
max_n = 4
[engine]
max_num_seqs = 32
decode_batch_buckets = [1, 8, 32]
context_buckets = [512]
max_model_len = 512
prefill_length_buckets = [32, 128]
prefill_batch_buckets = [1, 4]
compilation_cache_dir = "{cache}"
"""

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory, xla_cache):
    work = tmp_path_factory.mktemp("server")
    profiler_port = free_port()
    srv = ServerProcess(default_model_dir, work, CONFIG.format(cache=xla_cache),
                        extra_args=("--log-format", "json", "--profiler-port", str(profiler_port)))
    srv.profiler_port = profiler_port
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


@pytest.fixture(scope="module")
def first_answer(client, model) -> str:
    """The greedy answer to QUESTION of the fresh server (asked by the module's first chat test)."""
    return chat(client, model, QUESTION, max_tokens=24, temperature=0).choices[0].message.content


def chat(client, model, messages, **kw):
    return client.chat.completions.create(model=model, messages=messages, **kw)


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_health_was_503_while_loading_then_200(server):
    assert server.health_seen[-1] == 200
    assert 503 in server.health_seen  # the port answered before the model was compiled
    assert httpx.get(f"{server.url}/version").json()["version"] == "0.1.0"


def test_models_lists_the_default_model(client, model):
    assert model == "smollm2-135m-instruct"
    assert [m.id for m in client.models.list().data] == [model]


def test_chat_whole_and_streamed_agree(client, model, tok, first_answer):
    whole = chat(client, model, QUESTION, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text and text == first_answer
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(tok.encode_chat(QUESTION))
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    streamed, chunks = stream_text(chat(client, model, QUESTION, max_tokens=24, temperature=0, stream=True))
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_chat_content_parts_and_max_completion_tokens(client, model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    a = chat(client, model, parts, max_completion_tokens=5, temperature=0)
    b = chat(client, model, QUESTION, max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 5 and a.choices[0].finish_reason == "length"


def _scrape(server) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text) for s in f.samples]


def _prefix_counters(server) -> tuple[float, float]:
    values = {s.name: s.value for s in _scrape(server) if s.name.startswith("vllm:prefix_cache_")}
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def test_a_shared_prefix_is_reported_cached_and_counted(server, client, model, tok):
    """Two chats share a long system prompt: the second reports the shared prompt's whole
    pages (16 tokens each, not its last token) as cached_tokens, streamed or not, and the
    Prometheus counters move by exactly each prompt's length (queries) and its cached tokens
    (hits). A different cache_salt finds nothing; an empty one is refused."""
    system = {"role": "system", "content": "You are a terse assistant for a harbour office. " * 24}
    first = [system, {"role": "user", "content": "When does the ferry leave?"}]
    second = [system, {"role": "user", "content": "Where is the lighthouse?"}]
    a_ids, b_ids = tok.encode_chat(first), tok.encode_chat(second)
    common = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y)
    assert common > 250
    q0, h0 = _prefix_counters(server)
    a = chat(client, model, first, max_tokens=2, temperature=0)
    q1, h1 = _prefix_counters(server)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert (q1 - q0, h1 - h0) == (len(a_ids), 0)
    _, chunks = stream_text(chat(client, model, second, max_tokens=2, temperature=0, stream=True,
                                 stream_options={"include_usage": True}))
    q2, h2 = _prefix_counters(server)
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == common // 16 * 16 > 0
    assert (q2 - q1, h2 - h1) == (len(b_ids), cached)
    pages = {s.labels["state"]: s.value for s in _scrape(server) if s.name == "jaxserve:kv_cache_pages"}
    assert pages["cached"] >= len(b_ids) // 16 and pages["used"] == 0  # both answers' pages stay for reuse
    capacity = [s for s in _scrape(server) if s.name == "jaxserve:kv_cache_capacity_tokens"]
    assert capacity[0].labels["kv_cache_dtype"] == "auto" and capacity[0].value == sum(pages.values()) * 16
    salted = chat(client, model, second, max_tokens=2, temperature=0, extra_body={"cache_salt": "tenant-7"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": second, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_include_usage_on_a_final_chunk(client, model):
    _, chunks = stream_text(chat(client, model, QUESTION, max_tokens=6, temperature=0, stream=True,
                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_whole_streamed_and_batched(client, model, tok):
    prompt = "The three primary colors are"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    assert whole.object == "text_completion"
    assert whole.usage.prompt_tokens == len(tok.encode(prompt))
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text
    ids = tok.encode(prompt)
    both = client.completions.create(model=model, prompt=[prompt, "One plus one is"], max_tokens=16, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == whole.choices[0].text
    as_ids = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0)
    assert as_ids.choices[0].text == whole.choices[0].text


def test_stop_strings_cut_where_the_string_first_appears(client, model):
    free = chat(client, model, QUESTION, max_tokens=24, temperature=0).choices[0].message.content
    word = "Paris"
    cut = chat(client, model, QUESTION, max_tokens=24, temperature=0, stop=[word, "zebra"])
    assert cut.choices[0].message.content == free[:free.index(word)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_dump()["stop_reason"] == word
    assert chat(client, model, QUESTION, max_tokens=24, temperature=0).choices[0].model_dump()["stop_reason"] is None
    streamed, _ = stream_text(chat(client, model, QUESTION, max_tokens=24, temperature=0, stop=word, stream=True))
    assert streamed == free[:free.index(word)]
    kept, _ = stream_text(chat(client, model, QUESTION, max_tokens=24, temperature=0, stop=word, stream=True,
                               extra_body={"include_stop_str_in_output": True}))
    assert kept == free[:free.index(word) + len(word)]
    last = list(chat(client, model, QUESTION, max_tokens=24, temperature=0, stop=word, stream=True))[-1]
    assert last.choices[0].finish_reason == "stop" and last.choices[0].model_dump()["stop_reason"] == word


def test_n_2_seeded_samples(client, model):
    kw = dict(max_tokens=12, temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    whole = chat(client, model, QUESTION, **kw)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]  # seed and seed + 1
    again = chat(client, model, QUESTION, **kw)
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    streamed = {0: "", 1: ""}
    for c in chat(client, model, QUESTION, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == texts
    assert whole.usage.completion_tokens == 24


def test_logprobs_chat_and_completions(client, model):
    r = chat(client, model, QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy picks the most likely token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = client.completions.create(model=model, prompt="Water boils at", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_32_concurrent_streams_equal_their_answers_alone(client, model, server):
    topics = ["rivers", "bread", "stars", "music", "cats", "glass", "trains", "rain", "chess", "tea", "maps",
              "bees", "ice", "paper", "wind", "salt", "bridges", "clocks", "snow", "honey", "ships", "moss",
              "caves", "kites", "owls", "wool", "sand", "bells", "ink", "wolves", "lamps", "figs"]
    prompts = [[{"role": "user", "content": f"Tell me one fact about {t}."}] for t in topics]
    alone = [chat(client, model, p, max_tokens=12, temperature=0).choices[0].message.content for p in prompts]

    async def one(aclient, p):
        stream = await aclient.chat.completions.create(model=model, messages=p, max_tokens=12, temperature=0,
                                                       stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    # /stats polled while the burst runs: the streams were in the running batch together,
    # not served one after another
    running, done = [], threading.Event()

    def poll():
        while not done.is_set():
            running.append(server.stats()["running"])
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        together = asyncio.run(all_at_once())
    finally:
        done.set()
        poller.join()
    assert together == alone
    assert len(set(alone)) > 16
    assert max(running) >= 16, max(running)


def _wait_idle(server, pages_before: int, within: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        s = server.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["pages_used"] == pages_before:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"engine still busy {within}s after the client left: {server.stats()}")


def _aborts_and_tokens(server, model) -> tuple[float, float]:
    """(requests finished by "abort", tokens generated) so far, from a real scrape of /metrics."""
    label = (("model_name", model),)
    now = scrape(server)
    return (now.get(("vllm:request_success_total", (("finished_reason", "abort"), *label)), 0.0),
            now.get(("vllm:generation_tokens_total", label), 0.0))


def _assert_one_abort(server, model, before: tuple[float, float], max_tokens: int) -> None:
    """Exactly one more request ended by abort, and it stopped making tokens well before
    `max_tokens` (an engine that ran it to the end would count all of them)."""
    aborts, tokens = _aborts_and_tokens(server, model)
    assert aborts - before[0] == 1
    assert tokens - before[1] < max_tokens / 2, tokens - before[1]


def test_disconnect_mid_stream_frees_the_engine(server, model):
    before = server.stats()["pages_used"]
    counted = _aborts_and_tokens(server, model)
    body = {"model": model, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            # Hold the line iterator: leaving a `for` over it would close the connection early.
            lines = r.iter_lines()
            got = 0
            while got < 4:
                got += next(lines).startswith("data:")
            assert server.stats()["running"] == 1
    # the connection is closed here, the stream not finished
    _wait_idle(server, before, within=1.0)
    _assert_one_abort(server, model, counted, body["max_tokens"])


def test_disconnect_while_waiting_for_a_whole_answer(server, model):
    before = server.stats()["pages_used"]
    counted = _aborts_and_tokens(server, model)
    body = {"model": model, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=1.0))
    _wait_idle(server, before, within=1.0)
    _assert_one_abort(server, model, counted, body["max_tokens"])


def _profile_request(repository: Path, session: str, duration_ms: int) -> bytes:
    """A tensorflow.ProfilerService ProfileRequest (tsl/profiler/protobuf/profiler_service.proto),
    encoded by hand: no protobuf classes for it ship with jax. Host and Python tracers on."""
    def varint(n: int) -> bytes:
        out = b""
        while n > 0x7F:
            out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
        return out + bytes([n])

    def num(field: int, n: int) -> bytes:
        return varint(field << 3) + varint(n)

    def text(field: int, b: bytes) -> bytes:
        return varint(field << 3 | 2) + varint(len(b)) + b

    # ProfileOptions: version 1, host_tracer_level 2, device_tracer_level 1, python_tracer_level 1, duration_ms
    options = num(5, 1) + num(2, 2) + num(3, 1) + num(4, 1) + num(9, duration_ms)
    # ProfileRequest: duration_ms, opts, repository_root, session_id, host_name
    return (num(1, duration_ms) + text(4, options) + text(5, str(repository).encode()) + text(6, session.encode())
            + text(7, b"server"))


def test_command_line_json_log_traceparent_echo_and_profiler_port(server, model, tmp_path):
    """The server was started with `--log-format json --profiler-port P` and no tracer. A gRPC
    client (what XProf / TensorBoard's capture does) takes a 1.5 s profile over P while requests
    run: the trace written names jaxserve's steps. Each request's `traceparent` comes back as
    sent, and every log line about it is a JSON object carrying its request id."""
    import grpc

    trace = f"00-{'ab' * 16}-{'cd' * 8}-01"
    ids, reply = [], []

    def capture():
        with grpc.insecure_channel(f"127.0.0.1:{server.profiler_port}") as ch:
            profile = ch.unary_unary("/tensorflow.ProfilerService/Profile")
            reply.append(profile(_profile_request(tmp_path, "live", 1500), timeout=60))

    capturing = threading.Thread(target=capture)
    capturing.start()
    with httpx.Client(timeout=60) as c:
        while capturing.is_alive() or not ids:  # traffic for as long as the capture lasts
            ids.append(f"json-log-{len(ids)}")
            r = c.post(f"{server.url}/v1/completions", headers={"traceparent": trace, "X-Request-Id": ids[-1]},
                       json={"model": model, "prompt": "One, two,", "max_tokens": 16, "ignore_eos": True})
            assert r.status_code == 200 and r.headers["traceparent"] == trace
            assert r.headers["x-request-id"] == ids[-1]
    capturing.join()
    assert reply == [b""]  # a ProfileResponse with empty_trace false
    [xplane] = (tmp_path / "live").glob("*.xplane.pb")
    assert b"jaxserve.decode" in xplane.read_bytes()

    lines = [line for line in server.log_path.read_text().splitlines() if any(i in line for i in ids)]
    records = [json.loads(line) for line in lines]
    assert all(isinstance(rec, dict) for rec in records)
    for i in ids:
        mine = [rec["message"] for rec in records if rec.get("request_id") == i]
        assert any(m.startswith("POST /v1/completions") for m in mine), (i, mine)
        assert any(m.startswith("finished: length") for m in mine), (i, mine)


def test_logit_bias_bans_and_forces_tokens(client, model, tok):
    """Greedy, the prompt's next token is t; with t at -100 another token comes first, and with
    " banana" at +100 every token is " banana". A text response format and empty tools are
    no requests for a feature and pass."""
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    first = tok.encode(plain, add_special_tokens=False)
    assert len(first) == 1, plain
    banned = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(first[0]): -100}).choices[0].text
    assert banned and banned != plain
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    forced = chat(client, model, QUESTION, max_tokens=3, temperature=0.7, seed=1, logit_bias={str(banana): 100},
                  response_format={"type": "text"}, tools=[])
    assert forced.choices[0].message.content == tok.decode([banana] * 3)


def test_continue_final_message_and_echo(client, model, tok):
    """A chat whose last assistant message is continued is the completion of the template's
    text cut after that message (with vLLM's chat echo, that message's text first); an echoed
    completion is its prompt followed by the plain completion's text, whole and streamed, for
    text and token-id prompts."""
    begun = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    cont = chat(client, model, begun, max_tokens=8, temperature=0,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = tok.continue_final_message(begun)
    assert text.endswith("The capital of France is")
    same = client.completions.create(model=model, prompt=tok.encode(text, add_special_tokens=False), max_tokens=8,
                                     temperature=0)
    assert cont.choices[0].message.content == same.choices[0].text
    assert cont.usage.prompt_tokens == same.usage.prompt_tokens
    fresh = chat(client, model, begun, max_tokens=8, temperature=0)  # a new assistant turn after it
    assert fresh.usage.prompt_tokens > cont.usage.prompt_tokens
    # vLLM's chat echo: the continued reply whole, its begun text first (whole and streamed; logprobs
    # and usage are the generated tokens'); after a user message there is nothing to echo
    opts = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    echoed = chat(client, model, begun, max_tokens=8, temperature=0, logprobs=True, extra_body=opts)
    assert echoed.choices[0].message.content == "The capital of France is" + cont.choices[0].message.content
    assert echoed.usage.completion_tokens == len(echoed.choices[0].logprobs.content) == cont.usage.completion_tokens
    streamed, _ = stream_text(chat(client, model, begun, max_tokens=8, temperature=0, stream=True, extra_body=opts))
    assert streamed == echoed.choices[0].message.content
    asked = chat(client, model, QUESTION, max_tokens=8, temperature=0, extra_body={"echo": True})
    assert asked.choices[0].message.content == chat(client, model, QUESTION, max_tokens=8,
                                                    temperature=0).choices[0].message.content

    prompt = "The three primary colors are"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    for sent in (prompt, tok.encode(prompt)):
        echoed = client.completions.create(model=model, prompt=sent, max_tokens=6, temperature=0, echo=True)
        assert echoed.choices[0].text == prompt + plain
        assert echoed.usage.completion_tokens == 6
    stream = client.completions.create(model=model, prompt=[prompt, prompt], max_tokens=6, temperature=0, echo=True,
                                       stream=True)
    texts = {0: "", 1: ""}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {0: prompt + plain, 1: prompt + plain}


def test_echo_with_logprobs_scores_the_prompt(client, model, tok):
    """How evaluation harnesses score text: echo, logprobs and max_tokens 0. Every prompt token
    but the first has its logprob; the last one's equals the logprob of the same token
    generated after the rest of the prompt; with max_tokens 2 the generated tokens follow,
    and streamed the same lists arrive in pieces."""
    prompt = "The capital of France is Paris"
    head = client.completions.create(model=model, prompt=prompt[:-len(" Paris")], max_tokens=1, temperature=0,
                                     logprobs=1)
    assert head.choices[0].text == " Paris"
    scored = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = scored.choices[0]
    lp = c.logprobs
    ids = tok.encode(prompt)
    assert c.text == prompt and c.finish_reason == "length"
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    assert "".join(lp.tokens) == prompt and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:])
    assert lp.token_logprobs[-1] == pytest.approx(head.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]

    more = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=1)
    m = more.choices[0].logprobs
    assert m.tokens[:len(ids)] == lp.tokens and m.token_logprobs[:len(ids)] == lp.token_logprobs
    assert more.choices[0].text == prompt + "".join(m.tokens[len(ids):]) and len(m.tokens) == len(ids) + 2
    streamed = {"text": "", "tokens": [], "token_logprobs": []}
    for chunk in client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, echo=True,
                                           logprobs=1, stream=True):
        for ch in chunk.choices:
            streamed["text"] += ch.text
            if ch.logprobs:
                streamed["tokens"] += ch.logprobs.tokens
                streamed["token_logprobs"] += ch.logprobs.token_logprobs
    assert streamed == {"text": more.choices[0].text, "tokens": m.tokens, "token_logprobs": m.token_logprobs}


def test_vllm_prompt_logprobs(client, model, tok):
    """vLLM's prompt_logprobs: per prompt token (the first null) the token's own logprob and rank
    and k alternatives, keyed by token id; on completions per choice (beside echo's lists, which
    keep their own k), on chat once for the response; max_tokens 0 scores the prompt alone."""
    prompt = "The capital of France is Paris"
    ids = tok.encode(prompt)
    both = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 3}).model_dump()["choices"][0]
    echoed, scored = both["logprobs"], both["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    assert all(len(t) == 1 for t in echoed["top_logprobs"][1:])  # echo's 1, not prompt_logprobs' 3
    for i, entry in enumerate(scored[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-6)
        assert own["decoded_token"] == echoed["tokens"][i]
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert 3 <= len(entry) <= 4 and [e["rank"] for e in ranked[:3]] == [1, 2, 3]
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
        if len(entry) == 3:  # the token is one of the best 3: its rank is its place among them
            assert own["rank"] == 1 + sum(e["logprob"] > own["logprob"] for e in entry.values())
        else:
            assert own["rank"] > 3 and own["logprob"] <= ranked[2]["logprob"]
    assert any(e[str(t)]["rank"] > 3 for e, t in zip(scored[1:], ids[1:]))  # some token is none of the best 3

    alone = client.completions.create(model=model, prompt=ids, max_tokens=0,
                                      extra_body={"prompt_logprobs": 0}).model_dump()
    c = alone["choices"][0]
    assert c["text"] == "" and c["logprobs"] is None and alone["usage"]["completion_tokens"] == 0
    assert [list(e) for e in c["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    assert [e[str(t)] for e, t in zip(c["prompt_logprobs"][1:], ids[1:])] == \
        [e[str(t)] for e, t in zip(scored[1:], ids[1:])]

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, n=2,
                                          extra_body={"prompt_logprobs": 1}).model_dump()
    rendered = tok.encode_chat(messages, True)
    assert chat["usage"]["prompt_tokens"] == len(rendered) == len(chat["prompt_logprobs"])
    assert all(str(t) in e for e, t in zip(chat["prompt_logprobs"][1:], rendered[1:]))
    assert "prompt_logprobs" not in chat["choices"][0]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0).model_dump()
    assert "prompt_logprobs" not in plain and [ch["message"] for ch in chat["choices"]] == [plain["choices"][0]["message"]] * 2


def test_tokenize_and_detokenize(client, model, tok, server):
    """vLLM's /tokenize and /detokenize: a prompt's ids are the tokenizer's, a conversation's are
    what a chat request with the same messages and template options counts as its prompt, and
    /detokenize gives the text back."""
    def post(path, **body):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    prompt = "Tokens, tokens: naïve café 🙂!"
    out = post("/tokenize", model=model, prompt=prompt, return_token_strs=True)
    assert out["tokens"] == tok.encode(prompt) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == client.models.retrieve(model).model_dump()["max_model_len"]
    assert out["token_strs"] == [tok.decode([t], skip_special_tokens=False) for t in out["tokens"]]
    assert post("/tokenize", prompt=prompt)["token_strs"] is None
    assert post("/detokenize", model=model, tokens=out["tokens"])["prompt"] == prompt

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour"}]
    for options in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        ids = post("/tokenize", messages=messages, **options)["tokens"]
        used = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                              extra_body=options).usage.prompt_tokens
        assert ids == tok.encode_chat(messages, not options, continue_final_message=bool(options))
        assert len(ids) == used
    rendered = post("/detokenize", tokens=ids)["prompt"]
    assert rendered.startswith("<|im_start|>") and rendered.endswith("The colour")


def test_vllm_token_id_fields(client, model, tok):
    """vLLM's return_token_ids (the prompt's ids and each choice's, whole and streamed),
    return_tokens_as_token_ids (logprob tokens as "token_id:N"), continuous_usage_stats (the
    usage so far in every chunk) and truncate_prompt_tokens (the prompt's last k tokens)."""
    prompt = "Write the numbers from one to ten in words:"
    ids = tok.encode(prompt)
    opts = dict(model=model, max_tokens=6, temperature=0)
    whole = client.completions.create(prompt=prompt, extra_body={"return_token_ids": True}, **opts).model_dump()
    c = whole["choices"][0]
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    assert tok.decode(c["token_ids"]) == c["text"]
    assert "token_ids" not in client.completions.create(prompt=prompt, **opts).model_dump()["choices"][0]

    pieces = [ch.model_dump() for ch in client.completions.create(
        prompt=prompt, logprobs=1, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, **opts)]
    firsts = [p["choices"][0] for p in pieces if p["choices"] and "prompt_token_ids" in p["choices"][0]]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == ids
    streamed = [t for p in pieces for ch in p["choices"] for t in ch["token_ids"]]
    as_ids = [int(t.removeprefix("token_id:")) for p in pieces for ch in p["choices"] if ch["logprobs"]
              for t in ch["logprobs"]["tokens"]]
    assert streamed == as_ids == c["token_ids"]
    used = [p["usage"]["completion_tokens"] for p in pieces]  # every chunk has the usage so far
    assert used == sorted(used) and used[-1] == 6 and all(p["usage"]["prompt_tokens"] == len(ids) for p in pieces)

    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(messages=messages, extra_body={"return_token_ids": True},
                                          **opts).model_dump()
    assert chat["prompt_token_ids"] == tok.encode_chat(messages, True)
    assert tok.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    chunks = [ch.model_dump() for ch in client.chat.completions.create(
        messages=messages, stream=True, extra_body={"return_token_ids": True}, **opts)]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])
    assert [t for ch in chunks for x in ch["choices"] for t in x.get("token_ids") or []] == \
        chat["choices"][0]["token_ids"]

    cut = client.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 4}, **opts)
    assert cut.usage.prompt_tokens == 4
    assert cut.choices[0].text == client.completions.create(prompt=ids[-4:], **opts).choices[0].text


def test_responses_api(client, model):
    """OpenAI's Responses API through the openai client: `instructions` and `input` run as the
    chat of a system and a user message (the same greedy answer and token counts); a cut by
    max_output_tokens is `incomplete`; streamed, the typed events come in order, numbered, and
    their deltas add up to the answer; a conversation of message items with text parts is the
    same chat too."""
    chat = client.chat.completions.create(model=model, max_tokens=40, temperature=0, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}])
    r = client.responses.create(model=model, instructions="Answer in one sentence.", input="Why is the sky blue?",
                                max_output_tokens=40, temperature=0, metadata={"run": "7"})
    assert r.output_text == chat.choices[0].message.content and r.metadata == {"run": "7"}
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert (r.status == "completed") == (chat.choices[0].finish_reason == "stop")
    short = client.responses.create(model=model, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output[0].status == "incomplete" and short.usage.output_tokens == 3

    events = list(client.responses.create(model=model, instructions="Answer in one sentence.",
                                          input="Why is the sky blue?", max_output_tokens=40, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events[4:-4]) == events[-4].text == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == \
        r.usage.output_tokens

    kw = dict(model=model, input="Why is the sky blue?", max_output_tokens=6, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    scored = client.responses.create(**kw).output[0].content[0]
    want = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Why is the sky blue?"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert [x.model_dump() for x in scored.logprobs] == [x.model_dump() for x in want.choices[0].logprobs.content]
    assert "".join(x.token for x in scored.logprobs) == scored.text
    deltas = [e for e in client.responses.create(stream=True, **kw) if e.type == "response.output_text.delta"]
    assert [(x.token, x.logprob) for e in deltas for x in e.logprobs] == [(x.token, x.logprob) for x in scored.logprobs]

    turns = [{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Apple."}]},
             {"type": "message", "role": "user", "content": "Another one?"}]
    again = client.responses.create(model=model, input=turns, max_output_tokens=12, temperature=0)
    plain = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
             {"role": "user", "content": "Another one?"}]
    assert again.output_text == client.chat.completions.create(model=model, messages=plain, max_tokens=12,
                                                               temperature=0).choices[0].message.content


def test_anthropic_messages_api(client, model, server):
    """Anthropic's Messages API through the anthropic SDK: `system` and `messages` run as the
    same chat (the same greedy answer, tokens and finish, in Anthropic's names), stop_sequences
    report the one that matched, the event stream adds up to the whole answer, count_tokens
    counts the prompt, and refusals come in Anthropic's error envelope."""
    import anthropic

    ac = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    system, turns = "Answer in one sentence.", [{"role": "user", "content": "Why is the sky blue?"}]
    greedy = {"temperature": 0}  # (this SDK sends temperature only as an extra field)
    want = client.chat.completions.create(model=model, max_tokens=40, temperature=0,
                                          messages=[{"role": "system", "content": system}, *turns])
    m = ac.messages.create(model=model, max_tokens=40, system=system, messages=turns, extra_body=greedy)
    text = want.choices[0].message.content
    assert m.content[0].text == text and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert m.usage.output_tokens == want.usage.completion_tokens
    assert ac.messages.count_tokens(model=model, system=system, messages=turns).input_tokens == \
        want.usage.prompt_tokens

    word = text.split()[2]
    cut = ac.messages.create(model=model, max_tokens=40, system=[{"type": "text", "text": system}],
                             messages=[{"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]}],
                             stop_sequences=["zebra", word], extra_body=greedy)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", word, text[:text.index(word)])

    with ac.messages.stream(model=model, max_tokens=40, system=system, messages=turns, extra_body=greedy) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text == final.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens

    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["param"] == "messages[0].content"
    for body, param in [({"messages": turns}, "max_tokens"),
                        ({"messages": turns, "max_tokens": 5, "tools": [{"name": "f", "input_schema": {}}]}, "tools"),
                        ({"messages": turns, "max_tokens": 5, "temperature": 1.5}, "temperature"),
                        ({"messages": turns, "max_tokens": 5, "stop_sequences": "x"}, "stop_sequences")]:
        r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["param"] == param, r.text


def test_stop_token_ids_and_skip_special_tokens(client, model, tok):
    """vLLM's extensions. The greedy next token t of the prompt as a stop token id ends the answer
    at once (finish_reason "stop", the stop token not shown). <|im_start|> forced by logit_bias
    shows in the text only with skip_special_tokens false."""
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    first = tok.encode(plain, add_special_tokens=False)
    assert len(first) == 1, plain
    stopped = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                        extra_body={"stop_token_ids": first}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == "" and stopped.model_dump()["stop_reason"] == first[0]
    special = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(special) == 1
    for skip in (True, False):
        text = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                         logit_bias={str(special[0]): 100},
                                         extra_body={"skip_special_tokens": skip}).choices[0].text
        assert ("<|im_start|>" in text) is not skip, text


def test_retrieve_a_model(client, model, server):
    """OpenAI's GET /v1/models/{id}: the same card as in the list; an unknown id is a 404 in OpenAI's shape."""
    card = client.models.retrieve(model)
    assert card.id == model and card.model_dump() == client.models.list().data[0].model_dump()
    r = httpx.get(f"{server.url}/v1/models/org/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_too_long_message_names_both_numbers(server, tok):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 500})
    msg = r.json()["error"]["message"]
    n = len(tok.encode_chat(QUESTION))
    assert f"512 tokens" in msg and f"{n} tokens" in msg and "max_tokens is 500" in msg
    assert r.json()["error"]["param"] == "messages"
    # max_tokens alone past the context: no prompt could fit, so the fault is max_tokens'
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_still_correct_after_the_bad_requests(server, client, model, first_answer):
    """Runs after the disconnects, deadlines and error cases above (the bad-request table is in
    test_reliability.py): the same greedy answer as at the start, and nothing left in the engine."""
    text = chat(client, model, QUESTION, max_tokens=24, temperature=0).choices[0].message.content
    assert text == first_answer
    stats = server.stats()
    assert stats["running"] == stats["waiting"] == stats["pages_used"] == 0, stats


def test_terminal_chat_client_keeps_the_conversation(server, client, model):
    import subprocess
    import sys

    turns = ["What is the capital of France?", "And of Italy?"]
    out = subprocess.run([sys.executable, "-m", "jaxserve", "chat", "--url", server.url, "--temperature", "0",
                          "--max-tokens", "16"], input="\n".join(turns) + "\n", capture_output=True, text=True,
                         timeout=120, check=True).stdout
    first = chat(client, model, [{"role": "user", "content": turns[0]}], max_tokens=16, temperature=0)
    a1 = first.choices[0].message.content
    convo = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": a1},
             {"role": "user", "content": turns[1]}]
    a2 = chat(client, model, convo, max_tokens=16, temperature=0).choices[0].message.content
    assert out == f"{a1}\n{a2}\n"


# --- A second server: two served names, API keys, a small body limit ---------------------

GUARDED = CONFIG.replace("max_n = 4", "max_n = 4\napi_keys = [\"key-one\", \"key-two\"]\nmax_body_bytes = 4096\n"
                                      "max_tokens_limit = 40")


@pytest.fixture(scope="module")
def guarded(default_model_dir, tmp_path_factory, xla_cache, server):
    # `server` first: it fills the compilation cache, so these two engines load warm.
    work = tmp_path_factory.mktemp("guarded")
    srv = ServerProcess(default_model_dir, work, GUARDED.format(cache=xla_cache),
                        extra_args=("--model", str(default_model_dir), "--served-model-name", "alpha",
                                    "--served-model-name", "beta"))
    yield srv
    srv.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"},
                                     {"Authorization": "Bearer key-one2"}],
                         ids=["missing", "wrong", "no-bearer", "longer"])
def test_api_key_required_everywhere_but_health(guarded, headers):
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
        r = httpx.request(method, f"{guarded.url}{path}", headers=headers, json={"messages": QUESTION})
        assert _error(r, 401)["type"] == "authentication_error"
    wrong = {"x-api-key": "key-one2"} if headers else {}  # Anthropic's header, a wrong key or none
    r = httpx.post(f"{guarded.url}/v1/messages", headers=wrong, json={"messages": QUESTION, "max_tokens": 2})
    assert _error(r, 401)["type"] == "authentication_error" and r.json()["type"] == "error"


def test_anthropic_clients_authenticate_with_x_api_key(guarded):
    """Anthropic's SDKs send the key as `x-api-key`; it is as good as a bearer token."""
    body = {"model": "alpha", "messages": QUESTION, "max_tokens": 3}
    r = httpx.post(f"{guarded.url}/v1/messages", headers={"x-api-key": "key-one"}, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = httpx.post(f"{guarded.url}/v1/chat/completions", headers={"x-api-key": "key-two"}, json=body, timeout=60)
    assert r.status_code == 200


def test_two_served_names_each_with_its_own_engine(guarded):
    auth = {"Authorization": "Bearer key-two"}
    models = httpx.get(f"{guarded.url}/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["alpha", "beta"]
    stats = httpx.get(f"{guarded.url}/stats", headers=auth).json()["models"]
    assert set(stats) == {"alpha", "beta"} and all(m["ready"] for m in stats.values())
    answers = []
    for name in ("alpha", "beta"):
        body = {"model": name, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{guarded.url}/v1/chat/completions", headers=auth, json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == name
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1] and "Paris" in answers[0]


def test_body_over_the_limit_is_413(guarded):
    auth = {"Authorization": "Bearer key-one"}
    big = {"model": "alpha", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert _error(httpx.post(f"{guarded.url}/v1/chat/completions", headers=auth, json=big), 413)["param"] is None
    # a chunked body (no Content-Length) is counted as it arrives
    chunks = (b'{"messages": [{"role": "user", "content": "' + b"y" * 1000 for _ in range(6))
    r = httpx.post(f"{guarded.url}/v1/chat/completions", headers=auth, content=chunks)
    _error(r, 413)


def test_priority_field_is_accepted(client, model, server):
    """An integer, a class name in the body, a class name or integer in X-Priority: same answer."""
    a = chat(client, model, QUESTION, max_tokens=6, temperature=0, extra_body={"priority": -5})
    b = chat(client, model, QUESTION, max_tokens=6, temperature=0)
    c = chat(client, model, QUESTION, max_tokens=6, temperature=0, extra_body={"priority": "batch"})
    d = chat(client, model, QUESTION, max_tokens=6, temperature=0, extra_headers={"X-Priority": "interactive"})
    e = chat(client, model, QUESTION, max_tokens=6, temperature=0, extra_headers={"X-Priority": "3"})
    assert len({r.choices[0].message.content for r in (a, b, c, d, e)}) == 1
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, "messages": QUESTION},
                   headers={"X-Priority": "soonest"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Priority"
    assert "interactive (0), batch (10)" in r.json()["error"]["message"]


def test_deadline_ends_a_stream_with_timeout_and_an_empty_answer_with_504(server, model):
    body = {"model": model, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "timeout": 0.5}
    finish, chunks = None, 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                choice = json.loads(line[5:])["choices"][0]
                chunks += bool(choice["delta"].get("content"))
                finish = choice["finish_reason"] or finish
    assert finish == "timeout" and chunks < 400
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, "messages": QUESTION, "timeout": 1e-6})
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout_error" and r.json()["error"]["param"] == "timeout"
    for header in ("soon", "inf", "nan"):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, "messages": QUESTION},
                       headers={"X-Request-Timeout": header})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout", header
    assert server.stats()["running"] == 0 and server.stats()["pages_used"] == 0


def test_server_caps_max_tokens(guarded):
    auth = {"Authorization": "Bearer key-one"}
    url = f"{guarded.url}/v1/chat/completions"
    err = _error(httpx.post(url, headers=auth, json={"model": "alpha", "messages": QUESTION, "max_tokens": 41}), 400)
    assert err["param"] == "max_tokens" and "at most 40" in err["message"]
    r = httpx.post(url, headers=auth, timeout=120, json={"model": "alpha", "messages": QUESTION, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40  # the cap is also the default


# /metrics -----------------------------------------------------------------------------

def scrape(server) -> dict[tuple, float]:
    """One real scrape of /metrics, parsed: (sample name, sorted labels) -> value."""
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_samples(r.text)


def test_metrics_count_a_known_workload(server, model):
    """N = 4 greedy requests of M = 6 tokens (EOS ignored): the generation-token counter grows
    by N x M, successes with finished_reason "length" by N, TTFT / e2e / TPOT histograms by N
    observations and inter-token latency by N x (M - 1); prompt tokens by what usage says;
    afterwards nothing runs or waits and no KV page is in use."""
    n, m = 4, 6
    label = (("model_name", model),)
    before = scrape(server)
    prompt_tokens = 0
    for i in range(n):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": m, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == m
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
    after = scrape(server)

    def grew(name, labels=label):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("vllm:generation_tokens_total") == n * m
    assert grew("vllm:prompt_tokens_total") == prompt_tokens
    assert grew("vllm:request_success_total", (("finished_reason", "length"), *label)) == n
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_queue_time_seconds"):
        assert grew(f"{hist}_count") == n, hist
    assert grew("vllm:inter_token_latency_seconds_count") == n * (m - 1)
    assert grew("vllm:e2e_request_latency_seconds_sum") >= grew("vllm:time_to_first_token_seconds_sum") > 0
    assert after[("vllm:num_requests_running", label)] == 0 and after[("vllm:num_requests_waiting", label)] == 0
    assert after[("vllm:kv_cache_usage_perc", label)] == 0.0
    assert grew("jaxserve:engine_step_tokens_count", (("kind", "decode"), *label)) >= m - 1
    assert after[("process_resident_memory_bytes", ())] > 100 * 2**20


def test_a_real_prometheus_scrapes_ttft_quantiles_and_kv_usage(server, model, tmp_path):
    """Debian's Prometheus scrapes this server every second while 8 streams of 48 tokens run.
    Its HTTP API then says: the TTFT median of that traffic (histogram_quantile over the
    buckets' increase) is positive and no later than the slowest first token the client saw
    (the server's TTFT ends before the client reads it, and is at most its bucket's upper
    bound); KV usage rose above 0 while the streams ran and is 0 now; the generation-token
    counter is the one /metrics shows."""
    import shutil
    import subprocess

    from prometheus_client.utils import INF

    from jaxserve.metrics import TTFT_BUCKETS

    binary = shutil.which("prometheus")
    assert binary, "Prometheus is missing: `make install-test` installs Debian's prometheus package"
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: jaxserve, static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]}}\n")
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)

    def query(q: str) -> list:
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": q}, timeout=10)
        r.raise_for_status()  # 503 "Service Unavailable" until its TSDB has opened: asked again below
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def until(q: str, ok, what: str):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                result = query(q)
                if result and ok(float(result[0]["value"][1])):
                    return float(result[0]["value"][1])
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.2)
        raise AssertionError(f"Prometheus never saw {what}: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")

    sel = f'{{model_name="{model}"}}'

    async def traffic():
        async def one(i):
            t0 = time.monotonic()
            body = {"messages": [{"role": "user", "content": f"Tell a story about the number {i}."}],
                    "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
            first = None
            async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and '"content": "' in line and '"content": ""' not in line:
                        first = time.monotonic() - t0
            return first
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        until(f'up{{job="jaxserve"}}', lambda v: v == 1, "the server up")
        until(f"vllm:generation_tokens_total{sel}", lambda v: v >= 0, "the counter before the traffic")
        ttfts = asyncio.run(traffic())
        generated = scrape(server)[("vllm:generation_tokens_total", (("model_name", model),))]
        until(f"vllm:generation_tokens_total{sel}", lambda v: v == generated, "the traffic's last token")
        q50 = until(f"histogram_quantile(0.5, sum by (le) "
                    f"(increase(vllm:time_to_first_token_seconds_bucket{sel}[10m])))", lambda v: True, "TTFT")
        kv_max = until(f"max_over_time(vllm:kv_cache_usage_perc{sel}[10m])", lambda v: True, "KV usage")
        kv_now = until(f"vllm:kv_cache_usage_perc{sel}", lambda v: True, "KV usage now")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    upper = min(b for b in (*TTFT_BUCKETS, INF) if b >= max(ttfts))
    assert 0 < q50 <= upper, (q50, sorted(ttfts))
    assert 0 < kv_max <= 1 and kv_now == 0


# Read by page.evaluate, which runs over the DevTools protocol: the page's CSP (no
# 'unsafe-eval') still applies to everything the page itself does.
CANVAS_PIXELS = """id => {
    const c = document.getElementById(id);
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    let inked = 0, sum = 0;
    for (let i = 0; i < d.length; i += 4) {
        if (d[i + 3]) inked++;
        sum = (sum * 31 + d[i] * 7 + d[i + 1] * 5 + d[i + 2] * 3 + d[i + 3]) % 1000000007;
    }
    return [inked, sum];
}"""


def test_the_dashboard_updates_live_in_headless_chromium(server, tmp_path):
    """Debian's Chromium (driven by Playwright) loads /dashboard, under the page's own Content
    Security Policy, while 6 streams run: no CSP violation is reported, the charts gain points
    every second, tokens/s and running go above 0, the throughput chart's pixels are drawn (not
    blank) and change between two samples, the KV figure is a number in [0, 100], the screenshot
    is a real PNG, and every request the page made went to this server."""
    from playwright.sync_api import sync_playwright

    stop = threading.Event()

    def traffic():
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                c.post(f"{server.url}/v1/chat/completions", json={
                    "messages": QUESTION, "max_tokens": 24, "temperature": 0, "ignore_eos": True})

    def until(page, check: str, timeout: float):
        deadline = time.monotonic() + timeout
        while not page.evaluate(check):
            assert time.monotonic() < deadline, f"not within {timeout} s: {check}"
            page.wait_for_timeout(100)

    urls: list[str] = []
    problems: list[str] = []
    workers = [threading.Thread(target=traffic) for _ in range(6)]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.on("request", lambda r: urls.append(r.url))
            # a resource that failed to load is reported again, with its URL, by the response check below
            page.on("console", lambda m: problems.append(m.text)
                    if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
            page.on("response", lambda r: problems.append(f"{r.status} {r.url}")
                    if r.status >= 400 and not r.url.endswith("/favicon.ico") else None)  # no icon: fine
            page.on("pageerror", lambda e: problems.append(str(e)))
            # installed before the page's scripts run; a violation of the page's CSP fires this
            page.add_init_script("document.addEventListener('securitypolicyviolation', e => "
                                 "console.error('CSP violation: ' + e.violatedDirective + ' ' + e.blockedURI))")
            page.goto(f"{server.url}/dashboard")
            until(page, "window.dashboard && window.dashboard.samples >= 2", 30)
            for w in workers:
                w.start()
            until(page, """(() => {
                const s = window.dashboard.series;
                return s['tokens/s'].some(v => v > 0) && s['running'].some(v => v > 0)
                    && s['TTFT p50'].some(v => v > 0);
            })()""", 60)
            before = page.evaluate("window.dashboard.samples")
            pixels_before = page.evaluate(CANVAS_PIXELS, "chart-throughput")
            until(page, f"window.dashboard.samples >= {before + 2}", 30)
            pixels_after = page.evaluate(CANVAS_PIXELS, "chart-throughput")
            size = page.evaluate("(() => { const c = document.getElementById('chart-throughput');"
                                 " return c.width * c.height; })()")
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            text = page.inner_text("body")
            kv = page.inner_text("#stat-kv")
            prefix = page.inner_text("#stat-prefix")
        finally:
            stop.set()
            for w in workers:
                if w.is_alive():
                    w.join()
            browser.close()
    assert not problems, problems
    assert 0 < pixels_before[0] < size and 0 < pixels_after[0] < size  # lines drawn on a clear background
    assert pixels_after != pixels_before  # the chart moved
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert "smollm2" in text
    assert kv.endswith(" %") and 0 <= float(kv[:-2]) <= 100, kv
    assert prefix.endswith(" %") and 0 < float(prefix[:-2]) <= 100  # the same question, again and again
    assert urls and all(u.startswith(server.url + "/") for u in urls), [u for u in urls if not u.startswith(server.url)]
    assert any(u.endswith("/metrics") for u in urls)


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(server):
    """configs/grafana-dashboard.json: every metric name in its PromQL is one a live /metrics has."""
    import re
    from pathlib import Path

    board = json.loads((Path(__file__).parent.parent / "configs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 8
    names = {name for e in exprs for name in re.findall(r"\b((?:vllm|jaxserve):[a-z0-9_]+)", e)}
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {f.name + x for f in families for x in suffixes.get(f.type, ())}  # declared, sampled or not yet
    missing = sorted(n for n in names if n not in exported)
    assert not missing, missing
