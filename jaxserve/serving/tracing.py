"""One id to follow a request: X-Request-Id, W3C trace context, log lines and OpenTelemetry spans.

    request id   the client's `X-Request-Id` when it is a sane token, else a new one; it is
                 the completion's `id` suffix, the `X-Request-Id` response header, and the
                 `request_id` of every log line written while the request is handled (a
                 contextvar, so concurrent requests never mix).
    trace        with OpenTelemetry (`opentelemetry-sdk` installed and a tracer given), one
                 span per request, parented by the client's `traceparent`, with events
                 `queued`, `scheduled`, `first_token`, `preempted` (each time), `finished`
                 and `gen_ai.*` attributes; the response
                 carries the span's own `traceparent`. Without it, an incoming `traceparent`
                 is echoed back unchanged so callers can still join their logs.

`--log-format json` writes one JSON object per log line with the request id as a field.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxserve_request_id", default=None)
_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_from(header: str | None) -> str:
    """The client's id if it is 1-128 characters of [A-Za-z0-9._:-], else a new one."""
    if header is not None and _SANE_ID.fullmatch(header.strip()):
        return header.strip()
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Puts the current request's id (or "-") on every record as `request_id`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage(),
               "request_id": getattr(record, "request_id", "-")}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Root logging for `jaxserve serve`: text or JSON lines, each with the request id."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # one format for every line
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def otlp_tracer(endpoint: str):
    """A tracer exporting spans over OTLP/HTTP to `endpoint` (e.g. http://collector:4318/v1/traces)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError("--otlp-traces-endpoint needs opentelemetry-sdk and "
                           "opentelemetry-exporter-otlp-proto-http (pip install 'jaxserve[otel]')") from e
    provider = TracerProvider(resource=Resource.create({"service.name": "jaxserve"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _PROVIDERS.append(provider)
    return provider.get_tracer("jaxserve")


_PROVIDERS: list = []  # every provider otlp_tracer made: flushed before the process exits


def flush_spans(timeout_s: float = 5.0) -> None:
    """Export the spans still batched (the batch processor sends every few seconds)."""
    for provider in _PROVIDERS:
        try:
            provider.force_flush(int(timeout_s * 1000))
        except Exception:  # noqa: BLE001 - exiting either way
            logging.getLogger(__name__).exception("flushing spans failed")


class RequestSpan:
    """The span of one request, or nothing at all when tracing is off; safe to end twice."""

    def __init__(self, tracer, name: str, traceparent: str | None, attributes: dict):
        self.span = None
        self.incoming = traceparent
        if tracer is None:
            return
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent} if traceparent else {})
        self.span = tracer.start_span(name, context=parent, attributes=attributes)

    def event(self, name: str, at: float | None = None, **attributes) -> None:
        """Add an event now, or at `at` (a time.monotonic() reading from the engine)."""
        if self.span is not None:
            stamp = None if at is None else time.time_ns() - int((time.monotonic() - at) * 1e9)
            self.span.add_event(name, attributes, timestamp=stamp)

    def set(self, attributes: dict) -> None:
        if self.span is not None:
            self.span.set_attributes(attributes)

    def end(self, error: str | None = None) -> None:
        if self.span is None or not self.span.is_recording():
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()

    def traceparent(self) -> str | None:
        """What the response says: this span's context, else the client's own header."""
        if self.span is None:
            return self.incoming
        ctx = self.span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
