"""Automatic prefix caching: a prompt's full pages are found again instead of recomputed.

Each full page of a sequence is named by a hash chain,

    h[0] = H(root(extra key, cache_salt), tokens[0:ps])
    h[i] = H(h[i-1], tokens[i*ps:(i+1)*ps])

so a page's name covers every token before it and everything else that changes its
K/V: the model directory, its dtype and quantization (the extra key, one per engine)
and the request's `cache_salt` (tenants with different salts never share a page).
The pool's index maps these names to pages (engine/pages.py).

Entering pages: `commit` lists a sequence's full pages below `num_computed`, called
after a step has written them (postprocess) and before a sequence lets go of its pages
(finish, preemption). So the index only ever names pages whose K/V are written and
final: a page still being filled, or holding tokens a multi-step decode call may
discard, is never in it.

Finding pages: `match` walks a sequence's chain through the index and stops at the
first miss. It never covers the last token, so a full hit still computes one token and
samples the first output from it. `acquire` takes the pages (reference counts up,
cached ones back from the LRU list) and marks those tokens computed: the scheduler then
prefills only the rest, starting on a page boundary in a page of the sequence's own.

The scheduler also holds back a waiting sequence whose next page is being computed
right now by a running prompt (`pending`): a burst of requests with one system prompt,
or the n choices of one request, compute it once and share it a step later.

Prompt logprobs (a scored prompt, engine.py) need every position's logits, which a cached
page does not hold. So the records a scored prompt computed for a full page are kept
too (`keep_scores`), named by the page's chain and the token after it (its last
position's record scores that token), and a later scored prompt of the same tokens takes
them (`find_scores`) before it matches pages: contexts that many scored prompts share
(an evaluation's few-shot examples, a question with several answers) are computed once.

Hashes are 128-bit BLAKE2b, so a collision (a page of someone else's tokens) is as
unlikely as in a content-addressed store.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict

from jaxserve.engine.pages import PagePool
from jaxserve.engine.sequence import Sequence


def _h(parent: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(parent + payload, digest_size=16).digest()


def chain_hashes(tokens: list[int], page_size: int, parent: bytes, start: int = 0,
                 stop: int | None = None) -> list[bytes]:
    """The chain's names of full pages start..stop-1 of `tokens` (default: every full page),
    from `parent`: the name of page start-1, or a root when start is 0."""
    stop = len(tokens) // page_size if stop is None else stop
    out = []
    for i in range(start, stop):
        parent = _h(parent, array.array("i", tokens[i * page_size:(i + 1) * page_size]).tobytes())
        out.append(parent)
    return out


class PrefixCache:
    """The hash chains of sequences and their pages in the pool's index, and the prompt
    logprob records of scored pages (the least recently used dropped past MAX_SCORED_PAGES)."""

    MAX_SCORED_PAGES = 1024  # 16k positions: with 20 alternatives each, about 45 MB of Python records

    def __init__(self, pool: PagePool, extra_key: str):
        self.pool = pool
        self.page_size = pool.page_size
        self._root = _h(b"jaxserve-prefix-v1", extra_key.encode())
        self.queries = 0  # prompt tokens looked up at admission (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached
        # scored page name -> (top alternatives per record, the page's page_size records)
        self.scores: OrderedDict[bytes, tuple[int, list[dict]]] = OrderedDict()

    def root(self, cache_salt: str | None) -> bytes:
        return self._root if cache_salt is None else _h(self._root, b"salt:" + cache_salt.encode())

    def hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """The chain hashes of `seq`'s first `num_pages` full pages (kept on the sequence:
        its tokens only ever grow)."""
        out = seq.page_hashes
        if len(out) < num_pages:
            parent = out[-1] if out else self.root(seq.cache_salt)
            out.extend(chain_hashes(seq.tokens, self.page_size, parent, len(out), num_pages))
        return out[:num_pages]

    def match(self, seq: Sequence, limit_tokens: int | None = None) -> list[int]:
        """Indexed pages holding `seq`'s leading full pages, below `limit_tokens` (default: all
        but the last token). Takes nothing."""
        limit = seq.num_tokens - 1 if limit_tokens is None else limit_tokens
        pages = []
        for h in self.hashes(seq, max(limit, 0) // self.page_size):
            page = self.pool.lookup(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, seq: Sequence, pages: list[int], *, count: bool = True) -> int:
        """Give `seq` (holding no pages) the matched `pages`; returns the tokens they hold.
        `count` adds a lookup to the hit statistics (admission from waiting)."""
        assert not seq.pages, "acquire needs a sequence without pages"
        for p in pages:
            self.pool.share(p)
        seq.pages.extend(pages)
        seq.num_indexed_pages = len(pages)
        cached = len(pages) * self.page_size
        if count:
            self.queries += seq.num_tokens
            self.hits += cached
            if seq.cached_tokens is None:
                seq.cached_tokens = min(cached, len(seq.prompt_ids))
        return cached

    def pending(self, seqs: list[Sequence]) -> set[bytes]:
        """Hashes of full pages that `seqs` (prompts mid-prefill) have not computed yet."""
        out: set[bytes] = set()
        ps = self.page_size
        for s in seqs:
            out.update(self.hashes(s, s.num_tokens // ps)[s.num_computed // ps:])
        return out

    def waits(self, seq: Sequence, num_hit: int, pending: set[bytes]) -> bool:
        """`seq`'s first page past its hit is being computed by another prompt: take it later."""
        full = (seq.num_tokens - 1) // self.page_size
        return num_hit < full and self.hashes(seq, num_hit + 1)[num_hit] in pending

    def commit(self, seq: Sequence) -> None:
        """Index `seq`'s full pages below num_computed (written by a step that has finished)."""
        n = min(seq.num_computed // self.page_size, len(seq.pages))
        if n <= seq.num_indexed_pages:
            return
        hashes = self.hashes(seq, n)
        for i in range(seq.num_indexed_pages, n):
            self.pool.index(seq.pages[i], hashes[i])  # False: another page holds this chain already
        seq.num_indexed_pages = n

    def _score_name(self, seq: Sequence, page: int) -> bytes | None:
        """The name of the records of `seq`'s prompt page `page`: its chain and the prompt token
        after it, which its last record scores (None when the prompt ends before that token)."""
        after = (page + 1) * self.page_size
        if after >= len(seq.prompt_ids):
            return None
        return _h(self.hashes(seq, page + 1)[page], b"next:" + array.array("i", [seq.prompt_ids[after]]).tobytes())

    def keep_scores(self, seq: Sequence) -> None:
        """Keep the records of `seq`'s prompt pages that it has scored in full since the last call."""
        ps, k = self.page_size, seq.params.prompt_logprobs
        done = len(seq.prompt_logprobs) // ps
        for page in range(seq.scored_pages, done):
            name = self._score_name(seq, page)
            if name is None:
                break
            self.scores[name] = (k, seq.prompt_logprobs[page * ps:(page + 1) * ps])
            self.scores.move_to_end(name)
        seq.scored_pages = max(seq.scored_pages, done)
        while len(self.scores) > self.MAX_SCORED_PAGES:
            self.scores.popitem(last=False)

    def find_scores(self, seq: Sequence) -> None:
        """Extend `seq`'s prompt logprobs with kept records of its next pages, while there are
        (with at least as many alternatives as it asks for): it need not compute them."""
        ps, k = self.page_size, seq.params.prompt_logprobs
        while (start := seq.logits_needed_from) is not None and start % ps == 0:
            name = self._score_name(seq, start // ps)
            kept = self.scores.get(name) if name is not None else None
            if kept is None or kept[0] < k:
                break
            self.scores.move_to_end(name)
            seq.prompt_logprobs.extend({**r, "top": r["top"][:k]} for r in kept[1])
            seq.scored_pages = start // ps + 1

    def stats(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "cached_pages": self.pool.num_cached,
                "scored_pages": len(self.scores),
                "indexed_pages": self.pool.num_indexed, "evictions": self.pool.evictions}
