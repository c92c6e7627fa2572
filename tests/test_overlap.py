"""Multi-step decode and the overlapped host loop change when the host sees tokens, never which
tokens: every output here is compared with the plain loop (one decode step per call, nothing
chained), on the tiny model, for greedy, seeded sampling, penalties, stop strings, logprobs,
max_tokens shorter than a call, the end of the context, aborts and deadlines."""

from __future__ import annotations

import random

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sequence import SamplingParams

OPTS = dict(max_num_seqs=8, decode_batch_buckets=(1, 2, 8), context_buckets=(64, 128), max_model_len=128,
            prefill_length_buckets=(32,), prefill_batch_buckets=(1, 4))
ON = dict(decode_steps=4, overlap=True)  # what configs/server.toml runs
PLAIN = dict(decode_steps=1, overlap=False)


def kinds():
    return [SamplingParams(max_tokens=23, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, logprobs=3),
            SamplingParams(max_tokens=14, temperature=0.8, top_k=30, seed=9, repetition_penalty=1.3,
                           presence_penalty=0.4, frequency_penalty=0.2, ignore_eos=True),
            SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),  # shorter than one call
            SamplingParams(max_tokens=40, temperature=0.7, seed=3, ignore_eos=True)]


def prompts(n, seed=0, lo=5, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(model_dir, ps, params, stagger=False, **cfg):
    """Outputs (ids, text, logprobs, finish) of each prompt; `stagger` adds one request per step."""
    eng = Engine(model_dir, EngineConfig(**OPTS, **cfg), warmup=False)
    seqs, logprobs = [], {}
    pending = list(zip(ps, params))
    while pending or eng.has_unfinished:
        for _ in range(1 if stagger else len(pending)):
            if pending:
                seqs.append(eng.add_request(*pending.pop(0)))
        for ev in eng.step():
            logprobs.setdefault(ev.request_id, []).extend(ev.logprobs or [])
    assert eng.pool.num_used == 0 and not eng.scheduler.running
    return [(s.output_ids, s.output_text, logprobs.get(s.request_id), s.finish_reason) for s in seqs], eng


@pytest.mark.parametrize("stagger", [False, True])
def test_multi_step_and_overlap_give_the_plain_loops_outputs(tiny_model_dir, stagger):
    ps = prompts(10, seed=1)
    params = [kinds()[i % 5] for i in range(10)]
    want, _ = run(tiny_model_dir, ps, params, stagger, **PLAIN)
    for cfg in (dict(decode_steps=4, overlap=False), dict(decode_steps=4, overlap=True),
                dict(decode_steps=3, overlap=True)):
        got, eng = run(tiny_model_dir, ps, params, stagger, **cfg)
        assert got == want, cfg
        assert [len(o[0]) for o in got] == [p.max_tokens for p in params]


def test_chained_calls_really_run_and_stop_strings_hold(tiny_model_dir):
    """A single stream with overlap launches chained calls (counted), and a stop string found in
    the middle of a call ends the text where the plain loop ends it, the call's later tokens
    discarded."""
    p = prompts(1, seed=3)[0]
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    (ids, text, _, _), = run(tiny_model_dir, [p], [base], **PLAIN)[0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    with_stop = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    want, _ = run(tiny_model_dir, [p], [with_stop], **PLAIN)
    eng = Engine(tiny_model_dir, EngineConfig(**OPTS, **ON), warmup=False)
    launches = []
    real = eng.runner.launch
    eng.runner.launch = lambda items, decode, k=1, chain=None: launches.append((decode, k, chain is not None)) or \
        real(items, decode, k, chain)
    seq = eng.add_request(p, with_stop)
    eng.run_until_done()
    assert [(seq.output_ids, seq.output_text, None, seq.finish_reason)] == [(w[0], w[1], None, w[3]) for w in want]
    assert want[0][3] == "stop" and len(want[0][0]) < 40
    assert (True, 4, True) in launches  # a decode call of 4 steps chained on the one before
    assert eng.pool.num_used == 0


def test_the_end_of_the_context_and_aborts_mid_call(tiny_model_dir):
    """Prompts that fill max_model_len exactly stop with "length" at the plain loop's token (the
    last calls hold pages for fewer steps than they run); an abort
    and a deadline while a chained call is in flight end their requests, free their pages, and
    leave the other streams' outputs as they were."""
    ps = prompts(3, seed=7, lo=100, hi=120)
    params = [SamplingParams(max_tokens=128 - len(p), temperature=0, ignore_eos=True) for p in ps]
    want, _ = run(tiny_model_dir, ps, params, **PLAIN)
    got, _ = run(tiny_model_dir, ps, params, **ON)
    assert got == want and all(len(p) + len(o[0]) == 128 and o[3] == "length" for p, o in zip(ps, got))

    short = prompts(3, seed=8)
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want, _ = run(tiny_model_dir, short[2:], [long], **PLAIN)
    eng = Engine(tiny_model_dir, EngineConfig(**OPTS, **ON), warmup=False)
    a, b, c = (eng.add_request(p, long) for p in short)
    while len(c.output_ids) < 6:
        eng.step()
    assert eng._inflight is not None
    eng.abort(a.request_id)
    b.deadline = 0.0
    eng.run_until_done()
    assert a.finish_reason == "abort" and b.finish_reason == "timeout"
    assert c.output_ids == want[0][0] and eng.pool.num_used == 0


def test_quantization_at_load(tiny_model_dir):
    """`quantization` turns a float checkpoint's seven layer weights and the tied table into int8
    when the engine loads it; "int8" serves them weight-only, "w8a8" with int8 activations too.
    Greedy outputs of both agree with float32 on most tokens (a tiny random model has flat
    logits, so not on all), and the two int8 modes differ from each other somewhere, which shows
    the int8 x int8 path ran."""
    ps = prompts(4, seed=11, lo=20, hi=30)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 4
    outs = {}
    for mode in (None, "int8", "w8a8"):
        got, eng = run(tiny_model_dir, ps, params, quantization=mode, **ON)
        outs[mode] = [o[0] for o in got]
        if mode:
            assert eng.runner.params["layers"]["wq"]["q8"].dtype == "int8"
            assert ("signs" in eng.runner.params["layers"]["wq"]) == (mode == "w8a8")  # rotated for W8A8
            assert eng.runner.matmul_impl == ("w8a8" if mode == "w8a8" else "xla")
    for mode in ("int8", "w8a8"):
        same = sum(a == b for x, y in zip(outs[None], outs[mode]) for a, b in zip(x, y))
        assert same >= 0.5 * 48, (mode, same)
    assert outs["int8"] != outs["w8a8"]


def test_an_int4_checkpoint_is_refused_by_w8a8():
    import numpy as np

    from jaxserve.checkpoint.quantize import quantize_at_load

    int4 = {"layers": {"wq": {"q4": np.zeros((1, 2, 2), np.uint8)}}}
    with pytest.raises(ValueError, match="int4"):
        quantize_at_load(int4, "w8a8")
    assert quantize_at_load(int4, None) is int4


def test_serve_flags_override_the_preset(tiny_model_dir):
    """`jaxserve serve --config configs/server.toml` runs W8A8, 4-step calls and overlap; the flags
    switch each off (the ablation in BENCHMARKS.md starts servers this way)."""
    from pathlib import Path

    from jaxserve.cli import build_parser, serve_configs

    preset = str(Path(__file__).resolve().parent.parent / "configs" / "server.toml")
    base = ["serve", "--config", preset, "--model", str(tiny_model_dir)]
    _, eng = serve_configs(build_parser().parse_args(base))
    assert (eng.quantization, eng.decode_steps, eng.overlap, eng.cpu_matmul_kernel) == ("w8a8", 4, True, True)
    _, eng = serve_configs(build_parser().parse_args(
        base + ["--quantization", "none", "--decode-steps", "1", "--no-overlap", "--no-cpu-matmul-kernel"]))
    assert (eng.quantization, eng.decode_steps, eng.overlap, eng.cpu_matmul_kernel) == (None, 1, False, False)
    _, eng = serve_configs(build_parser().parse_args(base + ["--quantization", "int8"]))
    assert eng.quantization == "int8" and eng.decode_steps == 4 and eng.enable_prefix_caching
    _, eng = serve_configs(build_parser().parse_args(base + ["--no-enable-prefix-caching"]))
    assert not eng.enable_prefix_caching and eng.quantization == "w8a8"
