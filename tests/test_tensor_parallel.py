"""Runs tests/multidevice (tensor parallelism) in a pytest session of its own with four forced
CPU devices: XLA reads the device count once, before jax starts, and the rest of the suite
keeps one device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_tensor_parallel_suite_on_four_cpu_devices():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                          str(HERE / "multidevice")], env=dict(os.environ, XLA_FLAGS=flags), cwd=HERE.parent,
                         capture_output=True, text=True, timeout=1800)
    print(run.stdout[-5000:])
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert re.search(r"\d+ passed", summary) and not re.search(r"skipped|failed|error", summary), summary
