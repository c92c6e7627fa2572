"""Speculative decoding by prompt lookup (n-gram): propose, verify in one step, keep what agrees.

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

import numpy as np


def propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens (longest n first)."""
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
            return arr[start:start + k].tolist()
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
