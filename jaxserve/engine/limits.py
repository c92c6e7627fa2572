"""What every request must fit, fixed when the engine starts.

The HTTP layer checks a request against these before it starts a stream, so a prompt
that can never be served is a 400, not an error event after a 200. They are plain
numbers, so the check runs anywhere: on the event loop thread beside the engine, or in
a cluster's ingress process far from the replica that will serve the request.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.sequence import InvalidRequest, SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # the context length the engine serves (capped by the model's own)
    pool_tokens: int  # tokens the whole KV cache holds

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request may hold: the context length or the whole pool."""
        return min(self.max_model_len, self.pool_tokens)

    def check_request(self, ids: list[int], max_tokens: int) -> None:
        """Raise InvalidRequest unless a prompt of `ids` with `max_tokens` can ever be served."""
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.vocab_size
        if any(not (0 <= t < vocab) for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        limit = self.max_model_len
        if len(ids) + max_tokens > limit:
            raise InvalidRequest(f"this model's maximum context length is {limit} tokens; the prompt has "
                                 f"{len(ids)} tokens and max_tokens is {max_tokens}")
        if len(ids) + max_tokens > self.pool_tokens:
            raise InvalidRequest(f"the KV cache holds {self.pool_tokens} tokens; the prompt has {len(ids)} tokens "
                                 f"and max_tokens is {max_tokens}")

    def check_logit_bias(self, params: SamplingParams) -> None:
        """Raise InvalidRequest unless every logit_bias token id is in the vocabulary."""
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token id {bad[0]} is not in the vocabulary [0, {self.vocab_size})")
