"""On-device sampling, one jitted function of arrays: no Python per request, no host sync.

Every sampling parameter is a per-row array, so one compiled step serves any mix of
greedy and sampled requests. Randomness is per request: row b draws its Gumbel noise
from fold_in(key(seed_b), n_b), where n_b is how many tokens the request has made,
and the noise is laid over the vocabulary in token order. A request's tokens so
depend only on its own logits, seed and position, never on its neighbours in the
batch or on the batch size.

Order of processing (as HF's logits processors): repetition penalty, presence and
frequency penalties, temperature, top-k, top-p, min-p. Logprobs are reported from
the model's raw distribution (log_softmax of the unprocessed logits), as vLLM does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NUM_TOP_LOGPROBS = 20
NEG_INF = -jnp.inf


@struct.dataclass
class SamplingArrays:
    """Per-row parameters; B rows."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, <= 0 = off
    top_p: jax.Array  # [B] f32, 1 = off
    min_p: jax.Array  # [B] f32, 0 = off
    presence_penalty: jax.Array  # [B] f32
    frequency_penalty: jax.Array  # [B] f32
    repetition_penalty: jax.Array  # [B] f32, 1 = off
    seeds: jax.Array  # [B] u32
    counters: jax.Array  # [B] i32, tokens generated so far by the request
    history: jax.Array  # [B, H] i32, prompt + output ids, -1 padded
    prompt_lens: jax.Array  # [B] i32, history[:, :prompt_len] is the prompt


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, raw logprob of the chosen token
    top_ids: jax.Array  # [B, NUM_TOP_LOGPROBS] i32
    top_logprobs: jax.Array  # [B, NUM_TOP_LOGPROBS] f32


def apply_penalties(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits [B, V] -> penalised logits [B, V]."""
    B, V = logits.shape
    H = s.history.shape[1]
    rows = jnp.arange(B)[:, None]
    valid = s.history >= 0
    ids = jnp.where(valid, s.history, V)  # V is out of range: dropped
    is_output = jnp.arange(H)[None, :] >= s.prompt_lens[:, None]
    counts = jnp.zeros((B, V), jnp.float32).at[rows, ids].add((valid & is_output).astype(jnp.float32), mode="drop")
    seen = jnp.zeros((B, V), jnp.bool_).at[rows, ids].set(True, mode="drop")
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - s.frequency_penalty[:, None] * counts - s.presence_penalty[:, None] * (counts > 0)


def _filter_threshold(scaled: jax.Array, s: SamplingArrays) -> jax.Array:
    """Smallest scaled logit each row keeps under top-k, then top-p, then min-p: [B]."""
    B, V = scaled.shape
    vals, _ = jax.lax.top_k(scaled, V)  # [B, V] descending
    rank = jnp.arange(V)[None, :]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)[:, None]
    vals = jnp.where(rank < k, vals, NEG_INF)
    probs = jax.nn.softmax(vals, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above this token
    vals = jnp.where(before < s.top_p[:, None], vals, NEG_INF)
    probs = jax.nn.softmax(vals, axis=-1)
    vals = jnp.where(probs >= s.min_p[:, None] * probs[:, :1], vals, NEG_INF)
    vals = vals.at[:, 0].set(jnp.maximum(vals[:, 0], scaled.max(axis=-1)))  # the best token always stays
    return jnp.min(jnp.where(jnp.isfinite(vals), vals, jnp.inf), axis=-1)


def sample(logits: jax.Array, s: SamplingArrays) -> SampleOutput:
    """logits [B, V] float32 -> next tokens and logprobs."""
    B, V = logits.shape
    raw = jax.nn.log_softmax(logits, axis=-1)
    logits = apply_penalties(logits, s)
    greedy = jnp.argmax(logits, axis=-1)

    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)
    scaled = logits / temp[:, None]
    needs_filter = (s.temperature > 0) & ((s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0))
    threshold = jax.lax.cond(needs_filter.any(), _filter_threshold,
                             lambda x, _: jnp.full((B,), NEG_INF, x.dtype), scaled, s)
    keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seeds, s.counters)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    candidates = jnp.where(scaled >= threshold[:, None], scaled + gumbel, NEG_INF)
    sampled = jnp.argmax(candidates, axis=-1)
    tokens = jnp.where(s.temperature > 0, sampled, greedy).astype(jnp.int32)

    top_lp, top_ids = jax.lax.top_k(raw, min(NUM_TOP_LOGPROBS, V))
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return SampleOutput(tokens=tokens, logprobs=chosen, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp)
