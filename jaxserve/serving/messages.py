"""Anthropic's Messages API (POST /v1/messages) over the chat path: request and response shapes.

Clients written for Anthropic's API (its SDKs, and tools that take an Anthropic base URL)
send `messages` with text blocks, a `system` prompt and a required `max_tokens`; this module
turns such a body into the chat request the server already validates and runs
(`protocol.parse_generation`) and writes the answer as a `message` object, or as the event
stream Anthropic's SDK reads:

    message_start, content_block_start, ping, content_block_delta ..., content_block_stop,
    message_delta (stop_reason, usage), message_stop

Errors keep OpenAI's `error` object (every route's clients read the same four fields) inside
Anthropic's envelope, `{"type": "error", "error": {...}}`, with Anthropic's error types.
Tools, extended thinking and image or document blocks are 400s naming the field.
"""

from __future__ import annotations

import json
import uuid

from jaxserve.serving import protocol as P

_PASSED_ON = ("model", "temperature", "top_p", "top_k", "stream", "priority", "timeout", "cache_salt", "seed")
# Anthropic's error type for each status (503 is its "overloaded", which it answers as 529)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error"}


def error_body(e: P.APIError) -> dict:
    """An APIError in Anthropic's envelope, OpenAI's fields kept inside it."""
    inner = e.body()["error"]
    return {"type": "error", "error": {**inner, "type": _ERROR_TYPES.get(e.status, "api_error")}}


def in_own_names(e: P.APIError) -> P.APIError:
    """An error of the chat path in this API's names."""
    return P.renamed(e, {"stop": "stop_sequences", "user": "metadata.user_id"})


def _unsupported(body: dict) -> None:
    for name in ("tools", "mcp_servers", "container"):
        if body.get(name):
            raise P.bad(f"'{name}' is not supported by this server", param=name, code="unsupported_value")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in ("auto", "none")):
        raise P.bad("'tool_choice': tool calling is not supported by this server", param="tool_choice",
                    code="unsupported_value")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise P.bad("'thinking' (extended thinking) is not supported by this server", param="thinking",
                    code="unsupported_value")


def _text(content, where: str) -> str:
    """A message's (or the system prompt's) text: a string, or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad(f"'{where}' must be a string or a list of content blocks", param=where, code="invalid_type")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise P.bad(f"'{where}[{j}]' must be a text block {{\"type\": \"text\", \"text\": ...}}; blocks of type "
                        f"{kind!r} are not supported by this server", param=where, code="invalid_value")
        texts.append(block["text"])
    return "".join(texts)


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise P.bad("'messages' must be a non-empty list of messages", param="messages",
                    code="missing_required_parameter" if msgs is None else "invalid_value")
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise P.bad(f"'{where}.role' must be user or assistant (the system prompt is the top-level 'system')",
                        param=f"{where}.role", code="invalid_value")
        out.append({"role": m["role"], "content": _text(m.get("content"), f"{where}.content")})
    return out


def parse_messages(body: dict, *, counting: bool = False) -> P.GenerationRequest:
    """A Messages body as the chat request that runs it; `counting` (count_tokens) needs no max_tokens."""
    _unsupported(body)
    chat_body = {name: body[name] for name in _PASSED_ON if name in body}
    chat_body["messages"] = _messages(body)
    if not counting:
        if body.get("max_tokens") is None:
            raise P.bad("'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
        chat_body["max_tokens"] = body["max_tokens"]
    P.typed_field(body, "temperature", float, lo=0, hi=1)  # Anthropic's range, narrower than OpenAI's
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):  # (chat's `stop` also takes one string; Anthropic's does not)
            raise P.bad("'stop_sequences' must be a list of strings", param="stop_sequences", code="invalid_type")
        chat_body["stop"] = stops
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise P.bad("'metadata' must be an object", param="metadata", code="invalid_type")
        chat_body["user"] = metadata.get("user_id")
    try:
        return P.parse_generation(chat_body, chat=True, max_n=1)
    except P.APIError as e:
        raise in_own_names(e) from None


# The message object and its events -------------------------------------------------------

def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_of(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms. A request's own `timeout` has no
    Anthropic name: it is answered as "timeout", jaxserve's finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop":
        return ("stop_sequence", stop_reason) if isinstance(stop_reason, str) else ("end_turn", None)
    return finish_reason, None


def usage(use: dict) -> dict:
    """A chat usage object in Anthropic's names: the prompt's uncached tokens and its cache
    reads are counted apart."""
    cached = use["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": use["prompt_tokens"] - cached, "output_tokens": use["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message(mid: str, model: str, text: str | None, stop: tuple[str | None, str | None], use: dict) -> dict:
    content = [] if text is None else [{"type": "text", "text": text}]
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}


def event(kind: str, **fields) -> dict:
    """One stream event: `event: kind` and its JSON."""
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}
