"""The batch engine on the real default model and on a tiny random model.

Expected outputs come from `ReferenceGenerator` (one sequence, no batching, checked
against transformers in test_default_model.py) or from the same engine run with one
request at a time.
"""

from __future__ import annotations

import random

import jax
import pytest

from jaxserve.engine.engine import Engine, LLM
from jaxserve.engine.sequence import InvalidRequest, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.reference import ReferenceGenerator

WORDS = ("river mountain quiet lantern copper orchard signal harbor meadow puzzle velvet engine "
         "garden thunder pencil marble ocean violet candle window ladder forest").split()

SMALL = dict(max_num_seqs=32, decode_batch_buckets=(1, 8, 32), context_buckets=(256,), max_model_len=256,
             prefill_length_buckets=(32, 128), prefill_batch_buckets=(1, 4))


def chat_prompts(tok, n, seed=0):
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 70)))
        prompts.append(tok.encode_chat([{"role": "user", "content": f"Write about: {text}"}]))
    return prompts


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine(default_model_dir, EngineConfig(**SMALL))


def run_alone(engine, prompt, params):
    seq = engine.add_request(prompt, params)
    engine.run_until_done()
    return seq.output_ids


def test_the_compilation_cache_defaults_to_the_environment_variable(monkeypatch):
    """The suite's one cache per run (tests/conftest.py) reaches every engine this way."""
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE_DIR", "/tmp/elsewhere")
    assert EngineConfig().compilation_cache_dir == "/tmp/elsewhere"
    assert EngineConfig(compilation_cache_dir=None).compilation_cache_dir is None  # a config still wins
    monkeypatch.delenv("JAXSERVE_COMPILATION_CACHE_DIR")
    assert EngineConfig().compilation_cache_dir == "~/.cache/jaxserve/xla"


def test_greedy_matches_reference_path(engine):
    """Includes a prompt longer than the largest prefill bucket (128), so chunked prefill is exercised."""
    tok = engine.tokenizer
    prompts = chat_prompts(tok, 5, seed=1)
    prompts.append(tok.encode_chat([{"role": "user", "content": " ".join(WORDS * 7)}]))
    assert max(len(p) for p in prompts) > 128
    ref = ReferenceGenerator(engine.model_cfg, engine.runner.params, max_len=256)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)) for p in prompts]
    engine.run_until_done()
    for p, s in zip(prompts, seqs):
        assert s.output_ids == ref.generate(p, 16)
        assert s.finish_reason == "length"
    assert engine.pool.num_used == 0


def test_batch_invariance_greedy_and_seeded(engine):
    """12 prompts, each greedy and seeded-sampled: alone, then all 24 arriving four per step."""
    n = 12
    prompts = chat_prompts(engine.tokenizer, n, seed=2)
    params = ([SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * n
              + [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, ignore_eos=True)
                 for i in range(n)])
    prompts = prompts + prompts
    alone = [run_alone(engine, p, sp) for p, sp in zip(prompts, params)]
    assert engine.pool.num_used == 0

    order = list(range(2 * n))
    random.Random(3).shuffle(order)
    seqs = {}
    max_running = 0
    while order or engine.has_unfinished:
        for i in order[:4]:
            seqs[i] = engine.add_request(prompts[i], params[i])
        order = order[4:]
        engine.step()
        max_running = max(max_running, engine.num_running)
    assert max_running >= 16, max_running  # they really ran together
    for i in range(2 * n):
        assert seqs[i].output_ids == alone[i], f"request {i} differs when batched"
    assert alone[n:] != alone[:n]  # sampling did sample
    assert engine.pool.num_used == 0


def test_no_compilation_after_warmup(engine):
    events = []

    def listener(name, *args, **kwargs):
        if "compile" in name or "trace" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x * 3)(1.0)  # the listener does see a compilation
        assert events
        events.clear()
        tok = engine.tokenizer
        prompts = chat_prompts(tok, 20, seed=4) + [tok.encode_chat([{"role": "user", "content": " ".join(WORDS * 7)}])]
        kinds = [SamplingParams(max_tokens=8, temperature=0),
                 SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1, logprobs=5),
                 SamplingParams(max_tokens=5, temperature=0.7, top_k=20, min_p=0.05, presence_penalty=0.5,
                                frequency_penalty=0.3, repetition_penalty=1.2),
                 SamplingParams(max_tokens=20, temperature=0, stop=("\n",))]
        seqs = [engine.add_request(p, kinds[i % 4]) for i, p in enumerate(prompts)]
        for _ in range(3):
            engine.step()
        engine.abort(seqs[0].request_id)
        engine.run_until_done()
        one = engine.add_request(prompts[1], kinds[1])
        engine.run_until_done()
        assert one.finish_reason in ("stop", "length")
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)  # its own: others may listen too
    assert events == []
    assert engine.pool.num_used == 0


def test_stop_strings_and_logprobs(engine):
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    free = run_alone(engine, prompt, SamplingParams(max_tokens=20, temperature=0))
    text = tok.decode(free)
    assert "Paris" in text
    seq = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, stop=("Paris",), logprobs=3))
    events = engine.run_until_done()
    assert seq.finish_reason == "stop"
    assert seq.output_text == text[:text.index("Paris")]
    kept = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, stop=("Paris", "zebra"),
                                                     include_stop_str_in_output=True))
    engine.run_until_done()
    assert kept.finish_reason == "stop" and kept.output_text == text[:text.index("Paris") + len("Paris")]
    streamed = "".join(e.text for e in events if e.request_id == seq.request_id)
    assert streamed == seq.output_text
    lps = [lp for e in events if e.request_id == seq.request_id and e.logprobs for lp in e.logprobs]
    assert len(lps) == len(seq.output_ids)
    assert all(lp["top"][0][0] == lp["token_id"] for lp in lps)  # greedy: the chosen token is the top one
    assert all(len(lp["top"]) == 3 and lp["logprob"] <= 0 for lp in lps)


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(engine):
    """Greedy, the answer ends with EOS at token n. With min_tokens past n the first n - 1
    tokens are the same, EOS is not among the first min_tokens, and the output is at least
    that long; a stop string or stop token id met inside the first min_tokens tokens does not
    end it (vLLM's min_tokens), one met after does."""
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Say hi."}])
    free = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0))
    engine.run_until_done()
    n = len(free.output_ids)
    assert free.finish_reason == "stop" and n < 30 and free.output_ids[-1] in engine.eos_token_ids
    held = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0, min_tokens=n + 6))
    engine.run_until_done()
    assert held.output_ids[:n - 1] == free.output_ids[:n - 1]
    assert len(held.output_ids) >= n + 6
    assert not set(held.output_ids[:n + 6]) & engine.eos_token_ids
    first = free.output_text[:3]  # in the free answer's first tokens
    cut = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0, stop=(first,), min_tokens=8))
    by_id = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0, min_tokens=8,
                                                      stop_token_ids=(free.output_ids[0],)))
    engine.run_until_done()
    assert cut.output_text.startswith(first) and cut.output_text == free.output_text  # never met again
    assert free.output_ids[0] not in by_id.output_ids[:8] and by_id.output_ids[0] != free.output_ids[0]
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_invalid_requests_are_refused_clearly(engine):
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequest, match=r"256 tokens.*250 tokens.*max_tokens is 10"):
        engine.add_request([5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add_request([10**7], SamplingParams())
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequest, match="logit_bias token id 999999"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={999999: 1.0}))
    with pytest.raises(InvalidRequest, match="at most 300"):
        SamplingParams(logit_bias={t: 1.0 for t in range(301)})
    with pytest.raises(InvalidRequest, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(InvalidRequest, match="integer token ids"):
        SamplingParams(logit_bias={"five": 1.0})
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(InvalidRequest, match=name):
                SamplingParams(**{name: value})
    assert not engine.has_unfinished


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_page_pool_completes_everything(tiny_model_dir, mode):
    """12 pages of 16 tokens cannot hold eight 40-70 token requests at once: the scheduler waits
    and preempts (by recompute, or by swapping pages to host memory and back, within a 5-page
    swap space whose use is checked after every step), and each greedy output equals the one
    from an ample pool that never preempts. The server's metrics, rendered after every step,
    agree with what the sequences went through: preemptions by mode (each sequence's own count,
    its state telling the mode), requests swapped and the swap bytes they hold, and at the end
    8 x 30 generated tokens however often a sequence was recomputed."""
    from jaxserve.config import ModelSpec
    from jaxserve.engine.sequence import Status
    from jaxserve.metrics import Metrics
    from jaxserve.serving.registry import ServedModel
    from server_proc import parse_samples

    opts = dict(max_num_seqs=8, decode_batch_buckets=(1, 8), context_buckets=(128,), max_model_len=128,
                prefill_length_buckets=(32,), prefill_batch_buckets=(1, 4))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(10, 40))] for _ in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ample = LLM(tiny_model_dir, **opts, warmup=False)
    expected = ample.generate(prompts, params)
    assert ample.engine.scheduler.num_preemptions == 0
    # Swap space for 5 pages: a sequence holds up to 5, so swapping is rationed (the rest recompute).
    swap_gib = 5 * ample.engine.page_bytes / 2**30
    eng = LLM(tiny_model_dir, num_pages=12, preemption_mode=mode, swap_space_gib=swap_gib, **opts, warmup=False).engine
    metrics = Metrics()
    metrics.state.sources["tiny"] = ServedModel(name="tiny", spec=ModelSpec(path=str(tiny_model_dir)), created=0,
                                                engine=eng)
    eng.metrics = metrics.for_model("tiny")
    label = (("model_name", "tiny"),)
    sched = eng.scheduler
    assert sched.cfg.swap_pages == (5 if mode == "swap" else 0)
    seqs = [eng.add_request(p, params) for p in prompts]
    most = 0
    seen = {s.request_id: 0 for s in seqs}
    by_mode = {"recompute": 0, "swap": 0}
    while eng.has_unfinished:
        eng.step()
        # swap bookkeeping: the space used is the swapped sequences' host pages, within the budget
        assert sched.swap_used == sum(s.swap_pages for s in sched.swapped) <= sched.cfg.swap_pages
        for s in sched.swapped:
            assert {a.shape[1] for a in jax.tree.leaves(s.swap_data)} == {s.swap_pages}
        most = max(most, sched.swap_used)
        for s in seqs:
            if s.num_preemptions > seen[s.request_id]:
                assert s.status in (Status.WAITING, Status.SWAPPED)  # still out of the batch after its step
                by_mode["swap" if s.status is Status.SWAPPED else "recompute"] += s.num_preemptions - seen[s.request_id]
                seen[s.request_id] = s.num_preemptions
        scraped = parse_samples(metrics.render().decode())
        swapped = [s for s in seqs if s.status is Status.SWAPPED]
        assert scraped[("vllm:num_preemptions_total", label)] == sum(by_mode.values())
        for m, n in by_mode.items():
            assert scraped.get(("jaxserve:preemptions_total", (("mode", m), *label)), 0) == n, (m, by_mode)
        assert scraped[("vllm:num_requests_swapped", label)] == len(swapped)
        assert scraped[("jaxserve:swap_space_bytes_used", label)] == eng.page_bytes * sum(s.swap_pages
                                                                                        for s in swapped)
    assert by_mode[mode] > 0
    if mode == "recompute":
        assert by_mode["swap"] == 0 and most == 0
    else:
        assert 0 < most <= 5
    assert [s.finish_reason for s in seqs] == ["length"] * 8
    assert [s.output_ids for s in seqs] == [o.token_ids for o in expected]
    assert eng.pool.num_used == 0 and sched.swap_used == 0 and not sched.swapped
    scraped = parse_samples(metrics.render().decode())
    assert scraped[("vllm:generation_tokens_total", label)] == 8 * 30
    assert scraped[("vllm:request_success_total", (("finished_reason", "length"), *label))] == 8
    assert scraped[("jaxserve:swap_space_bytes_used", label)] == 0


def test_generate_prompts_file_runs_the_batch_engine(tiny_model_dir, tmp_path):
    """Plain lines and JSON lines in; one JSON line per prompt out, in order, each equal to the
    same prompt through `LLM.generate`; the throughput report on stderr."""
    import json
    import subprocess
    import sys

    f = tmp_path / "prompts.txt"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    f.write_text('The sky is\n{"prompt": "One, two,", "max_tokens": 3}\n\n{"prompt": "Hello", "stop": ["zz"]}\n'
                 # a line takes a request body's options, checked as the server checks them
                 '{"prompt": "One, two,", "logprobs": 2, "min_tokens": 4, "max_tokens": 4, "stop_token_ids": [0, 1]}\n'
                 + json.dumps({"messages": chat, "continue_final_message": True, "add_generation_prompt": False}))
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--model", str(tiny_model_dir),
                           "--prompts-file", str(f), "--max-tokens", "5", "--max-num-seqs", "4",
                           "--max-model-len", "128"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["The sky is", "One, two,", "Hello", "One, two,", chat]
    rows, (scored, continued) = rows[:3], rows[3:]
    assert scored["completion_tokens"] == 4 and [len(r["top"]) for r in scored["logprobs"]] == [2] * 4
    # every row equals its prompt through LLM.generate with the line's options (per-line max_tokens, stop)
    # what the flags make (compiled as the calls need them)
    llm = LLM(tiny_model_dir, max_num_seqs=4, max_model_len=128, context_buckets=(128,), warmup=False)
    # The default prefill lengths (32, 128, 512) stop at 128: a 512-token chunk cannot happen.
    assert llm.engine.runner.prefill_lengths == (32, 128)
    assert max(t for _, t, _ in llm.engine.runner.buckets()) == 128
    want = llm.generate(["The sky is", "One, two,", "Hello"],
                        [SamplingParams(max_tokens=5, temperature=0), SamplingParams(max_tokens=3, temperature=0),
                         SamplingParams(max_tokens=5, temperature=0, stop=("zz",))])
    assert [(r["text"], r["completion_tokens"], r["finish_reason"]) for r in rows] == \
        [(w.text, len(w.token_ids), w.finish_reason) for w in want]
    assert [len(w.token_ids) for w in want] == [5, 3, 5]  # the tiny model runs to max_tokens: the caps show
    cont = llm.tokenizer.encode_chat(chat, False, continue_final_message=True)
    assert continued["text"] == llm.generate([cont], SamplingParams(max_tokens=5, temperature=0))[0].text
    assert "generated tok/s" in proc.stderr
    from jaxserve.cli import _generate_engine_options, build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--prompts-file", "f", "--max-model-len", "128"])
    assert _generate_engine_options(args)["context_buckets"] == (128,)  # the flag reaches the engine, fitted
    bad = tmp_path / "bad.txt"
    bad.write_text('{"prompt": "x"\n')
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--model", str(tiny_model_dir),
                           "--prompts-file", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "bad.txt:1: invalid JSON" in proc.stderr


def test_generate_prompts_file_lines_are_checked_as_request_bodies(tiny_model_dir, tmp_path):
    """A --prompts-file line is refused as the server refuses a body: every bad line named with
    its field, no traceback, nothing compiled or generated. (Lines with a body's options are in
    the test above.)"""
    import subprocess
    import sys

    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(['{"prompt": "x", "max_tokens": "many"}', "a plain line is fine",
                            '{"messages": [{"role": "wizard", "content": "x"}]}', '{"prompt": "x", "n": 2}',
                            '{"prompt": "x", "max_tokens": 500}', '{"prompt": "x", "echo": true}']) + "\n")
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--model", str(tiny_model_dir),
                           "--prompts-file", str(f), "--max-tokens", "4", "--max-num-seqs", "2",
                           "--max-model-len", "128"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    said = proc.stderr.strip().splitlines()[-5:]  # every bad line, in order, before anything runs
    for line, start in zip(said, ["prompts.jsonl:1 ('max_tokens'): 'max_tokens' must be an integer",
                                  "prompts.jsonl:3 ('messages[0].role'): ", "prompts.jsonl:4 ('n'): 'n' must be <= 1",
                                  "prompts.jsonl:5: this model's maximum context length is 128",
                                  "prompts.jsonl:6 ('echo'): "]):
        assert line.startswith(f"jaxserve generate: error: {tmp_path / start}"), line


def test_prefill_token_budget_chunks_long_prompts_between_decode_steps(tiny_model_dir):
    """With a 32-token budget a 100-token prompt arriving while a stream decodes is prefilled in
    chunks of <= 32 tokens, each followed by a decode step of the running stream, and both
    greedy outputs equal the ones without a budget (where the prompt goes in one step)."""
    opts = dict(max_num_seqs=4, decode_batch_buckets=(1, 4), context_buckets=(256,), max_model_len=256,
                prefill_length_buckets=(32, 128), prefill_batch_buckets=(1, 4))
    rng = random.Random(9)
    short = [rng.randrange(3, 49152) for _ in range(8)]
    long = [rng.randrange(3, 49152) for _ in range(100)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def run(**extra):
        eng = Engine(tiny_model_dir, EngineConfig(**opts, **extra), warmup=False)
        steps = []
        real_launch = eng.runner.launch

        def recording_launch(items, decode, *args, **kwargs):
            steps.append(("decode" if decode else "prefill", sum(it.length for it in items)))
            return real_launch(items, decode, *args, **kwargs)

        eng.runner.launch = recording_launch
        a = eng.add_request(short, params).request_id
        events = [ev for _ in range(3) for ev in eng.step()]  # the short one decodes before the long one comes
        b = eng.add_request(long, params).request_id
        outs = {}
        for ev in events + eng.run_until_done():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
        return [outs[a], outs[b]], steps[3:], eng

    want, steps_whole, _ = run()
    assert ("prefill", 100) in steps_whole
    got, steps, eng = run(prefill_token_budget=32)
    assert got == want and eng.pool.num_used == 0
    prefills = [i for i, (kind, _) in enumerate(steps) if kind == "prefill"]
    assert [steps[i][1] for i in prefills] == [32, 32, 32, 4]
    assert all(steps[i + 1][0] == "decode" for i in prefills[:-1])  # the stream kept flowing


def test_a_prompt_longer_than_the_smallest_context_bucket_is_prefilled_in_chunks(tiny_model_dir):
    """Chunks of a 100-token prompt with the 32-token context bucket first: each chunk's step
    uses the bucket its context needs, and with a repetition penalty (which reads the token
    history) the greedy output equals the one of an engine with a single 256 bucket."""
    opts = dict(max_num_seqs=2, decode_batch_buckets=(1, 2), max_model_len=256, prefill_length_buckets=(16, 32),
                prefill_batch_buckets=(1,))
    prompt = [random.Random(4).randrange(3, 49152) for _ in range(100)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    outs = []
    for buckets in ((256,), (32, 256)):
        eng = Engine(tiny_model_dir, EngineConfig(**opts, context_buckets=buckets), warmup=False)
        outs.append(run_alone(eng, prompt, params))
        assert eng.pool.num_used == 0
    assert outs[0] == outs[1] and len(outs[0]) == 12


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_interactive_request_preempts_a_batch_one_when_slots_are_full(tiny_model_dir, mode):
    """max_num_seqs = 2, both slots decoding batch requests (priority 10): an interactive request
    (priority 0) preempts the latest batch one at once, runs, and every greedy output equals
    the output of the same request run alone (the preempted one recomputed, or swapped out
    to host memory and back)."""
    opts = dict(max_num_seqs=2, decode_batch_buckets=(1, 2), context_buckets=(128,), max_model_len=128,
                prefill_length_buckets=(32,), prefill_batch_buckets=(1,),
                preemption_mode=mode, swap_space_gib=0.01)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(12)] for _ in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    solo = LLM(tiny_model_dir, **opts, warmup=False)
    alone = [solo.generate([p], params)[0].token_ids for p in prompts]
    eng = Engine(tiny_model_dir, EngineConfig(**opts), warmup=False)
    batch = [eng.add_request(p, params, priority=10) for p in prompts[:2]]
    for _ in range(4):
        eng.step()
    assert eng.num_running == 2 and all(len(s.output_ids) >= 1 for s in batch)
    urgent = eng.add_request(prompts[2], params, priority=0)
    eng.step()
    parked = eng.scheduler.waiting if mode == "recompute" else eng.scheduler.swapped
    assert urgent in eng.scheduler.running and batch[1] in parked  # the latest batch one gave way
    assert batch[0] in eng.scheduler.running and eng.scheduler.preemptions == {mode: 1, **{
        m: 0 for m in ("recompute", "swap") if m != mode}}
    eng.run_until_done()
    assert [s.output_ids for s in batch + [urgent]] == alone
    assert eng.pool.num_used == 0


def test_deadlines_end_requests_wherever_they_are(tiny_model_dir):
    """A request already past its deadline is ended while waiting; a decoding one is ended once
    its deadline passes (moved into the past here instead of sleeping); each gets a finished
    event with reason "timeout", its pages come back, and the others run on untouched."""
    import time

    opts = dict(max_num_seqs=4, decode_batch_buckets=(1, 4), context_buckets=(128,), max_model_len=128,
                prefill_length_buckets=(32,), prefill_batch_buckets=(1, 4))
    eng = Engine(tiny_model_dir, EngineConfig(**opts), warmup=False)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 49152) for _ in range(10)] for _ in range(3)]
    late = eng.add_request(prompts[0], SamplingParams(max_tokens=8, temperature=0), timeout=1e-9)
    slow = eng.add_request(prompts[1], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), timeout=3600)
    other = eng.add_request(prompts[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    events = eng.step()
    assert [(e.request_id, e.finish_reason) for e in events if e.finished] == [(late.request_id, "timeout")]
    assert late.output_ids == [] and late not in eng.scheduler.waiting
    while len(slow.output_ids) < 3:
        eng.step()
    slow.deadline = time.monotonic() - 1
    ended = [e for e in eng.step() if e.request_id == slow.request_id]
    assert ended[0].finished and ended[0].finish_reason == "timeout" and slow not in eng.scheduler.running
    eng.run_until_done()
    assert other.finish_reason == "length" and len(other.output_ids) == 12
    assert eng.pool.num_used == 0
