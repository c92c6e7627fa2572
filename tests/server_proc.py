"""A real `jaxserve serve` process on a free loopback port, for tests that speak HTTP to it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def parse_samples(exposition: str) -> dict[tuple, float]:
    """A Prometheus text exposition, parsed: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(exposition) for s in fam.samples}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts the server, waits for /health to say 200, and records what /health said on the way."""

    def __init__(self, model_dir: Path, workdir: Path, config: str, extra_args: tuple[str, ...] = (),
                 startup_timeout: float = 600.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "server.toml"
        cfg.write_text(config)
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "jaxserve", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--config", str(cfg), *extra_args]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.health_seen: list[int] = []
        try:
            self._wait_healthy(startup_timeout)
        except Exception:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=5).status_code
                self.health_seen.append(status)
                if status == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def stats(self, headers: dict | None = None) -> dict:
        models = httpx.get(f"{self.url}/stats", headers=headers or {}, timeout=5).json()["models"]
        return next(iter(models.values()))

    def rss_mib(self) -> float:
        """The server process's resident memory, from /proc."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc status")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
