"""OpenAI request validation and response shapes, with no server or engine in sight.

A request body becomes a `GenerationRequest` (or an `APIError` naming the bad
parameter); the app turns it into engine requests and uses the builders at the
bottom to write responses and stream chunks in OpenAI's exact shapes:

    chat        chat.completion / chat.completion.chunk, delta {"role"} first, then {"content"}
    completion  text_completion (streamed chunks use the same object name)

Unknown fields are ignored, as OpenAI-compatible servers do; known fields of the
wrong type or out of range are 400s whose message names the field and the value.
Features this server does not have (JSON / schema output, tools) are 400s too when
asked for, rather than ignored: a client that asked for JSON must not get prose.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any

from jaxserve.engine.sequence import SamplingParams
from jaxserve.tokenizer import ChatTemplateError, Tokenizer

MAX_STOP_SEQUENCES = 16
MAX_ID_DIGITS = 12  # a token id in a logit_bias key: longer strings are not ids (and int() of
#                     thousands of digits is slow, then refused by Python's int limit)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
             431: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self.TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def renamed(e: APIError, names: dict[str, str], bare: tuple[str, ...] = ()) -> APIError:
    """An error of the chat path about a field another API (Responses, Messages) names
    otherwise, in that API's names: the param, and the name quoted in the message (anywhere
    in it for the names in `bare`)."""
    own = names.get(e.param)
    if own is not None:
        old, new = (e.param, own) if e.param in bare else (f"'{e.param}'", f"'{own}'")
        e.message, e.param = e.message.replace(old, new), own
    return e


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def check_content_type(value: str | None) -> None:
    """A body sent as anything but JSON is a client mistake worth naming (415); no header is fine."""
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got {value[:80]!r}",
                       code="unsupported_media_type")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object. UTF-8 only, and no lone surrogate (JSON's \\ud800 escape
    reads into a Python string that no tokenizer can encode)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # rare: check the strings themselves only then
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad("the request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff) in a string: "
                      "not valid Unicode text", code="invalid_json") from None
    return body


# Typed fields -------------------------------------------------------------------------

_JSON_TYPE = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _integral(x: Any) -> bool:
    """An integer in JSON's sense: 3, or 3.0 (JSON Schema's "integer" takes both); not a boolean."""
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())


def _ints(values: list) -> list[int]:
    return [int(x) for x in values]


def typed_field(body: dict, name: str, kind: type, default: Any = None, *, lo=None, hi=None,
                lo_open: bool = False) -> Any:
    """body[name] checked to be of `kind` (JSON null means absent) and inside [lo, hi] / (lo, hi]."""
    value = body.get(name)
    if value is None:
        return default
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise bad(f"'{name}' must be {_JSON_TYPE[kind]}, got {json.dumps(value)[:80]}", param=name,
                  code="invalid_type")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):  # Python's JSON reader takes NaN and Infinity
            raise bad(f"'{name}' must be a finite number, got {value}", param=name, code="invalid_value")
    if lo is not None and (value <= lo if lo_open else value < lo):
        side = f"> {lo}" if lo_open else f">= {lo}"
        raise bad(f"'{name}' must be {side}{'' if hi is None else f' and <= {hi}'}, got {value}", param=name,
                  code="invalid_value")
    if hi is not None and value > hi:
        raise bad(f"'{name}' must be <= {hi}{'' if lo is None else f' and >= {lo}'}, got {value}", param=name,
                  code="invalid_value")
    return value


def _priority(body: dict) -> int | str | None:
    """An integer, or the name of a priority class (checked against the server's classes later)."""
    value = body.get("priority")
    if isinstance(value, str) and 0 < len(value) <= 64:
        return value
    return typed_field(body, "priority", int, None, lo=-(2**31), hi=2**31 - 1)


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    """An optional list of token ids (vLLM's `stop_token_ids`); an id outside the vocabulary never matches."""
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_integral(t) and t >= 0 for t in value):
        raise bad(f"'{name}' must be a list of token ids (integers >= 0)", param=name, code="invalid_type")
    if len(value) > MAX_STOP_SEQUENCES:
        raise bad(f"'{name}' takes at most {MAX_STOP_SEQUENCES} ids, got {len(value)}", param=name,
                  code="invalid_value")
    return tuple(_ints(value))


def _logit_bias(body: dict) -> dict[int, float]:
    """{"token id as a string": bias in [-100, 100]} (OpenAI's shape) -> {id: bias}."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", param="logit_bias",
                  code="invalid_type")
    limit = SamplingParams.MAX_LOGIT_BIAS
    if len(value) > limit:
        raise bad(f"'logit_bias' takes at most {limit} tokens, got {len(value)}", param="logit_bias",
                  code="invalid_value")
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_ID_DIGITS):
            raise bad(f"invalid key in 'logit_bias': {key[:40]!r} is not a token id", param="logit_bias",
                      code="invalid_value")
        if bias is None:
            raise bad(f"'logit_bias' for token {key} must be a number, got null", param="logit_bias",
                      code="invalid_type")
        out[int(key)] = typed_field({"logit_bias": bias}, "logit_bias", float, lo=-100, hi=100)
    return out


def _unsupported_features(body: dict) -> None:
    """400 for what this server cannot do, when a client actually asks for it."""
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'response_format' other than {\"type\": \"text\"} (JSON or schema-guided output) is not "
                  "supported by this server", param="response_format", code="unsupported_value")
    for name in ("tools", "functions"):
        if body.get(name):  # null or an empty list asks for nothing
            raise bad(f"'{name}' (tool calling) is not supported by this server", param=name,
                      code="unsupported_value")
    for name in ("tool_choice", "function_call"):  # without tools only "none" / "auto" ask for nothing
        if body.get(name) not in (None, "none", "auto"):
            raise bad(f"'{name}' asks for a tool call: tool calling is not supported by this server", param=name,
                      code="unsupported_value")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad("'modalities' other than [\"text\"] (audio output) is not supported by this server",
                  param="modalities", code="unsupported_value")
    for name, what in _UNSUPPORTED_VLLM_FIELDS.items():
        if body.get(name) not in (None, [], {}, ""):
            raise bad(f"'{name}' ({what}) is not supported by this server", param=name, code="unsupported_value")


# vLLM's fields that constrain the output: a client that sends one relies on it, so it is
# refused rather than answered with unconstrained text.
_UNSUPPORTED_VLLM_FIELDS = {
    "guided_json": "JSON-schema-guided output", "guided_regex": "regex-guided output",
    "guided_choice": "output restricted to given choices", "guided_grammar": "grammar-guided output",
    "structural_tag": "structural-tag-guided output", "structured_outputs": "structured output",
    "bad_words": "banned words", "allowed_token_ids": "output restricted to given token ids",
    "logits_processors": "custom logits processors",
    "chat_template": "a chat template sent with the request (the model's own is used)",
    "audio": "audio output", "web_search_options": "web search",
}


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise bad(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}", param="stop",
                  code="invalid_value")
    if any(s == "" for s in stop):
        raise bad("'stop' sequences must not be empty strings", param="stop", code="invalid_value")
    return tuple(stop)


def _int_list(value, name: str) -> list[int]:
    if not value or not all(_integral(t) for t in value):
        raise bad(f"'{name}' token lists must be non-empty lists of integers", param=name, code="invalid_type")
    return _ints(value)


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list of messages", param="messages", code="invalid_type")
    if not msgs:
        raise bad("'messages' must not be empty", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content'", param=where, code="invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}",
                      param=f"{where}.role", code="invalid_value")
        if "content" not in m:
            raise bad(f"'{where}.content' is required (null for no text)", param=f"{where}.content",
                      code="missing_required_parameter")
        content = m["content"]
        if content is None:  # OpenAI's assistant messages that called a tool: no text
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                              "this server serves text-only models", param=f"{where}.content", code="invalid_value")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content",
                      code="invalid_type")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad(f"'{where}' is a tool message without 'tool_call_id': tool messages answer a tool call, "
                      "and this server makes none", param=f"{where}.tool_call_id", code="invalid_value")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _prompts(body: dict) -> list[str | list[int]]:
    """`prompt` as a string, a list of strings, a list of token ids, or a list of token id lists."""
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(_integral(x) for x in p):
            return [_ints(p)]
        if all(isinstance(x, list) for x in p):
            return [_int_list(x, "prompt") for x in p]
    raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of token id lists, "
              "and not empty", param="prompt", code="invalid_type")


# The parsed request --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChatTemplateOptions:
    """vLLM's chat request fields that shape the rendered prompt: a generation prompt after the
    messages (the default), or the last message continued as it stands (an assistant reply
    begun by the client); `kwargs` are handed to the template (e.g. a flag it reads)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """A validated chat or completion request; `max_tokens` None means "up to the context length"."""

    chat: bool
    model: str | None
    messages: list[dict] | None
    prompts: list[str | list[int]] | None
    stream: bool
    include_usage: bool
    n: int
    max_tokens: int | None  # 0: a completion that echoes and scores its prompt, generating nothing
    logprobs: int | None  # None: no logprobs; k: the chosen token's plus k alternatives
    sampling: dict  # SamplingParams keyword arguments other than max_tokens and seed
    seed: int | None
    user: str | None
    priority: int | str | None = None  # lower is more urgent (vLLM); a class name is resolved by the app
    timeout: float | None = None  # seconds from arrival; past it the request is ended
    cache_salt: str | None = None  # vLLM's field: requests with different salts share no cached KV page
    chat_template: ChatTemplateOptions | None = None  # chat: how the conversation becomes the prompt
    # completions: the answer's text (and with logprobs, its logprobs) starts with the prompt's; chat (vLLM's):
    # the answer's content starts with the last message's when that is an assistant message
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's field: each prompt token's logprob, rank and k alternatives
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage so far in every chunk
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last k tokens (-1: the context)

    @property
    def echoes_prompt(self) -> bool:
        """A completion's echo: its answer repeats the prompt (a chat's echo repeats a message)."""
        return self.echo and not self.chat

    @property
    def scores_prompt(self) -> int | None:
        """How many alternatives the engine keeps per prompt token (None: it scores no prompt):
        echo with logprobs and vLLM's prompt_logprobs read the same records."""
        wanted = [k for k in (self.logprobs if self.echoes_prompt else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def truncated(self, ids: list[int], context: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context length)."""
        if self.truncate_prompt_tokens is None:
            return ids
        return ids[-(context if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens):]

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """Choice i of n draws with seed + i, so n seeded choices differ yet each is reproducible.
        max_tokens 0 asks the engine for one token (the prefill samples it anyway), dropped."""
        seed = None if self.seed is None else (self.seed + choice) & 0xFFFFFFFF
        return SamplingParams(max_tokens=max(max_tokens, 1), seed=seed, logprobs=self.logprobs,
                              prompt_logprobs=self.scores_prompt, **self.sampling)


_TEMPLATE_OWN_NAMES = ("messages", "add_generation_prompt")


def _chat_template_options(body: dict) -> ChatTemplateOptions:
    add = typed_field(body, "add_generation_prompt", bool, True)
    cont = typed_field(body, "continue_final_message", bool, False)
    if add and cont:
        raise bad("'continue_final_message' continues the last message, so 'add_generation_prompt' must be "
                  "false with it", param="add_generation_prompt", code="invalid_value")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", param="chat_template_kwargs", code="invalid_type")
    clash = [k for k in _TEMPLATE_OWN_NAMES if k in kwargs]
    if clash:
        raise bad(f"'chat_template_kwargs' must not set {clash[0]!r}: it is the request's own field",
                  param="chat_template_kwargs", code="invalid_value")
    documents = _documents(body)
    if documents is not None:
        if "documents" in kwargs:
            raise bad("'documents' is set twice, as the request's field and in 'chat_template_kwargs'",
                      param="documents", code="invalid_value")
        kwargs = {**kwargs, "documents": documents}
    return ChatTemplateOptions(add, cont, kwargs)


def _documents(body: dict) -> list[dict] | None:
    """vLLM's `documents` for retrieval-augmented generation: a list of objects of strings
    (a title and a text, say) handed to the chat template as `documents`. A template that
    reads no documents (the default model's) renders the conversation as without them."""
    docs = body.get("documents")
    if docs is None:
        return None
    if not (isinstance(docs, list) and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                                           for d in docs)):
        raise bad("'documents' must be a list of objects whose values are strings (such as a title and a text)",
                  param="documents", code="invalid_type")
    return docs


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: k alternatives per prompt token (0: the token's own logprob and
    rank alone). Not streamed (as in vLLM): they would all come in the first chunk anyway."""
    k = typed_field(body, "prompt_logprobs", int, None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    if k is not None and stream:
        raise bad("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs",
                  code="invalid_value")
    return k


def _completion_only_features(body: dict, n: int, max_tokens: int | None, prompt_logprobs: int | None) -> bool:
    """`echo` (with `logprobs`: the prompt's tokens scored too, and max_tokens 0 for a prompt
    scored alone: how evaluation harnesses score text); `suffix` and `best_of` past n are
    400s: this server does not fill in the middle or rank candidates."""
    echo = typed_field(body, "echo", bool, False)
    if max_tokens == 0 and not echo and prompt_logprobs is None:
        raise bad("'max_tokens' 0 generates nothing: it is for scoring a prompt, with 'echo' true (and 'logprobs') "
                  "or with 'prompt_logprobs'", param="max_tokens", code="invalid_value")
    suffix = typed_field(body, "suffix", str, None)
    if suffix:
        raise bad("'suffix' (fill in the middle) is not supported by this server", param="suffix",
                  code="unsupported_value")
    best_of = typed_field(body, "best_of", int, None, lo=1, hi=2**31 - 1)
    if best_of is not None and best_of != n:
        raise bad(f"'best_of' other than n is not supported by this server (best_of {best_of}, n {n}): it "
                  "returns every choice it generates", param="best_of", code="unsupported_value")
    return echo


def parse_generation(body: dict, *, chat: bool, max_n: int) -> GenerationRequest:
    model = _model(body)
    messages = _messages(body) if chat else None
    prompts = None if chat else _prompts(body)
    stream = typed_field(body, "stream", bool, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", param="stream_options", code="invalid_type")
    include_usage = bool(typed_field(opts or {}, "include_usage", bool, False))
    continuous_usage = include_usage and bool(typed_field(opts or {}, "continuous_usage_stats", bool, False))
    # 0 only with a completion's echo: the prompt scored, nothing generated (checked below)
    max_tokens = typed_field(body, "max_tokens", int, lo=0 if not chat else 1, hi=2**31 - 1)
    if chat:
        max_tokens = typed_field(body, "max_completion_tokens", int, max_tokens, lo=1, hi=2**31 - 1)
    n = typed_field(body, "n", int, 1, lo=1, hi=max_n)
    top_max = SamplingParams.MAX_LOGPROBS
    if chat:
        want = typed_field(body, "logprobs", bool, False)
        top = typed_field(body, "top_logprobs", int, None, lo=0, hi=top_max)
        if top is not None and not want:
            raise bad("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs", code="invalid_value")
        logprobs = (top or 0) if want else None
    else:
        logprobs = typed_field(body, "logprobs", int, None, lo=0, hi=top_max)
    sampling = dict(
        temperature=typed_field(body, "temperature", float, 1.0, lo=0, hi=2),
        top_p=typed_field(body, "top_p", float, 1.0, lo=0, hi=1, lo_open=True),
        top_k=typed_field(body, "top_k", int, 0, lo=-1, hi=2**31 - 1),
        min_p=typed_field(body, "min_p", float, 0.0, lo=0, hi=1),
        presence_penalty=typed_field(body, "presence_penalty", float, 0.0, lo=-2, hi=2),
        frequency_penalty=typed_field(body, "frequency_penalty", float, 0.0, lo=-2, hi=2),
        repetition_penalty=typed_field(body, "repetition_penalty", float, 1.0, lo=0, lo_open=True),
        ignore_eos=typed_field(body, "ignore_eos", bool, False),
        min_tokens=typed_field(body, "min_tokens", int, 0, lo=0, hi=2**31 - 1),
        stop=_stop(body),
        include_stop_str_in_output=typed_field(body, "include_stop_str_in_output", bool, False),
        logit_bias=_logit_bias(body),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        skip_special_tokens=typed_field(body, "skip_special_tokens", bool, True),
        speculative=typed_field(body, "speculative", bool, True),
    )
    _unsupported_features(body)
    if max_tokens is not None and sampling["min_tokens"] > max(max_tokens, 1):
        raise bad(f"'min_tokens' ({sampling['min_tokens']}) must not exceed 'max_tokens' ({max_tokens})",
                  param="min_tokens", code="invalid_value")
    template = _chat_template_options(body) if chat else None
    prompt_logprobs = _prompt_logprobs(body, stream)
    echo = typed_field(body, "echo", bool, False) if chat else _completion_only_features(body, n, max_tokens,
                                                                                         prompt_logprobs)
    truncate = typed_field(body, "truncate_prompt_tokens", int, None, lo=-1, hi=2**31 - 1)
    if truncate == 0:
        raise bad("'truncate_prompt_tokens' must be >= 1 (the prompt's last k tokens) or -1 (the context length)",
                  param="truncate_prompt_tokens", code="invalid_value")
    if truncate is not None and echo and not chat:  # a chat's echo repeats a message, not the prompt
        raise bad("'echo' with 'truncate_prompt_tokens': the prompt echoed would not be the prompt used",
                  param="truncate_prompt_tokens", code="invalid_value")
    seed = typed_field(body, "seed", int, None, lo=-(2**63), hi=2**64 - 1)
    user = body.get("user") if isinstance(body.get("user"), str) else None
    return GenerationRequest(chat=chat, model=model, messages=messages, prompts=prompts, stream=stream,
                             include_usage=include_usage, n=n, max_tokens=max_tokens, logprobs=logprobs,
                             sampling=sampling, seed=seed, user=user,
                             priority=_priority(body),
                             timeout=typed_field(body, "timeout", float, None, lo=0, lo_open=True),
                             cache_salt=_cache_salt(body), chat_template=template, echo=echo,
                             prompt_logprobs=prompt_logprobs, continuous_usage=continuous_usage,
                             return_token_ids=typed_field(body, "return_token_ids", bool, False),
                             tokens_as_ids=typed_field(body, "return_tokens_as_token_ids", bool, False),
                             truncate_prompt_tokens=truncate)


def render_chat(tok: Tokenizer, messages: list[dict], template: ChatTemplateOptions | None) -> list[int]:
    """The conversation's prompt ids; a template that refuses the client's messages or its
    chat_template_kwargs is the client's 400 naming that field."""
    t = template or ChatTemplateOptions()
    try:
        return tok.encode_chat(messages, t.add_generation_prompt, continue_final_message=t.continue_final_message,
                               template_kwargs=t.kwargs)
    except ChatTemplateError as e:
        raise bad(str(e), param="messages", code="invalid_messages") from None
    except Exception as e:  # noqa: BLE001 - the client's own template variables broke the template
        if not t.kwargs:
            raise
        raise bad(f"the chat template failed with these chat_template_kwargs: {type(e).__name__}: {e}",
                  param="chat_template_kwargs", code="invalid_value") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizeRequest:
    """vLLM's /tokenize: a completion's `prompt` (text) or a chat's `messages` (rendered by
    the model's template as a chat request would be), and whether to return each token's text."""

    model: str | None
    prompt: str | None
    messages: list[dict] | None
    chat_template: ChatTemplateOptions | None
    add_special_tokens: bool
    return_token_strs: bool


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", param="model", code="invalid_type")
    return model


def parse_tokenize(body: dict) -> TokenizeRequest:
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise bad("/tokenize takes either 'prompt' (text) or 'messages', not both nor neither",
                  param="prompt", code="invalid_value")
    prompt = None if chat else body["prompt"]
    if prompt is not None and not isinstance(prompt, str):
        raise bad("'prompt' must be a string here (a list of token ids is already tokenized)", param="prompt",
                  code="invalid_type")
    if body.get("chat_template"):
        raise bad("'chat_template' (a chat template sent with the request) is not supported by this server: the "
                  "model's own is used", param="chat_template", code="unsupported_value")
    add_special = typed_field(body, "add_special_tokens", bool, not chat)
    if chat and add_special:
        raise bad("'add_special_tokens' with 'messages': the chat template writes the special tokens itself",
                  param="add_special_tokens", code="invalid_value")
    return TokenizeRequest(model=_model(body), prompt=prompt, messages=_messages(body) if chat else None,
                           chat_template=_chat_template_options(body) if chat else None,
                           add_special_tokens=add_special,
                           return_token_strs=typed_field(body, "return_token_strs", bool, False))


def parse_detokenize(body: dict) -> tuple[str | None, list[int]]:
    """vLLM's /detokenize: (model, token ids); the ids are checked against the vocabulary by the app."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_integral(t) for t in tokens):
        raise bad("'tokens' must be a list of token ids (integers)", param="tokens", code="invalid_type")
    return _model(body), _ints(tokens)


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad("'cache_salt' must be a non-empty string", param="cache_salt", code="invalid_value")
    return salt


# Responses -------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class LogprobFormatter:
    """Engine logprob records -> OpenAI's chat (`content` list) or completions (parallel lists) shape."""

    def __init__(self, token_text):
        self.token_text = token_text  # id -> the token's text

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, records: list[dict]) -> dict:
        content = []
        for r in records:
            e = self._entry(r["token_id"], r["logprob"])
            e["top_logprobs"] = [self._entry(t, lp) for t, lp in r["top"]]
            content.append(e)
        return {"content": content}

    def completion(self, records: list[dict], text_offset: int = 0) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for r in records:
            text = self.token_text(r["token_id"])
            tokens.append(text)
            lps.append(r["logprob"])
            tops.append({self.token_text(t): lp for t, lp in r["top"]} if r["top"] else None)
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt(self, records: list[dict], k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id (a
        string in JSON): {logprob, rank, decoded_token}} holding the prompt token itself and
        the k most likely there (one entry when it is among them)."""
        out: list[dict | None] = []
        for r in records:
            if r["logprob"] is None:
                out.append(None)
                continue
            entry = {str(r["token_id"]): self._ranked(r["token_id"], r["logprob"], r["rank"])}
            for i, (t, lp) in enumerate(r["top"][:k]):
                entry.setdefault(str(t), self._ranked(t, lp, i + 1))
            out.append(entry)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.token_text(token_id)}


def chat_response(rid: str, model: str, choices: list[dict], use: dict, prompt_logprobs: list | None = None) -> dict:
    """prompt_logprobs (vLLM's, when asked for) is the response's: every choice shares the prompt."""
    out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": choices, "usage": use}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def _chunk(id_: str, obj: str, model: str, created: int, choices: list[dict], include_usage: bool,
           use: dict | None) -> dict:
    """A streamed chunk; with include_usage every chunk has `usage` (null but on the last)."""
    out = {"id": id_, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        out["usage"] = use
    return out


def chat_chunk(rid: str, model: str, created: int, choices: list[dict], include_usage: bool,
               use: dict | None = None) -> dict:
    return _chunk(f"chatcmpl-{rid}", "chat.completion.chunk", model, created, choices, include_usage, use)


def chat_delta(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                      prompt_logprobs: list | None = None) -> dict:
    """prompt_logprobs (vLLM's, when asked for) is the choice's: a request may hold several prompts."""
    out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def completion_chunk(rid: str, model: str, created: int, choices: list[dict], include_usage: bool,
                     use: dict | None = None) -> dict:
    return _chunk(f"cmpl-{rid}", "text_completion", model, created, choices, include_usage, use)
