"""Test-only fault injection: off unless the JAXSERVE_FAULTS environment variable names faults.

    JAXSERVE_FAULTS="detokenize=MARK,step=MARK,engine_thread=MARK,stall=MARK"

Each fault fires for the requests whose engine id contains MARK (the server's engine ids
start with the client's X-Request-Id, so a test picks its victims by the id it sends):

    detokenize     the detokenizer raises on the request's first token (its postprocessing fails)
    step           the device step that would run the request raises (every sequence in it fails)
    engine_thread  the engine thread dies when the request reaches it
    stall          the engine thread blocks forever when the request reaches it

The reliability tests start a real server with these set; nothing else should.
"""

from __future__ import annotations

import os
import threading

ENV = "JAXSERVE_FAULTS"
KINDS = ("detokenize", "step", "engine_thread", "stall")


class InjectedFault(RuntimeError):
    """A failure a test asked for."""


class EngineThreadKilled(BaseException):
    """Ends the engine thread: a BaseException, so no `except Exception` in the loop stops it."""


def parse(spec: str) -> dict[str, str]:
    faults = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, sep, mark = item.partition("=")
        if kind not in KINDS or not sep or not mark:
            raise ValueError(f"{ENV}: {item!r} is not KIND=MARK with KIND one of {', '.join(KINDS)}")
        faults[kind] = mark
    return faults


FAULTS = parse(os.environ.get(ENV, ""))


def hit(kind: str, request_id: str) -> bool:
    mark = FAULTS.get(kind)
    return mark is not None and mark in request_id


def on_arrival(request_id: str) -> None:
    """Called by the engine thread as it takes a request from its inbox."""
    if not FAULTS:
        return
    if hit("engine_thread", request_id):
        raise EngineThreadKilled(f"injected: the engine thread dies on {request_id}")
    if hit("stall", request_id):
        threading.Event().wait()  # forever: what a hung device call looks like from the host


def check_step(request_ids) -> None:
    if FAULTS and any(hit("step", r) for r in request_ids):
        raise InjectedFault("injected: the device step failed")


def check_detokenize(request_id: str) -> None:
    if FAULTS and hit("detokenize", request_id):
        raise InjectedFault("injected: the detokenizer failed")
