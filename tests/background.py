"""Subprocess checks: whole programs that two tests run in a process of their own.

The GPU ahead-of-time compiles in the CUDA plugin's environment (tests/test_gpu_aot.py, about
220 busy core-s alone) start as soon as pytest has collected their test and run beside the
suite under Linux's SCHED_IDLE policy (`chrt --idle`; nice 19 where there is no chrt), taking
the cycles the other tests leave idle (server start-ups, HTTP round trips, Ray). The
tensor-parallel suite on four forced CPU devices (tests/test_tensor_parallel.py, ~150 core-s
alone) starts when its test asks for it, at the end. Each test waits for its job and judges its
output; the two test files run last (`last`). A job whose test was not collected never starts;
one still running at the end is killed.

Why not nice 19: Ray runs its workers, the cluster tests' replicas, at nice 15, and a nice 19 job
takes 15 / (15 + 36) of a core from each; SCHED_IDLE's weight is 3. tests/test_cluster.py alone
took 164 s, beside the GPU AOT check 187 s at nice 19 and 167 s under SCHED_IDLE (which still
compiled 79 of the check's 216 cases meanwhile, against 94 at nice 19).

Why the tensor-parallel suite does not run beside: its four devices meet in collectives, and
starved of CPU they wait for each other. Beside tests/test_overlap.py, idle-scheduled, it passed
one test in the 69 s that test_overlap.py took (60.3 s alone, 63.0 s beside the GPU AOT check),
the machine busy 146 core-s against 88. Whole clean-clone runs on one 2-core machine
(2026-12-07): both jobs beside, 1,047 s at nice 19 and 1,076 s idle-scheduled; this way 1,064 s,
109 s of it the tensor-parallel suite at the end; 812 s with neither job. Running beside buys
little here: the tests slow down by about what the jobs would take alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AOT_PYTHON = ROOT / ".venv-gpu-aot" / "bin" / "python"


class Job:
    def __init__(self, test_file: str, argv: list[str], env: dict[str, str] | None = None, beside: bool = True):
        """`beside`: start when collection finishes and run beside the suite; else when its test asks."""
        self.test_file, self.argv, self.env, self.beside = test_file, argv, env, beside
        self._proc: subprocess.Popen | None = None
        self._out = self._err = None

    def start(self) -> None:
        if self._proc is None:
            self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            lowest = ["chrt", "--idle", "0"] if shutil.which("chrt") else ["nice", "-n", "19"]
            self._proc = subprocess.Popen([*lowest, *self.argv], cwd=ROOT, stdout=self._out,
                                          stderr=self._err, env=dict(os.environ, **(self.env or {})))

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the job (started now if collection did not start it) and return its output."""
        self.start()
        rc = self._proc.wait(timeout=timeout)
        self._out.seek(0), self._err.seek(0)
        return subprocess.CompletedProcess(self.argv, rc, self._out.read(), self._err.read())

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _xla_flags(n: int) -> str:
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()


JOBS = {
    "tensor_parallel": Job("test_tensor_parallel.py",
                           [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                            str(ROOT / "tests" / "multidevice")], {"XLA_FLAGS": _xla_flags(4)}, beside=False),
    "gpu_aot": Job("test_gpu_aot.py", [str(AOT_PYTHON), str(ROOT / "scripts" / "gpu_aot_check.py")]),
}


def last(items: list) -> list:
    """The collected tests with the job-waiting test files moved to the end, order kept otherwise."""
    files = {job.test_file for job in JOBS.values()}
    waits = [item for item in items if Path(str(item.fspath)).name in files]
    return [item for item in items if item not in waits] + waits


def start_collected(items) -> None:
    files = {Path(str(item.fspath)).name for item in items}
    for job in JOBS.values():
        if job.beside and job.test_file in files and (job is not JOBS["gpu_aot"] or AOT_PYTHON.exists()):
            job.start()


def stop_all() -> None:
    for job in JOBS.values():
        job.stop()
