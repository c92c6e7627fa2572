"""The server process's life: serving -> draining -> exit 0, or serving -> failed -> exit 1.

Draining (SIGTERM or SIGINT, as Kubernetes and systemd stop a process): new generation
requests get 503 with Retry-After and `/health` says "draining" with 503, so a load balancer
takes the server out of rotation, while the requests already admitted run to their end for up
to `drain_timeout_s`. What is left then ends with finish_reason "abort" and an error event.
Spans are flushed and the process exits 0. A second signal exits at once.

Failing: a model's engine thread that died, or that has spent `watchdog_timeout_s` in one step
with work waiting, cannot serve again, and a process that stays up answering errors is the
zombie a supervisor never replaces. So the watchdog ends every open stream with an error event
and the process exits 1: its supervisor (systemd, Kubernetes, Ray Serve) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Callable

from jaxserve.serving.protocol import APIError
from jaxserve.serving.tracing import flush_spans

log = logging.getLogger(__name__)

SERVING, DRAINING, FAILED = "serving", "draining", "failed"


class Lifecycle:
    """Owned by the app; `serve()` points `request_exit` at uvicorn and signals at `signal()`."""

    def __init__(self, registry, drain_timeout_s: float, watchdog_timeout_s: float, retry_after_s: int = 1):
        self.registry = registry  # ModelRegistry or a cluster's registry: .models[name].runner
        self.drain_timeout_s = drain_timeout_s
        self.watchdog_timeout_s = watchdog_timeout_s
        self.retry_after_s = retry_after_s
        self.state = SERVING
        self.reason: str | None = None
        self.exit_code = 0
        self.open: set = set()  # the Responders of requests being answered
        self.request_exit: Callable[[], None] = lambda: None  # serve() sets it: uvicorn's should_exit
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def accepting(self) -> bool:
        return self.state == SERVING

    def refusal(self) -> APIError:
        if self.state == DRAINING:
            return APIError(503, "the server is shutting down and takes no new requests", code="server_draining",
                            headers={"Retry-After": str(self.retry_after_s)})
        return APIError(503, f"the server has failed and is exiting: {self.reason}", code="server_failed",
                        headers={"Retry-After": str(self.retry_after_s)})

    def _runners(self) -> list:
        return [m.runner for m in list(self.registry.models.values()) if m.runner is not None]

    def _spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        """On the event loop, at startup: remember the loop and start the watchdog."""
        self.loop = asyncio.get_running_loop()
        self._spawn(self._watch())

    # Draining ---------------------------------------------------------------------------

    def signal(self, signame: str) -> None:
        """A stop signal arrived (on the main thread, which runs the event loop): the first
        starts the drain, a second exits now."""
        if self.state != SERVING:
            log.warning("%s again: exiting now", signame)
            logging.shutdown()
            os._exit(1)
        if self.loop is None:  # not started yet: nothing to drain
            self.request_exit()
            return
        self.loop.call_soon_threadsafe(self.drain, signame)

    def drain(self, why: str = "drain") -> None:
        if self.state != SERVING:
            return
        self.state = DRAINING
        self.reason = why
        log.warning("%s: draining; new requests get 503, those in flight have %.0f s to finish", why,
                    self.drain_timeout_s)
        self._spawn(self._drain())

    def _busy(self) -> bool:
        return bool(self.open) or any(getattr(r, "busy", False) for r in self._runners())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ended = 0
        if self._busy():
            reason = f"the server is shutting down: requests still running after drain_timeout_s={self.drain_timeout_s}"
            ended = sum(r.end_all(reason, finish_reason="abort") for r in self._runners())
            await self._until_answered(5.0)
        log.warning("drained (%d request(s) ended unfinished); exiting", ended)
        flush_spans()
        self.request_exit()

    async def _until_answered(self, seconds: float) -> None:
        """Give the open responses time to write their last events."""
        deadline = time.monotonic() + seconds
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    # Failing ----------------------------------------------------------------------------

    async def _watch(self, period: float = 0.25) -> None:
        while self.state != FAILED:
            await asyncio.sleep(period)
            for name, m in list(self.registry.models.items()):
                failure = getattr(m.runner, "failure", None)
                why = failure(self.watchdog_timeout_s) if failure is not None else None
                if why is not None:
                    m.runner.dead = m.runner.dead or why
                    await self.fail(f"model {name}: {why}")
                    return

    async def fail(self, why: str) -> None:
        """End every stream with an error event, then exit 1 (the supervisor restarts us)."""
        if self.state == FAILED:
            return
        self.state = FAILED
        self.reason = why
        self.exit_code = 1
        log.critical("%s: ending every open request and exiting with status 1", why)
        ended = sum(r.end_all(f"the server failed: {why}") for r in self._runners())
        await self._until_answered(3.0)
        log.critical("ended %d request(s); exiting", ended)
        flush_spans()
        # A stuck engine thread may never let the interpreter finish: exit regardless.
        backstop = threading.Timer(10.0, os._exit, (1,))
        backstop.daemon = True
        backstop.start()
        self.request_exit()
