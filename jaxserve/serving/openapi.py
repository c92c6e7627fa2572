"""The OpenAPI 3.1 document served at /openapi.json: every route, its request and response schemas.

Written by hand beside protocol.py, which is what actually validates: the ranges here are
protocol.py's ranges, so a client generator (or a fuzzer, tests/test_reliability.py) sees the
same contract the server enforces. Every error, whatever its status, has OpenAI's shape.
"""

from __future__ import annotations

from jaxserve.engine.sequence import SamplingParams
from jaxserve.serving.protocol import CHAT_ROLES, MAX_ID_DIGITS, MAX_STOP_SEQUENCES

INT32_MAX = 2**31 - 1


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _num(lo=None, hi=None, *, lo_open: bool = False, integer: bool = False, doc: str = "") -> dict:
    out: dict = {"type": "integer" if integer else "number"}
    if lo is not None:
        out["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    if doc:
        out["description"] = doc
    return out


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_SAMPLING = {
    "model": {"type": "string", "description": "a served model's name; may be left out when the server serves one"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": "boolean"},
        "continuous_usage_stats": {"type": "boolean", "description": "vLLM's: with include_usage, every chunk "
                                   "carries the usage so far"}}},
    "max_tokens": _num(1, INT32_MAX, integer=True, doc="default: up to the context length (or the server's cap)"),
    "n": _num(1, integer=True, doc="choices per prompt; the server's max_n bounds it (400 past it)"),
    "temperature": _num(0, 2, doc="0 is greedy"),
    "top_p": _num(0, 1, lo_open=True),
    "top_k": _num(-1, INT32_MAX, integer=True, doc="<= 0: off"),
    "min_p": _num(0, 1),
    "presence_penalty": _num(-2, 2),
    "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(0, lo_open=True),
    "ignore_eos": {"type": "boolean"},
    "min_tokens": _num(0, INT32_MAX, integer=True, doc="no EOS, stop token id or stop string ends the output "
                       "before this many tokens; at most max_tokens"),
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1},
                        "maxItems": MAX_STOP_SEQUENCES}]},
    "include_stop_str_in_output": {"type": "boolean", "description": "keep the stop string that ended the text"},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": MAX_STOP_SEQUENCES},
    "logit_bias": {"type": "object", "maxProperties": SamplingParams.MAX_LOGIT_BIAS,
                   "propertyNames": {"pattern": f"^[0-9]{{1,{MAX_ID_DIGITS}}}$"},
                   "additionalProperties": _num(-100, 100),
                   "description": "token id (as a string) -> bias added to its logit"},
    "skip_special_tokens": {"type": "boolean"},
    "speculative": {"type": "boolean", "description": "false: never speculate for this request"},
    "response_format": {"type": "object", "properties": {"type": {"enum": ["text"]}}, "required": ["type"],
                        "description": "only text: JSON and schema-guided output are refused with 400"},
    "seed": _num(-(2**63), 2**64 - 1, integer=True),
    "user": {"type": "string"},
    "priority": {"anyOf": [_num(-(2**31), INT32_MAX, integer=True),
                           {"type": "string", "minLength": 1, "maxLength": 64}],
                 "description": "lower is more urgent; or a priority class name"},
    "timeout": _num(0, lo_open=True, doc="seconds from arrival; then the request ends with finish_reason timeout"),
    "cache_salt": {"type": "string", "minLength": 1, "description": "requests with different salts share no KV page"},
    "prompt_logprobs": _num(0, SamplingParams.MAX_LOGPROBS, integer=True, doc="vLLM's: each prompt token's "
                            "logprob and rank and this many alternatives, in the answer's prompt_logprobs; "
                            "not with stream"),
    "return_token_ids": {"type": "boolean", "description": "vLLM's: prompt_token_ids and each choice's "
                         "token_ids beside the text (streamed: the prompt's in the first chunk)"},
    "return_tokens_as_token_ids": {"type": "boolean", "description": "vLLM's: logprob tokens as 'token_id:N'"},
    "truncate_prompt_tokens": {"anyOf": [{"const": -1}, _num(1, INT32_MAX, integer=True)],
                               "description": "vLLM's: keep the prompt's last k tokens (-1: the context length)"},
}

_IDS = {"type": "array", "items": {"type": "integer"}}

# vLLM's prompt_logprobs: null for the first prompt token, then {token id: {logprob, rank, decoded_token}}
_PROMPT_LOGPROBS = {"type": "array", "items": _nullable({"type": "object", "additionalProperties": {
    "type": "object", "properties": {"logprob": {"type": "number"}, "rank": {"type": "integer", "minimum": 1},
                                     "decoded_token": {"type": "string"}},
    "required": ["logprob", "rank", "decoded_token"]}})}

_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "properties": {"type": {"enum": ["text"]},
                                                                        "text": {"type": "string"}},
                                        "required": ["type", "text"]}},
            {"type": "null", "description": "no text (an assistant message that called a tool)"}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string", "description": "required on tool messages"},
    },
    "required": ["role", "content"],
    "if": {"properties": {"role": {"const": "tool"}}}, "then": {"required": ["role", "content", "tool_call_id"]},
}

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

_CHAT_REQUEST = {
    "type": "object",
    "properties": {
        "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
        "max_completion_tokens": _SAMPLING["max_tokens"],
        "logprobs": {"type": "boolean"},
        "top_logprobs": _num(0, SamplingParams.MAX_LOGPROBS, integer=True, doc="needs logprobs: true"),
        "add_generation_prompt": {"type": "boolean", "description": "default true: the template's assistant "
                                  "header after the messages"},
        "continue_final_message": {"type": "boolean", "description": "go on with the last (assistant) message's "
                                   "text; needs add_generation_prompt: false"},
        "chat_template_kwargs": {"type": "object", "description": "extra variables for the chat template"},
        "documents": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "string"}},
                      "description": "vLLM's: documents for retrieval-augmented generation (such as title and "
                      "text), the chat template's `documents`; a template that reads none ignores them"},
        "echo": {"type": "boolean", "description": "vLLM's: the answer's content starts with the last message's "
                 "when that is an assistant message (with continue_final_message: the whole reply)"},
        **_SAMPLING,
    },
    "required": ["messages"],
}

_COMPLETION_REQUEST = {
    "type": "object",
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                             _TOKEN_IDS,
                             {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]},
        "logprobs": _num(0, SamplingParams.MAX_LOGPROBS, integer=True),
        "max_tokens": _num(0, INT32_MAX, integer=True, doc="0 only with echo or prompt_logprobs (score the "
                           "prompt); default: up to the context length (or the server's cap)"),
        "echo": {"type": "boolean", "description": "the text starts with the prompt's; with logprobs, so do the "
                 "logprobs (the first prompt token's are null)"},
        "suffix": {"type": "string", "maxLength": 0, "description": "fill in the middle is not supported: "
                   "a non-empty suffix is a 400"},
        "best_of": _num(1, INT32_MAX, integer=True, doc="only equal to n (every choice is returned)"),
    },
    "required": ["prompt"],
}

_TOKENIZE_REQUEST = {
    "description": "vLLM's /tokenize: either a prompt (text) or messages (rendered by the chat template)",
    "oneOf": [
        {"type": "object", "properties": {
            "model": _SAMPLING["model"], "prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"},
            "return_token_strs": {"type": "boolean"}}, "required": ["prompt"], "not": {"required": ["messages"]}},
        {"type": "object", "properties": {
            "model": _SAMPLING["model"], "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
            "add_generation_prompt": _CHAT_REQUEST["properties"]["add_generation_prompt"],
            "continue_final_message": _CHAT_REQUEST["properties"]["continue_final_message"],
            "chat_template_kwargs": _CHAT_REQUEST["properties"]["chat_template_kwargs"],
            "documents": _CHAT_REQUEST["properties"]["documents"],
            "add_special_tokens": {"const": False, "description": "the template writes the special tokens"},
            "return_token_strs": {"type": "boolean"}}, "required": ["messages"], "not": {"required": ["prompt"]}},
    ],
}

_TOKENIZE_RESPONSE = {
    "type": "object",
    "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                   "tokens": {"type": "array", "items": {"type": "integer"}},
                   "token_strs": _nullable({"type": "array", "items": {"type": "string"}})},
    "required": ["count", "max_model_len", "tokens", "token_strs"],
}

_DETOKENIZE_REQUEST = {
    "type": "object",
    "properties": {"model": _SAMPLING["model"],
                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0},
                              "description": "ids in the model's vocabulary (400 otherwise)"}},
    "required": ["tokens"],
}

_RESPONSES_MESSAGE = {
    "type": "object",
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "object", "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
            "required": ["type", "text"]}}]},
    },
    "required": ["role", "content"],
}

_RESPONSES_REQUEST = {
    "type": "object",
    "description": "OpenAI's Responses API, run as a chat; stored responses, tools, structured output, "
                   "background runs and non-text input are 400s",
    "properties": {
        **{k: _SAMPLING[k] for k in ("model", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                     "presence_penalty", "frequency_penalty", "repetition_penalty", "user",
                                     "priority", "timeout", "cache_salt")},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ref("ResponsesMessage"), "minItems": 1}]},
        "instructions": {"type": "string", "description": "a system message before the input"},
        "max_output_tokens": _SAMPLING["max_tokens"],
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "store": {"type": "boolean", "description": "accepted; nothing is stored (the response says store: false)"},
        "truncation": {"const": "disabled"},
        "include": {"type": "array", "items": {"const": "message.output_text.logprobs"}},
        "top_logprobs": _num(0, SamplingParams.MAX_LOGPROBS, integer=True, doc="alternatives per output token "
                             "(asks for the output's logprobs)"),
    },
    "required": ["input"],
}

_RESPONSES_RESPONSE = {
    "type": "object",
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]}, "model": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object", "properties": {
            "type": {"const": "message"}, "id": {"type": "string"}, "role": {"const": "assistant"},
            "status": {"enum": ["completed", "incomplete", "in_progress"]},
            "content": {"type": "array", "items": {"type": "object", "properties": {
                "type": {"const": "output_text"}, "text": {"type": "string"}}, "required": ["type", "text"]}}},
            "required": ["type", "id", "role", "status", "content"]}},
        "incomplete_details": _nullable({"type": "object", "properties": {"reason": {"type": "string"}}}),
        "usage": _nullable({"type": "object", "properties": {
            "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"}}, "required": ["input_tokens", "output_tokens", "total_tokens"]}),
    },
    "required": ["id", "object", "created_at", "status", "model", "output"],
}

_TEXT_BLOCKS = {"type": "array", "items": {"type": "object", "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"]}}

_MESSAGES_REQUEST = {
    "type": "object",
    "description": "Anthropic's Messages API, run as a chat; tools, extended thinking and image or document "
                   "blocks are 400s. Errors come in Anthropic's envelope {type: error, error: {...}}",
    "properties": {
        **{k: _SAMPLING[k] for k in ("model", "stream", "top_p", "top_k", "seed", "priority", "timeout",
                                     "cache_salt")},
        "max_tokens": _SAMPLING["max_tokens"],
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "role": {"enum": ["user", "assistant"]}, "content": {"anyOf": [{"type": "string"}, _TEXT_BLOCKS]}},
            "required": ["role", "content"]}},
        "system": {"anyOf": [{"type": "string"}, _TEXT_BLOCKS]},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1},
                           "maxItems": MAX_STOP_SEQUENCES},
        "temperature": _num(0, 1),
        "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
    },
    "required": ["max_tokens", "messages"],
}

_MESSAGE_RESPONSE = {
    "type": "object",
    "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": {"type": "string"}, "content": _TEXT_BLOCKS,
        "stop_reason": _nullable({"enum": ["end_turn", "max_tokens", "stop_sequence", "timeout"]}),
        "stop_sequence": _nullable({"type": "string"}),
        "usage": {"type": "object", "properties": {"input_tokens": {"type": "integer"},
                                                   "output_tokens": {"type": "integer"},
                                                   "cache_read_input_tokens": {"type": "integer"}},
                  "required": ["input_tokens", "output_tokens"]},
    },
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
}

_FINISH = _nullable({"enum": ["stop", "length", "abort", "timeout", "error"]})

_USAGE = {
    "type": "object",
    "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                   "total_tokens": {"type": "integer"},
                   "prompt_tokens_details": {"type": "object",
                                             "properties": {"cached_tokens": {"type": "integer"}}}},
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
}

def _response(obj: str, choice: dict, choice_required: list[str], **extra: dict) -> dict:
    """A whole chat or completion answer: OpenAI's envelope around choices of `choice`'s fields."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": _USAGE, **extra,
            "choices": {"type": "array", "items": {
                "type": "object",
                "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH,
                               "stop_reason": _nullable({"anyOf": [{"type": "integer"}, {"type": "string"}]}),
                               "logprobs": _nullable({"type": "object"}), **choice},
                "required": ["index", *choice_required, "finish_reason"]}},
        },
        "required": ["id", "object", "created", "model", "choices", "usage"],
    }


_CHAT_RESPONSE = _response("chat.completion", {"message": {
    "type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
    "required": ["role", "content"]}, "token_ids": _IDS}, ["message"], prompt_logprobs=_PROMPT_LOGPROBS,
    prompt_token_ids=_IDS)
_COMPLETION_RESPONSE = _response("text_completion", {"text": {"type": "string"}, "prompt_logprobs": _PROMPT_LOGPROBS,
                                                     "prompt_token_ids": _IDS, "token_ids": _IDS}, ["text"])

_ERROR = {
    "type": "object",
    "properties": {"error": {
        "type": "object",
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})},
        "required": ["message", "type", "param", "code"]}},
    "required": ["error"],
}

_MODEL = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "max_model_len": _nullable({"type": "integer"})},
    "required": ["id", "object", "created", "owned_by"],
}

_HEALTH = {
    "type": "object",
    "properties": {"status": {"enum": ["ok", "unavailable", "draining", "failed"]}, "models": {"type": "object"},
                   "reason": _nullable({"type": "string"})},
    "required": ["status", "models"],
}


def _errors(*statuses: int) -> dict:
    words = {400: "invalid request", 401: "no valid API key", 403: "not an admin key", 404: "not found",
             409: "conflict", 413: "body too large", 415: "not JSON", 429: "rate limit or quota (Retry-After)",
             431: "headers too large",
             503: "overloaded, loading, draining or failed (Retry-After)", 504: "deadline passed"}
    return {str(s): {"description": words[s], "content": {"application/json": {"schema": _ref("Error")}}}
            for s in statuses}


def _generation(summary: str, request: str, response: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the whole answer, or (stream: true) server-sent events of chunks, then [DONE]",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 413, 415, 431, 429, 503, 504)}}}


def _post(summary: str, request: str, response: dict) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "OK", "content": _json(response)}, **_errors(400, 401, 404, 413, 415,
                                                                                           431, 503)}}}


def _get(summary: str, content: dict, *errors: int) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": content},
                                                      **_errors(*errors)}}}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _served(models, max_n, max_tokens, priority_classes) -> dict:
    """The request fields whose bounds are this server's: its model names, max_n, its cap on
    max_tokens, its priority class names."""
    out = {}
    if models:
        out["model"] = {**_SAMPLING["model"], "enum": list(models)}
    if max_n:
        out["n"] = {**_SAMPLING["n"], "maximum": max_n}
    if max_tokens:
        out["max_tokens"] = out["max_completion_tokens"] = {**_SAMPLING["max_tokens"], "maximum": max_tokens}
    if priority_classes:
        out["priority"] = {**_SAMPLING["priority"],
                           "anyOf": [_SAMPLING["priority"]["anyOf"][0], {"enum": sorted(priority_classes)}]}
    return out


def openapi_document(version: str, models: list[str] | None = None, max_n: int | None = None,
                     max_tokens: int | None = None, priority_classes=None) -> dict:
    """The document, with this server's bounds (`_served`) where it gives them."""
    served = _served(models, max_n, max_tokens, priority_classes)
    requests = {}
    for name, schema in (("ChatCompletionRequest", _CHAT_REQUEST), ("CompletionRequest", _COMPLETION_REQUEST)):
        fields = {k: v for k, v in served.items() if k in schema["properties"]}
        requests[name] = {**schema, "properties": {**schema["properties"], **fields}}
    model = {"model": served["model"]} if "model" in served else {}
    limit = {"max_output_tokens": served["max_tokens"]} if "max_tokens" in served else {}
    requests["MessagesRequest"] = {**_MESSAGES_REQUEST, "properties": {
        **_MESSAGES_REQUEST["properties"], **{k: v for k, v in served.items() if k in ("model", "priority", "max_tokens")}}}
    requests["CountTokensRequest"] = {**requests["MessagesRequest"], "required": ["messages"]}
    requests["ResponsesRequest"] = {**_RESPONSES_REQUEST, "properties": {
        **_RESPONSES_REQUEST["properties"], **{k: v for k, v in served.items() if k in ("model", "priority")},
        **limit}}
    requests["TokenizeRequest"] = {**_TOKENIZE_REQUEST, "oneOf": [
        {**one, "properties": {**one["properties"], **model}} for one in _TOKENIZE_REQUEST["oneOf"]]}
    requests["DetokenizeRequest"] = {**_DETOKENIZE_REQUEST,
                                     "properties": {**_DETOKENIZE_REQUEST["properties"], **model}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": version,
                 "description": "OpenAI-compatible LLM inference server (JAX/XLA)"},
        "paths": {
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion"),
            "/v1/models": _get("The served models", _json({"type": "object", "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
                "required": ["object", "data"]}), 401),
            "/v1/models/{name}": {"get": {
                "summary": "One served model",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK", "content": _json(_ref("Model"))}, **_errors(401, 404)}}},
            "/v1/responses": _generation("OpenAI's Responses API (stream: true sends its typed events, "
                                         "ending with response.completed or response.incomplete)",
                                         "ResponsesRequest", "Response"),
            "/v1/messages": _generation("Anthropic's Messages API (stream: true sends its events, message_start "
                                        "... message_stop)", "MessagesRequest", "Message"),
            "/v1/messages/count_tokens": _post("The prompt tokens of a Messages request (Anthropic's)",
                                               "CountTokensRequest", {"type": "object", "properties": {
                                                   "input_tokens": {"type": "integer"}},
                                                   "required": ["input_tokens"]}),
            "/tokenize": _post("Token ids of a prompt or a conversation (vLLM's)", "TokenizeRequest",
                               _TOKENIZE_RESPONSE),
            "/detokenize": _post("Text of token ids (vLLM's)", "DetokenizeRequest",
                                 {"type": "object", "properties": {"prompt": {"type": "string"}},
                                  "required": ["prompt"]}),
            "/health": {"get": {"summary": "200 when every model serves; 503 while loading, draining or failed",
                                "responses": {"200": {"description": "OK", "content": _json(_ref("Health"))},
                                              "503": {"description": "not serving",
                                                      "content": _json(_ref("Health"))}}}},
            "/version": _get("The server's version", _json({"type": "object", "properties": {
                "version": {"type": "string"}}, "required": ["version"]})),
            "/stats": _get("Engine and admission state, per model", _json({"type": "object"}), 401),
            "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
            "/dashboard": _get("A live dashboard over /metrics", {"text/html": {"schema": {"type": "string"}}}),
            "/openapi.json": _get("This document", _json({"type": "object"})),
            "/debug/profile": {"post": {
                "summary": "Capture an XLA profile of live traffic (admin API keys only)",
                "parameters": [{"name": "seconds", "in": "query", "schema": _num(0, 600, lo_open=True)}],
                "responses": {"200": {"description": "where the trace went", "content": _json({"type": "object"})},
                              **_errors(400, 401, 403, 404, 409)}}},
        },
        "components": {"schemas": {
            **requests, "ChatMessage": _MESSAGE, "ChatCompletion": _CHAT_RESPONSE, "Completion": _COMPLETION_RESPONSE,
            "Model": _MODEL, "Health": _HEALTH, "Error": _ERROR, "ResponsesMessage": _RESPONSES_MESSAGE,
            "Response": _RESPONSES_RESPONSE, "Message": _MESSAGE_RESPONSE,
        }},
    }
