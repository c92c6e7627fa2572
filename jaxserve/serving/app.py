"""The HTTP server: OpenAI-compatible routes over the engines of a ModelRegistry.

A generation request goes:

    read the body (413 past the limit) -> parse and validate (protocol.py, 400s)
    -> pick the model (404 / 503) -> render the chat template and tokenize
    -> check each prompt fits (400 naming both numbers) -> one engine request per
       choice (n per prompt) -> stream SSE chunks, or collect them into one response.

Token events cross from the engine thread through `AsyncEngine` (call_soon_threadsafe
into an asyncio queue), so the event loop never blocks on the device. A client that
goes away cancels the response task; the engine-side iterators' `finally` blocks then
post aborts, which the engine applies before its next step, freeing the pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import importlib.metadata
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from jaxserve.config import ConfigError, ServerConfig
from jaxserve.engine.sequence import InvalidRequest, SamplingParams, TokenEvent
from jaxserve.metrics import CONTENT_TYPE, Metrics
from jaxserve.serving import protocol as P
from jaxserve.serving import messages as M
from jaxserve.serving import responses as R
from jaxserve.serving.admission import Admission, Ticket
from jaxserve.serving.lifecycle import Lifecycle
from jaxserve.serving.openapi import openapi_document
from jaxserve.serving.protocol import APIError
from jaxserve.serving.registry import ModelRegistry, Runner, ServedModel
from jaxserve.serving.tracing import REQUEST_ID, RequestSpan, request_id_from

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/version", "/metrics", "/dashboard")  # as vLLM: scrapers carry no API key
DASHBOARD = Path(__file__).with_name("dashboard.html")  # self-contained: it only fetches /metrics


def _version() -> str:
    try:
        return importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def error_response(e: APIError, request_id: str | None = None, anthropic: bool = False) -> JSONResponse:
    """OpenAI's error body, or (anthropic: the Messages API's routes) the same inside Anthropic's envelope."""
    headers = dict(e.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(M.error_body(e) if anthropic else e.body(), status_code=e.status, headers=headers)


# One engine request per choice --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Choice:
    index: int  # OpenAI choice index: prompt_index * n + j
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is more urgent
    timeout: float | None = None  # seconds from `arrival`
    arrival: float | None = None  # time.monotonic() when the HTTP request came in
    cache_salt: str | None = None  # requests with different salts share no cached page


@dataclasses.dataclass
class ChoiceResult:
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, formatted
    token_ids: list[int] = dataclasses.field(default_factory=list)  # what the client sees (return_token_ids)
    error: str | None = None


async def run_choices(runner: "Runner", choices: list[Choice], rid: str
                      ) -> AsyncIterator[tuple[int, TokenEvent | Exception]]:
    """Merge the event streams of every choice: yields (choice index, event or exception).

    Each choice runs in its own task; closing this iterator early (client gone) cancels
    them, and each task's engine iterator aborts its request on the way out.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
        try:
            async for ev in runner.generate(c.prompt_ids, c.params, request_id=f"{rid}-{c.index}",
                                            priority=c.priority, timeout=c.timeout, arrival=c.arrival,
                                            cache_salt=c.cache_salt):
                queue.put_nowait((c.index, ev))
        except Exception as e:  # an invalid request or an engine error ends this choice only
            queue.put_nowait((c.index, e))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    live = len(tasks)
    try:
        while live:
            index, item = await queue.get()
            if isinstance(item, Exception) or item.finished:
                live -= 1
            yield index, item
    finally:
        for t in tasks:
            t.cancel()


def _error_of(item: TokenEvent | Exception) -> APIError | None:
    if isinstance(item, InvalidRequest):
        return P.bad(str(item))
    if isinstance(item, Exception):
        return APIError(500, f"{type(item).__name__}: {item}")
    if item.error and item.finish_reason == "abort":  # the server ended it: shutting down
        return APIError(503, item.error, code="server_shutting_down")
    if item.error or item.finish_reason == "error":
        return APIError(500, item.error or "the engine failed this request")
    return None


# Preparing a request -------------------------------------------------------------------

class HeaderLimit:
    """ASGI middleware: 431 for a request whose headers add up to more than `limit` bytes
    (uvicorn's HTTP parser takes megabytes of them)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope["headers"])
            if size > self.limit:
                err = APIError(431, f"the request headers have {size} bytes; the limit is {self.limit}",
                               code="request_header_fields_too_large")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes",
                               code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # nobody will read the answer; no traceback in the log for it
        raise APIError(400, "the client disconnected before sending the whole body",
                       code="client_disconnected") from None
    return b"".join(chunks)


def plan_choices(served: ServedModel, req: P.GenerationRequest, max_tokens_limit: int | None = None,
                 arrival: float | None = None, cache_salt: str | None = None) -> tuple[list[Choice], list[int]]:
    """Tokenize the prompts, resolve max_tokens, check each prompt fits: (choices, prompt lengths)."""
    if max_tokens_limit is not None and req.max_tokens is not None and req.max_tokens > max_tokens_limit:
        raise P.bad(f"max_tokens is {req.max_tokens}; this server allows at most {max_tokens_limit}",
                    param="max_tokens", code="invalid_value")
    limits, tok = served.limits, served.tokenizer
    if req.chat:
        prompts = [P.render_chat(tok, req.messages, req.chat_template)]
    else:
        prompts = [tok.encode(p) if isinstance(p, str) else p for p in req.prompts]
    param = "messages" if req.chat else "prompt"
    limit = limits.max_request_tokens
    prompts = [req.truncated(ids, limit) for ids in prompts]
    choices = []
    for pi, ids in enumerate(prompts):
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = limit - len(ids)
            if max_tokens_limit is not None:
                max_tokens = min(max_tokens, max_tokens_limit)
            if max_tokens < 1:
                raise P.bad(f"this model's maximum context length is {limit} tokens and the prompt has "
                            f"{len(ids)} tokens, which leaves no room to generate", param=param,
                            code="context_length_exceeded")
        if max_tokens >= limit:  # no prompt at all would leave room for it
            raise P.bad(f"max_tokens is {max_tokens}; this model's maximum context length is {limit} tokens, "
                        "prompt included", param="max_tokens", code="context_length_exceeded")
        try:
            limits.check_request(ids, max(max_tokens, 1))  # max_tokens 0 still samples (and drops) one
            params = [req.sampling_params(max_tokens, j) for j in range(req.n)]
        except InvalidRequest as e:
            if str(e).startswith("min_tokens"):  # past what the context leaves (max_tokens not sent)
                raise P.bad(str(e), param="min_tokens", code="invalid_value") from None
            code = "context_length_exceeded" if "context length" in str(e) or "KV cache" in str(e) else None
            raise P.bad(str(e), param=param, code=code) from None
        try:
            limits.check_logit_bias(params[0])
        except InvalidRequest as e:
            raise P.bad(str(e), param="logit_bias", code="invalid_value") from None
        choices.extend(Choice(pi * req.n + j, pi, ids, params[j], req.priority, req.timeout, arrival, cache_salt)
                       for j in range(req.n))
    return choices, [len(ids) for ids in prompts]


# Responses -----------------------------------------------------------------------------

class Responder:
    """Writes one request's response, chat or completion, streamed or whole."""

    def __init__(self, served: ServedModel, req: P.GenerationRequest, rid: str, prompt_lens: list[int],
                 admission: Admission | None = None, ticket: Ticket | None = None, span: RequestSpan | None = None,
                 open_set: set | None = None, log_text: bool = False):
        self.served, self.req, self.rid = served, req, rid
        self.admission, self.ticket = admission, ticket
        self.open_set = open_set if open_set is not None else set()  # the requests being answered
        self.open_set.add(self)
        self.texts: dict[int, str] | None = {} if log_text else None  # each choice's text, to log it
        self.span = span or RequestSpan(None, "", None, {})
        self.generated = 0  # tokens generated so far, all choices (for the key's token quota)
        self.finish_reasons: dict[int, str] = {}
        self.cached: dict[int, int] = {}  # choice index -> its prompt tokens found in the prefix cache
        self.num_choices = len(prompt_lens) * req.n
        # Engine ids are unique even when clients reuse an X-Request-Id (retries do).
        self.engine_rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.error: str | None = None
        self.started = time.monotonic()
        self.prompt_tokens = sum(prompt_lens)
        tok = served.tokenizer
        self.fmt = P.LogprobFormatter((lambda i: f"token_id:{i}") if req.tokens_as_ids else
                                      (lambda i: tok.decode([i], skip_special_tokens=False)))
        # echo: a completion's prompt text, as sent (token ids: decoded), before its choices' text (and
        # with logprobs its tokens' records); a chat's last message's text where that is the assistant's,
        # as vLLM's echo (the reply a client began and asked to continue, whole again)
        self.echo: list[str] | None = None
        if req.echoes_prompt:
            self.echo = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in req.prompts]
        elif req.echo:
            last = req.messages[-1]
            self.echo = [last["content"] if last["role"] == "assistant" else ""]
        self.scoring_only = req.max_tokens == 0  # echo and score the prompt; drop the one token sampled
        self.completion_tokens = 0  # streamed so far, all choices (continuous usage)
        self.unsent_prompt_ids: dict[int, list[int]] = {}  # return_token_ids: each completion choice's, once
        self.created = int(time.time())

    async def _events(self, choices: list[Choice]) -> AsyncIterator[tuple[int, TokenEvent | Exception]]:
        """run_choices, telling admission and the span when the first token arrives."""
        async for index, item in run_choices(self.served.runner, choices, self.engine_rid):
            if isinstance(item, TokenEvent):
                if self.texts is not None:
                    self.texts[index] = self.texts.get(index, "") + item.text
                if item.token_ids and not self.generated:
                    self.span.event("first_token")
                    if self.ticket is not None:
                        self.admission.started(self.ticket)
                self.generated += len(item.token_ids)
                if item.finished:
                    self.finish_reasons[index] = item.finish_reason
                    self.cached[index] = item.cached_tokens
                    self._trace_engine_events(index, item)
                if item.error:
                    self.error = item.error
            else:
                self.error = f"{type(item).__name__}: {item}"
            yield index, item

    def _trace_engine_events(self, index: int, ev: TokenEvent) -> None:
        """What happened inside the engine, stamped with the engine's own times."""
        if ev.scheduled_at is not None:
            self.span.event("scheduled", at=ev.scheduled_at, choice=index)
        for t in ev.preempted_at:
            self.span.event("preempted", at=t, choice=index)

    def release(self) -> None:
        """The request is over (answered, failed or abandoned): give back its admission share,
        log it, end its span."""
        if self.ticket is not None:
            self.admission.release(self.ticket, self.generated)  # idempotent
        if self not in self.open_set:
            return
        self.open_set.discard(self)
        reasons = [self.finish_reasons.get(i, "abort") for i in range(self.num_choices)]
        log.info("finished: %s, %d prompt + %d generated tokens in %.3f s", ",".join(sorted(set(reasons))),
                 self.prompt_tokens, self.generated, time.monotonic() - self.started)
        if self.texts is not None:
            log.info("completion text (--log-requests): %s", json.dumps(self.texts, ensure_ascii=False))
        self.span.set({"gen_ai.usage.input_tokens": self.prompt_tokens, "gen_ai.usage.output_tokens": self.generated,
                       "gen_ai.response.finish_reasons": reasons})
        self.span.event("finished")
        self.span.end(self.error)

    def usage(self, completion_tokens: int) -> dict:
        """Usage of the whole request: a prompt's cached tokens are those its choices all found
        cached (its n choices share one prompt: the first computes what the rest reuse)."""
        n = self.req.n
        cached = sum(min(self.cached.get(p * n + j, 0) for j in range(n)) for p in range(self.num_choices // n))
        return P.usage(self.prompt_tokens, completion_tokens, cached)

    def _logprobs(self, records: list[dict], offset: int = 0) -> dict | None:
        if self.req.logprobs is None:
            return None
        return self.fmt.chat(records) if self.req.chat else self.fmt.completion(records, offset)

    @staticmethod
    def _prompt_records(c: Choice, ev: TokenEvent) -> list[dict]:
        """An echoed prompt's logprob records: its first token has none (OpenAI's null), then the
        engine's for tokens 1.. (absent when the request ended before its prompt was scored)."""
        return [{"token_id": c.prompt_ids[0], "logprob": None, "top": None}, *(ev.prompt_logprobs or [])]

    def _output(self, ev: TokenEvent) -> tuple[list[int], str, list[dict]]:
        """An event's (token ids, text, logprob records) as the client sees them: none of them
        where the request only scores its prompt (max_tokens 0)."""
        if self.scoring_only:
            return [], "", []
        return ev.token_ids, ev.text, ev.logprobs or []

    def _chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        """A stream chunk; with continuous usage stats, every chunk says the usage so far."""
        build = P.chat_chunk if self.req.chat else P.completion_chunk
        if use is None and self.req.continuous_usage:
            use = self.usage(self.completion_tokens)
        return build(self.rid, self.served.name, self.created, choices, self.req.include_usage, use)

    def _piece(self, index: int, text: str, finish: str | None, logprobs: dict | None,
               token_ids: list[int] = ()) -> dict:
        if self.req.chat:
            piece = P.chat_delta(index, {"content": text} if text or finish is None else {}, finish, logprobs)
        else:
            piece = P.completion_choice(index, text, finish, logprobs)
        if self.req.return_token_ids:  # vLLM's: a completion choice's prompt ids in its first chunk
            if index in self.unsent_prompt_ids:
                piece["prompt_token_ids"] = self.unsent_prompt_ids.pop(index)
            piece["token_ids"] = list(token_ids)
        return piece

    async def stream(self, choices: list[Choice]) -> AsyncIterator[dict]:
        """The SSE events; a failure while writing them ends this stream alone, with an error event."""
        try:
            async for event in self._stream(choices):
                yield event
        except Exception as e:  # noqa: BLE001 - this request fails, the server keeps serving
            log.exception("request %s: the stream failed", self.rid)
            self.error = f"{type(e).__name__}: {e}"
            for event in self._failed(APIError(500, f"internal error: {self.error}")):
                yield event

    def _failed(self, e: APIError) -> list[dict]:
        """The events that end a stream that failed."""
        return [self._sse(e.body()), {"data": "[DONE]"}]

    async def _stream(self, choices: list[Choice]) -> AsyncIterator[dict]:
        offsets = {c.index: 0 for c in choices}
        if self.req.chat:
            for c in choices:
                chunk = self._chunk([P.chat_delta(c.index, {"role": "assistant", "content": ""})])
                if self.req.return_token_ids and c is choices[0]:  # vLLM's: the response's, in its first chunk
                    chunk["prompt_token_ids"] = c.prompt_ids
                yield self._sse(chunk)
        else:
            self.unsent_prompt_ids = {c.index: c.prompt_ids for c in choices}
        # echo: each choice's prompt comes with its first event, which carries the prompt's logprobs
        unechoed = {c.index: c for c in choices} if self.echo is not None else {}
        async for index, item in self._events(choices):
            err = _error_of(item)
            if err is not None:
                yield self._sse(err.body())
                if isinstance(item, TokenEvent) and item.finished:  # the choice's end, and why
                    yield self._sse(self._chunk([self._piece(index, "", item.finish_reason, None)]))
                continue
            ev: TokenEvent = item
            if index in unechoed:
                c = unechoed.pop(index)
                lps = self._logprobs(self._prompt_records(c, ev)) if self.req.echoes_prompt else None
                offsets[index] = sum(map(len, lps["tokens"])) if lps else len(self.echo[c.prompt_index])
                if self.echo[c.prompt_index] or not self.req.chat:
                    yield self._sse(self._chunk([self._piece(index, self.echo[c.prompt_index], None, lps)]))
            token_ids, text, records = self._output(ev)
            self.completion_tokens += len(token_ids)
            lps = self._logprobs(records, offsets[index]) if records else None
            offsets[index] += len(text)
            if text or lps or (token_ids and self.req.return_token_ids):
                yield self._sse(self._chunk([self._piece(index, text, None, lps, token_ids)]))
            if ev.finished:
                piece = self._piece(index, "", ev.finish_reason, None)
                piece["stop_reason"] = ev.stop_reason
                yield self._sse(self._chunk([piece]))
        if self.req.include_usage:
            yield self._sse(self._chunk([], self.usage(self.completion_tokens)))
        yield {"data": "[DONE]"}

    @staticmethod
    def _sse(obj: dict) -> dict:
        return {"data": json.dumps(obj, ensure_ascii=False)}

    async def _text(self, choices: list[Choice]
                    ) -> AsyncIterator[tuple[str, list[dict], TokenEvent | None, APIError | None]]:
        """The one choice's text as it comes, for APIs with one answer per request (Responses,
        Messages): (new text, its tokens' logprobs in chat's shape (when asked), the finishing
        event or None, the error that ended it or None)."""
        async for _, item in self._events(choices):
            err = _error_of(item)
            if err is not None:
                yield "", [], None, err
                return
            token_ids, delta, records = self._output(item)
            self.completion_tokens += len(token_ids)
            lps = self._logprobs(records) if records else None
            yield delta, lps["content"] if lps else [], item if item.finished else None, None

    async def whole(self, choices: list[Choice]) -> dict:
        req = self.req
        results = {c.index: ChoiceResult(text=self.echo[c.prompt_index] if self.echo else "") for c in choices}
        # a choice's first event carries its prompt's records: echoed, or vLLM's prompt_logprobs, or both
        unscored = {c.index: c for c in choices} if req.echoes_prompt or req.prompt_logprobs is not None else {}
        async for index, item in self._events(choices):
            err = _error_of(item)
            if err is not None:
                raise err
            r = results[index]
            if index in unscored:
                prompt = self._prompt_records(unscored.pop(index), item)
                if req.echoes_prompt:  # the engine kept max(logprobs, prompt_logprobs) alternatives
                    r.logprobs.extend({**x, "top": x["top"][:req.logprobs]} if x["top"] else x for x in prompt)
                if req.prompt_logprobs is not None:
                    r.prompt_logprobs = self.fmt.prompt(prompt, req.prompt_logprobs)
            token_ids, text, records = self._output(item)
            r.text += text
            r.completion_tokens += len(token_ids)
            r.token_ids.extend(token_ids)
            r.logprobs.extend(records)
            if item.finished:
                r.finish_reason, r.stop_reason = item.finish_reason, item.stop_reason
        if all(r.finish_reason == "timeout" and not r.completion_tokens for r in results.values()):
            raise APIError(504, f"the request timed out after {self.req.timeout} s before it produced a token",
                           param="timeout", code="timeout", type="timeout_error")
        use = self.usage(sum(r.completion_tokens for r in results.values()))
        if req.chat:
            out = [P.chat_choice(i, r.text, r.finish_reason, self._logprobs(r.logprobs)) for i, r in results.items()]
            response = P.chat_response(self.rid, self.served.name, out, use, results[0].prompt_logprobs)
        else:
            out = [P.completion_choice(i, r.text, r.finish_reason, self._logprobs(r.logprobs), r.prompt_logprobs)
                   for i, r in results.items()]
            response = P.completion_response(self.rid, self.served.name, out, use)
        for c, choice in zip(choices, out):
            choice["stop_reason"] = results[c.index].stop_reason
            if req.return_token_ids:  # vLLM's: chat's prompt ids are the response's, a completion's its choice's
                choice["token_ids"] = results[c.index].token_ids
                if not req.chat:
                    choice["prompt_token_ids"] = c.prompt_ids
        if req.return_token_ids and req.chat:
            response["prompt_token_ids"] = choices[0].prompt_ids
        return response


class ResponsesResponder(Responder):
    """Writes a /v1/responses answer: the chat path's events as a `response` object, or as the
    Responses API's typed stream events (responses.py)."""

    def __init__(self, rreq: R.ResponsesRequest, served: ServedModel, rid: str, prompt_lens: list[int], *args,
                 **kwargs):
        super().__init__(served, rreq.chat, rid, prompt_lens, *args, **kwargs)
        self.rreq = rreq
        self.response_id, self.item_id = R.new_ids()
        self.sequence = 0

    def _response(self, status: str, output: list[dict], incomplete: dict | None = None,
                  use: dict | None = None) -> dict:
        return R.response_object(self.rreq, self.response_id, self.served.name, self.created, output, status,
                                 incomplete, use)

    async def whole(self, choices: list[Choice]) -> dict:
        chat = await super().whole(choices)
        choice = chat["choices"][0]
        status, incomplete = R.status_of(choice["finish_reason"])
        item = R.output_message(self.item_id, choice["message"]["content"], status,
                                (choice["logprobs"] or {}).get("content"))
        return self._response(status, [item], incomplete, R.usage(chat["usage"]))

    def _event(self, kind: str, **fields) -> dict:
        """One typed event: `event: kind` and its JSON, numbered in order."""
        self.sequence += 1
        body = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return {"event": kind, "data": json.dumps(body, ensure_ascii=False)}

    def _failed(self, e: APIError) -> list[dict]:
        failed = {**self._response("failed", []), "error": {"code": e.code or "server_error", "message": e.message}}
        return [self._event("error", code=e.code, message=e.message, param=e.param),
                self._event("response.failed", response=failed)]

    async def _stream(self, choices: list[Choice]) -> AsyncIterator[dict]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        yield self._event("response.output_item.added", output_index=0,
                          item=R.output_message(self.item_id, None, "in_progress"))
        yield self._event("response.content_part.added", **where, part=R.output_text(""))
        text, logprobs, finish = "", [], None
        async for delta, lps, done, err in self._text(choices):
            if err is not None:
                for event in self._failed(err):
                    yield event
                return
            if delta or lps:
                text += delta
                logprobs += lps
                yield self._event("response.output_text.delta", **where, delta=delta, logprobs=lps)
            if done is not None:
                finish = done.finish_reason
        status, incomplete = R.status_of(finish)
        yield self._event("response.output_text.done", **where, text=text, logprobs=logprobs)
        yield self._event("response.content_part.done", **where, part=R.output_text(text, logprobs))
        done = R.output_message(self.item_id, text, status, logprobs)
        yield self._event("response.output_item.done", output_index=0, item=done)
        yield self._event(f"response.{status}", response=self._response(
            status, [done], incomplete, R.usage(self.usage(self.completion_tokens))))


class MessagesResponder(Responder):
    """Writes a /v1/messages answer: the chat path's events as an Anthropic `message`, or as
    its stream events (messages.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.message_id = M.new_id()

    async def whole(self, choices: list[Choice]) -> dict:
        chat = await super().whole(choices)
        choice = chat["choices"][0]
        return M.message(self.message_id, self.served.name, choice["message"]["content"],
                         M.stop_of(choice["finish_reason"], choice["stop_reason"]), M.usage(chat["usage"]))

    def _failed(self, e: APIError) -> list[dict]:
        return [M.event("error", error=M.error_body(e)["error"])]

    async def _stream(self, choices: list[Choice]) -> AsyncIterator[dict]:
        yield M.event("message_start", message=M.message(self.message_id, self.served.name, None, (None, None),
                                                         M.usage(P.usage(self.prompt_tokens, 0))))
        yield M.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield M.event("ping")
        stop = (None, None)
        async for delta, _, done, err in self._text(choices):
            if err is not None:
                for event in self._failed(err):
                    yield event
                return
            if delta:
                yield M.event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
            if done is not None:
                stop = M.stop_of(done.finish_reason, done.stop_reason)
        yield M.event("content_block_stop", index=0)
        yield M.event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                      usage=M.usage(self.usage(self.completion_tokens)))
        yield M.event("message_stop")


def _resolve_priority(req: P.GenerationRequest, header: str | None, cfg: ServerConfig) -> P.GenerationRequest:
    """The body's `priority`, else the `X-Priority` header, else 0: an integer or a class name."""
    value, param = (req.priority, "priority") if req.priority is not None else (header, "X-Priority")
    if value is None:
        return dataclasses.replace(req, priority=0)
    try:
        priority = cfg.admission.resolve_priority(value.strip() if isinstance(value, str) else value)
    except ConfigError as e:
        raise P.bad(str(e), param=param, code="invalid_value") from None
    if not -(2**31) <= priority < 2**31:
        raise P.bad(f"'{param}' must fit in 32 bits, got {priority}", param=param, code="invalid_value")
    return dataclasses.replace(req, priority=priority)


def _cache_salt(req: P.GenerationRequest, request: Request, cfg: ServerConfig) -> str | None:
    """The body's cache_salt, prefixed with a digest of the API key when salting per key."""
    if not cfg.cache_salt_per_key:
        return req.cache_salt
    key = hashlib.sha256(_api_key(request).encode()).hexdigest()[:32]
    return f"key:{key}" + (f"|{req.cache_salt}" if req.cache_salt is not None else "")


def _api_key(request: Request) -> str:
    """The key the request authenticated with ("" without one): the rate-limit key. A bearer
    token, else Anthropic's `x-api-key` header (what Anthropic's SDKs send)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


def _holds_key(request: Request, keys: list[bytes]) -> bool:
    """The request's bearer token is one of `keys`, compared with every key in constant time."""
    token = _api_key(request).encode()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(token, k)
    return ok and bool(token)


def _with_header_timeout(req: P.GenerationRequest, header: str | None) -> P.GenerationRequest:
    """`X-Request-Timeout: SECONDS` sets the deadline when the body does not."""
    if header is None or req.timeout is not None:
        return req
    try:
        seconds = float(header)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise APIError(400, f"X-Request-Timeout must be a finite number of seconds > 0, got {header[:40]!r}",
                       param="X-Request-Timeout", code="invalid_value")
    return dataclasses.replace(req, timeout=seconds)


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def profile_traffic(root: Path, seconds: float) -> Path:
    """jax.profiler.trace of whatever the engines do for `seconds`, into a new directory under
    `root` (XProf / TensorBoard read its .xplane.pb; Perfetto its perfetto_trace.json.gz)."""
    import jax

    path = (root / time.strftime("%Y%m%d-%H%M%S")).resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.profiler.start_trace(str(path), create_perfetto_trace=True)
    try:
        await asyncio.sleep(seconds)
    finally:
        await asyncio.to_thread(jax.profiler.stop_trace)
    return path


# The application ----------------------------------------------------------------------

def build_app(registry: ModelRegistry, cfg: ServerConfig, *, load_on_startup: bool = True,
              tracer=None) -> Starlette:
    """The Starlette app; `tracer` is an OpenTelemetry tracer (tracing.otlp_tracer) or None."""
    # With api_keys every route but the open ones needs a key (an admin key will do); without,
    # only /debug/profile does, and it checks its admin key itself.
    keys = [k.encode() for k in (*cfg.api_keys, *cfg.admin_api_keys)] if cfg.api_keys else []
    admin_keys = [k.encode() for k in cfg.admin_api_keys]
    profiling = asyncio.Lock()
    admission = Admission(cfg.admission)
    lifecycle = Lifecycle(registry, cfg.drain_timeout_s, cfg.watchdog_timeout_s, cfg.admission.retry_after_s)
    metrics = Metrics()
    registry.attach_metrics(metrics)
    metrics.state.rejections = lambda: dict(admission.rejections)

    def authorized(request: Request) -> bool:
        return not keys or request.url.path in OPEN_PATHS or _holds_key(request, keys)

    def api(handler, anthropic: bool = False):
        """Authentication, a request id, and APIError -> an OpenAI-shaped JSON error (in
        Anthropic's envelope on the Messages API's routes)."""

        async def wrapped(request: Request):
            rid = request_id_from(request.headers.get("x-request-id"))
            REQUEST_ID.set(rid)  # each request runs in its own task, so its own context
            if not authorized(request):
                return error_response(APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'"
                                                    " (or 'x-api-key: KEY')", code="invalid_api_key"), rid, anthropic)
            try:
                response = await handler(request, rid)
            except APIError as e:
                response = error_response(e, rid, anthropic)
            except Exception as e:  # noqa: BLE001 - one failing request answers 500, the server keeps serving
                log.exception("request %s failed", rid)
                response = error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"), rid, anthropic)
            response.headers["X-Request-Id"] = rid
            span = getattr(request.state, "span", None)
            traceparent = span.traceparent() if span is not None else request.headers.get("traceparent")
            if traceparent:
                response.headers["traceparent"] = traceparent
            return response

        return wrapped

    async def health(request: Request, rid: str):
        ok, status = registry.health()
        state = ("ok" if ok else "unavailable") if lifecycle.accepting else lifecycle.state
        body = {"status": state, "models": status}
        if not lifecycle.accepting:
            body["reason"] = lifecycle.reason
        return JSONResponse(body, status_code=200 if ok and lifecycle.accepting else 503)

    async def version(request: Request, rid: str):
        return JSONResponse({"version": _version()})

    def model_card(m: ServedModel) -> dict:
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "jaxserve",
                "max_model_len": m.limits.max_request_tokens if m.limits else None}

    async def models(request: Request, rid: str):
        return JSONResponse({"object": "list", "data": [model_card(m) for m in registry.models.values()]})

    async def model(request: Request, rid: str):
        """OpenAI's retrieve-model: the card of a served model (also while it loads), else 404."""
        return JSONResponse(model_card(registry.named(request.path_params["name"])))

    async def stats(request: Request, rid: str):
        return JSONResponse({"models": {name: m.stats() for name, m in registry.models.items()},
                             "admission": admission.stats()})

    async def generation(request: Request, rid: str, chat: bool, api_kind: str = "openai"):
        """A chat or completion request, or a Responses API ("responses") or Anthropic Messages
        API ("messages") one, run as a chat."""
        arrival = time.monotonic()  # deadlines and first-come order count from here
        if not lifecycle.accepting:
            raise lifecycle.refusal()
        P.check_content_type(request.headers.get("content-type"))
        body = P.parse_json(await read_body(request, cfg.max_body_bytes))
        responses, messages = api_kind == "responses", api_kind == "messages"
        rreq = R.parse_responses(body) if responses else None
        if responses:
            req = rreq.chat
        elif messages:
            req = M.parse_messages(body)
        else:
            req = P.parse_generation(body, chat=chat, max_n=cfg.max_n)
        req = _with_header_timeout(req, request.headers.get("x-request-timeout"))
        req = _resolve_priority(req, request.headers.get("x-priority"), cfg)
        if responses:
            rreq = dataclasses.replace(rreq, chat=req)
        operation, model = ("chat" if chat else "text_completion"), req.model or registry.names[0]
        span = RequestSpan(tracer, f"{operation} {model}", request.headers.get("traceparent"),
                           {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                            "jaxserve.request_id": rid, "jaxserve.priority": req.priority, "jaxserve.n": req.n,
                            "gen_ai.request.max_tokens": req.max_tokens or 0, "jaxserve.stream": req.stream})
        request.state.span = span
        try:
            served = registry.get(req.model)
            choices, prompt_lens = plan_choices(served, req, cfg.max_tokens_limit, arrival,
                                                _cache_salt(req, request, cfg))
            ticket = admission.admit(model=served.name, key=_api_key(request), priority=req.priority,
                                     seqs=len(choices), prompt_tokens=sum(len(c.prompt_ids) for c in choices),
                                     max_new_tokens=sum(c.params.max_tokens for c in choices),
                                     pool_tokens=served.limits.pool_tokens)
        except APIError as e:
            span.end(f"{e.status} {e.code}: {e.message}")
            raise R.in_own_names(e) if responses else M.in_own_names(e) if messages else e
        span.event("queued")
        log.info("%s %s: %d choice(s), %d prompt tokens, priority %d", request.method, request.url.path,
                 len(choices), sum(prompt_lens), req.priority)
        if cfg.log_requests:
            log.info("prompt (--log-requests): %s", json.dumps(req.messages if chat else req.prompts,
                                                                ensure_ascii=False))
        if responses:
            responder = ResponsesResponder(rreq, served, rid, prompt_lens, admission, ticket, span, lifecycle.open,
                                           cfg.log_requests)
        elif messages:
            responder = MessagesResponder(served, req, rid, prompt_lens, admission, ticket, span, lifecycle.open,
                                          cfg.log_requests)
        else:
            responder = Responder(served, req, rid, prompt_lens, admission, ticket, span, lifecycle.open,
                                  cfg.log_requests)
        if req.stream:  # the background task runs once the stream ends, the client gone or not
            return EventSourceResponse(responder.stream(choices), ping=15, background=BackgroundTask(responder.release))
        work = asyncio.ensure_future(responder.whole(choices))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            responder.release()
            gone.cancel()
            if not work.done():  # the client left: cancelling aborts its engine requests
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                log.info("request %s: client disconnected, aborted", rid)
        return JSONResponse(work.result())

    async def profile(request: Request, rid: str):
        """Capture an XLA profiler trace of live traffic for `seconds` (admin keys only)."""
        if not admin_keys:
            raise APIError(404, "profiling is off: set [server] admin_api_keys", code="not_found")
        if not _holds_key(request, admin_keys):
            raise APIError(403, "POST /debug/profile needs an admin API key", code="permission_denied",
                           type="permission_error")
        try:
            seconds = float(request.query_params.get("seconds", "5"))
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds <= 600:
            raise P.bad("'seconds' must be a number in (0, 600]", param="seconds", code="invalid_value")
        if profiling.locked():
            raise APIError(409, "a profile is already being captured", code="profile_in_progress", type="conflict")
        async with profiling:
            path = await profile_traffic(Path(cfg.profile_dir), seconds)
        log.info("profile of %.1f s written to %s", seconds, path)
        return JSONResponse({"path": str(path), "seconds": seconds,
                             "files": sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())})

    async def prometheus(request: Request, rid: str):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    dashboard_html = DASHBOARD.read_text()

    async def dashboard(request: Request, rid: str):
        return HTMLResponse(dashboard_html, headers={"Content-Security-Policy": "default-src 'self'; "
                                                     "script-src 'unsafe-inline'; style-src 'unsafe-inline'"})

    async def openapi_json(request: Request, rid: str):
        return JSONResponse(openapi_document(_version(), registry.names, cfg.max_n, cfg.max_tokens_limit,
                                             cfg.admission.priority_classes))

    async def tokenize(request: Request, rid: str):
        """vLLM's /tokenize: a prompt's or a conversation's token ids as generation would see them,
        and the context length they count against (clients check a prompt fits before sending)."""
        P.check_content_type(request.headers.get("content-type"))
        req = P.parse_tokenize(P.parse_json(await read_body(request, cfg.max_body_bytes)))
        served = registry.get(req.model)
        tok = served.tokenizer
        if req.messages is not None:
            ids = P.render_chat(tok, req.messages, req.chat_template)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [tok.decode([i], skip_special_tokens=False) for i in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": served.limits.max_request_tokens, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(request: Request, rid: str):
        """vLLM's /detokenize: token ids back to text, special tokens included."""
        P.check_content_type(request.headers.get("content-type"))
        model, ids = P.parse_detokenize(P.parse_json(await read_body(request, cfg.max_body_bytes)))
        served = registry.get(model)
        vocab = served.limits.vocab_size
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise P.bad(f"token id {outside[0]} is not in the vocabulary [0, {vocab})", param="tokens",
                        code="invalid_value")
        return JSONResponse({"prompt": served.tokenizer.decode(ids, skip_special_tokens=False)})

    async def chat_completions(request: Request, rid: str):
        return await generation(request, rid, chat=True)

    async def completions(request: Request, rid: str):
        return await generation(request, rid, chat=False)

    async def responses(request: Request, rid: str):
        return await generation(request, rid, chat=True, api_kind="responses")

    async def messages(request: Request, rid: str):
        return await generation(request, rid, chat=True, api_kind="messages")

    async def count_tokens(request: Request, rid: str):
        """Anthropic's count_tokens: the prompt tokens a Messages request with this body would have."""
        P.check_content_type(request.headers.get("content-type"))
        req = M.parse_messages(P.parse_json(await read_body(request, cfg.max_body_bytes)), counting=True)
        served = registry.get(req.model)
        return JSONResponse({"input_tokens": len(P.render_chat(served.tokenizer, req.messages, req.chat_template))})

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                       code=code))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if load_on_startup:
            registry.start_loading()
        lifecycle.start()
        if cfg.log_requests:
            log.warning("log_requests is on: prompts and completions are written to the log")
        try:
            yield
        finally:
            registry.shutdown()

    routes = [
        Route("/health", api(health), methods=["GET"]),
        Route("/version", api(version), methods=["GET"]),
        Route("/openapi.json", api(openapi_json), methods=["GET"]),
        Route("/stats", api(stats), methods=["GET"]),
        Route("/metrics", api(prometheus), methods=["GET"]),
        Route("/debug/profile", api(profile), methods=["POST"]),
        Route("/dashboard", api(dashboard), methods=["GET"]),
        Route("/v1/models", api(models), methods=["GET"]),
        Route("/v1/models/{name:path}", api(model), methods=["GET"]),
        Route("/v1/chat/completions", api(chat_completions), methods=["POST"]),
        Route("/v1/completions", api(completions), methods=["POST"]),
        Route("/v1/responses", api(responses), methods=["POST"]),
        Route("/v1/messages", api(messages, anthropic=True), methods=["POST"]),
        Route("/v1/messages/count_tokens", api(count_tokens, anthropic=True), methods=["POST"]),
        Route("/tokenize", api(tokenize), methods=["POST"]),
        Route("/detokenize", api(detokenize), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan,
                    middleware=[Middleware(HeaderLimit, limit=cfg.max_header_bytes)])
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    return app


def serve(cfg: ServerConfig, engine_config, *, log_level: str = "info", tracer=None) -> int:
    """Serve on cfg.host:cfg.port until a signal drains the server (returns 0) or the watchdog
    finds an engine that cannot serve (exits 1). The models load in the background (see
    /health). Logging is the caller's (tracing.configure_logging), so uvicorn's own is off."""
    import signal

    import uvicorn

    registry = ModelRegistry(cfg.models, engine_config)
    app = build_app(registry, cfg, tracer=tracer)
    lifecycle: Lifecycle = app.state.lifecycle

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # SIGINT / SIGTERM: drain, not stop
            lifecycle.signal(signal.Signals(sig).name)

    server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, log_config=None,
                                   timeout_graceful_shutdown=5))

    def request_exit() -> None:
        server.should_exit = True

    lifecycle.request_exit = request_exit
    server.run()
    if lifecycle.exit_code:
        logging.shutdown()
        os._exit(lifecycle.exit_code)  # an engine thread may be stuck in a device call
    return 0
