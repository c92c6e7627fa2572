"""Serving benchmark: load any OpenAI-compatible endpoint and measure it as `vllm bench serve` does.

    dataset.py   seeded synthetic prompts (text from CPython's pydoc topics) or a JSONL file
    client.py    one streamed request, timed chunk by chunk; the load generator
    metrics.py   TTFT, TPOT, ITL, E2EL and throughputs from the timed requests
    report.py    the table, the JSON file and the throughput-latency plot

`jaxserve bench --url URL` is the command line; scripts/bench_compare.py runs it against
jaxserve, the naive one-request-at-a-time server and llama.cpp's llama-server.
"""
