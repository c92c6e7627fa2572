"""Runs tests/multidevice (tensor parallelism) in a pytest session of its own with four forced
CPU devices: XLA reads the device count once, before jax starts, and the rest of the suite
keeps one device. The session starts when this test, one of the last, asks for it (not beside
the suite: tests/background.py says why); the test waits for it and reads its summary."""

from __future__ import annotations

import re

from background import JOBS


def test_tensor_parallel_suite_on_four_cpu_devices():
    run = JOBS["tensor_parallel"].result(timeout=1800)
    print(run.stdout[-5000:])
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert re.search(r"\d+ passed", summary) and not re.search(r"skipped|failed|error", summary), summary
