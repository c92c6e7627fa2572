"""Request / Sequence: the host-side state of one request (plain Python, no jax)."""

from __future__ import annotations

import dataclasses
import enum
import math
import time


class InvalidRequest(ValueError):
    """A request the engine cannot serve as given (empty prompt, too long, bad parameter)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop. Mirrors the OpenAI / vLLM parameters.

    temperature 0 is greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. presence/frequency penalties (OpenAI) count generated tokens only;
    repetition_penalty (HF / CTRL) applies to every token seen, prompt included.
    seed None: the engine draws one, so the request is still reproducible in logs.
    logit_bias {token id: bias in [-100, 100]} (OpenAI) is added to the logits after the
    penalties: -100 bans a token in practice, +100 all but forces it. Kept as sorted
    (id, bias) pairs so the params stay hashable and frozen.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends the output before this many tokens
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the output stays in its text
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: plus the n most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (scoring)
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    speculative: bool = True  # may this request's tokens be proposed and verified (when the engine speculates)

    MAX_LOGPROBS = 20
    MAX_STOP_TOKEN_IDS = 16
    MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows; the sampler has this many slots per row

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias must map integer token ids to numbers") from None
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be finite and >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"),
            (len(self.stop_token_ids) <= self.MAX_STOP_TOKEN_IDS,
             f"stop_token_ids takes at most {self.MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (len(self.logit_bias) <= self.MAX_LOGIT_BIAS,
             f"logit_bias takes at most {self.MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"),
            (all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias maps token ids >= 0 to biases in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV pages wait in host memory
    FINISHED = "finished"


@dataclasses.dataclass
class TokenEvent:
    """What a request's consumer receives: new tokens and text, and the finish reason at the end."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "timeout"
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top": [(id, logprob), ...]}
    prompt_logprobs: list[dict] | None = None  # the same for prompt tokens 1.. (on the request's first event)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (OpenAI's usage.prompt_tokens_details)
    error: str | None = None
    stop_reason: int | str | None = None  # finished by a stop_token_ids id or a stop string: which (vLLM's)
    # On the finishing event only (for the request's trace): time.monotonic() of its first
    # step and of each preemption.
    scheduled_at: float | None = None
    preempted_at: tuple[float, ...] = ()


class Sequence:
    """One request as the scheduler and runner see it.

    tokens = prompt_ids + output_ids. `num_computed` counts the tokens whose K/V are in
    the cache; a sequence is prefilling while more than one token is uncomputed, and
    decoding once only the newest sampled token is. Preemption by recompute drops
    the pages and sets num_computed back to 0: the next prefill recomputes prompt and
    output alike, and generation continues where it stopped.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, arrival: float | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.arrival = time.monotonic() if arrival is None else arrival
        self.status = Status.WAITING
        self.pages: list[int] = []
        self.num_computed = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (not EOS)
        self.output_text = ""  # detokenized so far (after stop-string truncation)
        self.emitted_chars = 0  # how much of output_text has been sent in events
        self.detokenizer = None  # set by the engine
        self.seed = 0  # set by the engine: the request's seed, or one it drew
        self.deadline: float | None = None  # time.monotonic() past which the request is ended
        self.swap_pages = 0  # host pages held while swapped out
        self.swap_data = None  # the runner's host copy of those pages (opaque to the scheduler)
        self.swap_skip = 0  # of those, leading pages found in the prefix cache on resume (not copied back)
        # Prefix caching (engine/prefix_cache.py): requests with different salts share no page.
        self.cache_salt = cache_salt
        self.page_hashes: list[bytes] = []  # chain hash of each full page of tokens, as far as computed
        self.num_indexed_pages = 0  # leading pages of `pages` that are in the prefix index
        self.cached_tokens: int | None = None  # prompt tokens found cached at its first admission
        # Prompt logprobs: records for prompt tokens 1, 2, ... as the prefill scores them (kept
        # across a preemption, so a recomputed prompt is not scored twice); sent once, complete.
        self.prompt_logprobs: list[dict] | None = [] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        self.scored_pages = 0  # leading prompt pages whose records the prefix cache has (or gave)
        # min_tokens: the ids the sampler bans until it is reached (the request's stop ids and
        # EOS), and how much of output_text no stop string may end in (set on the way there)
        self.held_stop_ids: tuple[int, ...] = ()
        self.stop_floor = 0
        # Speculative decoding with a draft model (engine/draft.py): the draft's cache holds
        # positions < draft_computed, and the drafts fed after them if they became the tokens.
        self.draft_computed = 0
        self.draft_fed: list[int] = []
        # time.monotonic() of the first step it was in, its first and its latest token (metrics)
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.preempted_at: list[float] = []

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """tokens[i] without building the whole list (the decode launch asks once per row)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens to feed before the next token can be sampled (>= 1 while running)."""
        return self.num_tokens - self.num_computed

    @property
    def logits_needed_from(self) -> int | None:
        """The first position whose logits the request still needs for its prompt logprobs
        (position p scores prompt token p + 1), None when it needs none: its prefill may not
        take cached pages from there on, and the steps feeding it are scored."""
        if self.prompt_logprobs is None or len(self.prompt_logprobs) >= len(self.prompt_ids) - 1:
            return None
        return len(self.prompt_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (f"Sequence({self.request_id!r}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
                f"computed={self.num_computed}, pages={len(self.pages)}, {self.status.value})")
