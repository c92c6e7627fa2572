"""Speculative decoding: propose, verify in one step, keep what agrees.

Two proposers: prompt lookup (n-gram, below) and a draft model (engine/draft.py, with its
acceptance rule at the end of this module).

Decoding one token reads every weight; scoring k + 1 tokens of a sequence in one step costs
little more while a step is memory-bound (a small batch). So for each running sequence:

1. propose: the k tokens that followed the latest earlier occurrence of its last n tokens
   in its own prompt and output (`propose`); input-grounded text (editing code, quoting a
   document, a chat repeating itself) repeats itself often;
2. verify: one step feeds [last token, d1 .. dk] at positions start .. start + k and samples
   after every one of them, exactly as k + 1 plain decode steps would, each with the
   sequence's seed and its own token counter (runner.ModelRunner._verify_step);
3. accept: keep the samples up to and including the first that differs from its draft
   (`accepted_lengths`), so a step yields 1 to k + 1 tokens.

Why this is exact, for greedy and for sampling alike: the sample at position j depends only
on the logits after the prefix, the seed and the counter, and the prefix up to the first
disagreement is the sequence's real text. For a one-hot proposal q = [d], rejection sampling
(accept d with probability p(d), else draw from p without d, renormalised) gives every token
x the probability p(x); drawing x from p and accepting iff x == d is that same law, and it
draws the very token plain decoding would. The output is the same tokens as without
speculation, seed for seed.

The K/V written for rejected drafts sits past the sequence's length: attention never reads
past it and the next step overwrites it; the prefix cache indexes computed tokens only.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.engine.sampler import argmax


def propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens that followed the latest earlier match of the last n tokens (longest n first),
    or none when no n from n_max down to n_min matches.

    The latest match may end close to the end of the text: in a loop of period p < k (a list
    the model repeats, a line of a table) the text after it holds only p tokens. The proposal
    then goes on the way the match did, copying from itself (token L + j is proposed as token
    start + j, which for start + j >= L is an earlier proposed token), so a sequence that
    repeats itself is proposed k tokens, not p. On the grounded benchmark's greedy outputs
    (192 tokens of 16 prompts, K = 8) it cuts the verify calls from 411 to 343, the tokens
    each one yields rising from 5.3 to 6.3 (BENCHMARKS.md)."""
    L = len(tokens)
    if k < 1 or L < n_min + 1:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = arr[L - n:]
        # windows starting at 0 .. L - n - 1: every earlier occurrence, each followed by a token
        windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            # token L + j is token start + j, wrapping round the period L - start (see above)
            return arr[start + np.arange(k) % (L - start)].tolist()
    return []


def accepted_lengths(sampled: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Tokens each row keeps: its samples up to and including the first that is not its draft.

    sampled [n, k + 1]: the sample after each fed token; drafts [n, k] (row i's first
    num_drafts[i] are real). Returns valid [n] in 1 .. num_drafts + 1.
    """
    n, k = drafts.shape
    agree = sampled[:, :k] == drafts
    agree &= np.arange(k)[None, :] < num_drafts[:, None]
    # leading run of agreement: index of the first False, k when all agree
    first_miss = np.where(agree.all(axis=1), k, np.argmin(agree, axis=1))
    return (first_miss + 1).astype(np.int32)


# Draft-model proposals ----------------------------------------------------------------------
#
# A draft model proposes d_1 .. d_k, each drawn from its own distribution q_j (the same
# sampling parameters applied to the draft's logits, noise from DRAFT_STREAM). The verify
# step then computes the target's distribution p_j at every position and, for j = 0, 1, ...:
# accepts d_{j+1} with probability min(1, p_j(d) / q_j(d)) (a uniform from ACCEPT_STREAM);
# at the first rejection draws from max(0, p_j - q_j), normalised, and stops; when all are
# accepted the next position's token is drawn from p as plain decoding would (the bonus).
# Leviathan et al. (2023) show each emitted token then has exactly the law p_j: the draft
# changes only how many tokens a step yields. Greedy rows have one-hot p and q, so a draft
# is kept iff it is the target's argmax and a rejection yields that argmax: the output is
# token-identical to plain greedy decoding.

DRAFT_STREAM = 1  # noise the draft model draws its proposals with
ACCEPT_STREAM = 2  # uniforms of the acceptance test


def accept_drafts(p, q, drafts, num_drafts, uniform, gumbel, plain):
    """Rejection sampling of draft-model proposals, on the device.

    p [B, T, V]: the target's distribution after the token fed at position j (T = k + 1);
    q [B, k, V]: the draft's distribution that d_{j+1} = drafts[:, j] was drawn from;
    num_drafts [B] (row b's first num_drafts[b] drafts are real); uniform [B, k];
    gumbel [B, T, V]: the noise that draws position j's token; plain [B, T]: the token drawn
    from p_j with that noise. Returns tokens [B, T] for `accepted_lengths`: at j < num_drafts
    the draft if accepted, else a draw from the residual (never the draft: the residual is 0
    there); at j >= num_drafts the plain draw (the bonus).
    """
    k = q.shape[1]
    p_k = p[:, :k]
    pd = jnp.take_along_axis(p_k, drafts[..., None], axis=-1)[..., 0]  # [B, k]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    accept = uniform * qd < pd  # min(1, p/q) without dividing; q(d) = 0 cannot be drawn
    residual = jnp.maximum(p_k - q, 0.0)
    # p == q (to the last bit) leaves nothing: then a rejection cannot happen, but keep p
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_k)
    scores = jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)) + gumbel[:, :k], -jnp.inf)
    judged = jnp.where(accept, drafts, argmax(scores))  # [B, k]
    j = jnp.arange(k)[None, :]
    out = jnp.where(j < num_drafts[:, None], judged, plain[:, :k])
    return jnp.concatenate([out, plain[:, k:]], axis=1).astype(jnp.int32)
