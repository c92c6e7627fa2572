"""OpenAI's Responses API (POST /v1/responses) over the chat path: request and response shapes.

A Responses request is a conversation (`input`: a string, or message items) with optional
`instructions` (a system message before it); this module turns it into the chat request the
server already validates and runs (`protocol.parse_generation`), and writes the answer as a
`response` object, or as the typed server-sent events OpenAI's SDK reads:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done, response.completed | .incomplete

What the Responses API has and this server does not (stored responses and
`previous_response_id`, tools, structured output, background runs, image or file input)
is a 400 naming the field, as for chat.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from jaxserve.serving import protocol as P

# Chat request fields a Responses body may carry as they are (vLLM accepts its sampling extras here too).
_PASSED_ON = ("model", "temperature", "top_p", "stream", "user", "top_k", "min_p", "seed", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
              "priority", "timeout", "cache_salt", "speculative", "skip_special_tokens", "logit_bias",
              "chat_template_kwargs")
_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the output's logprobs


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    """The chat request that runs it, and what the response object repeats back."""

    chat: P.GenerationRequest
    instructions: str | None
    metadata: dict
    max_output_tokens: int | None


def _unsupported(body: dict) -> None:
    refuse = {
        "previous_response_id": "this server stores no responses: send the whole conversation as 'input'",
        "conversation": "this server stores no conversations: send the whole conversation as 'input'",
        "prompt": "stored prompt templates are not supported",
        "background": "background responses are not supported",
        "tools": "tool calling is not supported by this server",
    }
    for name, why in refuse.items():
        if body.get(name) not in (None, False, [], {}, ""):
            raise P.bad(f"'{name}': {why}", param=name, code="unsupported_value")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not set(include) <= {LOGPROBS}):
        raise P.bad(f"'include' may only name {LOGPROBS!r} here (this server has no tools, files or reasoning "
                    "to include)", param="include", code="unsupported_value")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise P.bad("'tool_choice': tool calling is not supported by this server", param="tool_choice",
                    code="unsupported_value")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else "?"
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise P.bad("'text.format' other than {\"type\": \"text\"} (JSON or schema-guided output) is not "
                        "supported by this server", param="text.format", code="unsupported_value")
    if body.get("truncation") not in (None, "disabled"):
        raise P.bad("'truncation' other than \"disabled\" is not supported: a conversation past the context "
                    "length is a 400", param="truncation", code="unsupported_value")


def _content(content, where: str, role: str) -> str:
    """A message's text: a string, or a list of input_text (output_text for assistant turns) parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad(f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content",
                    code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise P.bad(f"'{where}.content[{j}]' must be a text part ({{\"type\": \"input_text\", \"text\": ...}}"
                        f"{', or output_text' if role == 'assistant' else ''}); this server serves text-only "
                        f"models", param=f"{where}.content", code="invalid_value")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict) -> list[dict]:
    value = body.get("input")
    if value is None:
        raise P.bad("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        items = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise P.bad("'input' must be a string or a non-empty list of messages", param="input", code="invalid_type")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise P.bad("'instructions' must be a string", param="instructions", code="invalid_type")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise P.bad(f"'{where}' must be a message {{\"role\", \"content\"}}; items of type {kind!r} are not "
                        "supported by this server", param=where, code="invalid_value")
        role = item.get("role")
        if role not in _ROLES:
            raise P.bad(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {json.dumps(role)}",
                        param=f"{where}.role", code="invalid_value")
        messages.append({"role": role, "content": _content(item.get("content"), where, role)})
    return messages


def parse_responses(body: dict) -> ResponsesRequest:
    _unsupported(body)
    max_output = body.get("max_output_tokens")
    chat_body = {name: body[name] for name in _PASSED_ON if name in body}
    chat_body["messages"] = _messages(body)
    if max_output is not None:
        chat_body["max_tokens"] = max_output
    if LOGPROBS in (body.get("include") or []) or body.get("top_logprobs") is not None:
        chat_body["logprobs"] = True  # each output token's, with top_logprobs alternatives (chat's shape)
        chat_body["top_logprobs"] = body.get("top_logprobs")
    try:
        chat = P.parse_generation(chat_body, chat=True, max_n=1)
    except P.APIError as e:
        raise in_own_names(e) from None
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise P.bad("'metadata' must be an object of strings", param="metadata", code="invalid_type")
    return ResponsesRequest(chat=chat, instructions=body.get("instructions"), metadata=metadata or {},
                            max_output_tokens=chat.max_tokens)


def in_own_names(e: P.APIError) -> P.APIError:
    """An error of the chat path in this API's names (max_tokens is also named unquoted)."""
    return P.renamed(e, {"max_tokens": "max_output_tokens", "messages": "input"}, bare=("max_tokens",))


# The response object and its events ------------------------------------------------------

def new_ids() -> tuple[str, str]:
    """(response id, output message id)."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def output_message(item_id: str, text: str | None, status: str, logprobs: list[dict] | None = None) -> dict:
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict:
    """logprobs: chat's `logprobs.content` entries (token, logprob, bytes, top_logprobs), the same here."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def usage(use: dict) -> dict:
    """A chat usage object in the Responses API's names."""
    return {"input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
            "total_tokens": use["total_tokens"],
            "input_tokens_details": {"cached_tokens": use["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished answer: cut by max_output_tokens (or the
    context's end) is `incomplete`, as OpenAI reports it; a request's own deadline too."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "timeout":
        return "incomplete", None
    return "completed", None


def response_object(req: ResponsesRequest, rid: str, model: str, created: int, output: list[dict], status: str,
                    incomplete: dict | None = None, use: dict | None = None) -> dict:
    sampling = req.chat.sampling
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata, "parallel_tool_calls": False,
        "previous_response_id": None, "store": False, "temperature": sampling["temperature"],
        "top_p": sampling["top_p"], "top_logprobs": req.chat.logprobs, "text": {"format": {"type": "text"}},
        "tool_choice": "none", "tools": [],
        "truncation": "disabled", "user": req.chat.user, "usage": use,
        **({"completed_at": int(time.time())} if status != "in_progress" else {}),
    }
