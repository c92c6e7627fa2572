"""The page pool of the paged KV cache (host-side bookkeeping; the arrays live in runner.py).

The cache is cut into `num_pages` pages of `page_size` token slots. A sequence holds
a list of pages (its block table) that grows a page at a time as tokens arrive:
nothing is reserved for a maximum length. Pages carry reference counts so that
sequences can share full pages of a common prefix (engine/prefix_cache.py).

A page is in one of three states:

    used       reference count >= 1: some sequence's block table holds it
    cached     reference count 0, but listed in the prefix index under the hash of the
               token chain it holds: a later request with that prefix takes it back
    free       reference count 0 and in no index

Cached pages count as free for every capacity question (`num_free`, `can_allocate`):
`allocate` takes free pages first, then evicts cached ones, least recently released
first. A sequence releases its pages last page first, so a prompt's tail is evicted
before its head (the head is what other prompts are most likely to share).

Safety across requests does not depend on clearing pages: attention only reads a
sequence's slots below its context length, and every one of those was written by
that sequence, or is a full page of the index that was written for the same chain of
tokens.
"""

from __future__ import annotations

import collections
import math


class OutOfPages(RuntimeError):
    """More pages were asked for than are free; callers check `can_allocate` first."""


def kv_bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                      scale_bytes: int = 0) -> int:
    """K and V for one page over all layers, with `scale_bytes` per token and KV head of each
    (an int8 cache's scales)."""
    return 2 * num_layers * page_size * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def pages_for_budget(budget_bytes: int, bytes_per_page: int) -> int:
    return max(0, budget_bytes // bytes_per_page)


class PagePool:
    """Free list, reference counts and the prefix index of `num_pages` pages."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}  # prefix index: chain hash -> page holding that chain's page
        self._hash_of: dict[int, bytes] = {}  # the same, inverted
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # refs 0, indexed; LRU first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages no sequence holds that the prefix index keeps for reuse."""
        return len(self._cached)

    @property
    def num_indexed(self) -> int:
        """Pages in the prefix index, held or not."""
        return len(self._hash_of)

    @property
    def num_tokens(self) -> int:
        """Tokens the whole pool holds: the most one request could ever use."""
        return self.num_pages * self.page_size

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def pages_to_take(self, shared: list[int], num_tokens: int) -> int:
        """How far the free count drops when a block table starts with the `shared` pages (cached
        ones leave the free count when taken back) and grows to hold `num_tokens`."""
        return self.pages_needed(num_tokens) - len(shared) + sum(1 for p in shared if self._refs[p] == 0)

    def allocate(self, n: int) -> list[int]:
        """`n` pages with reference count 1: free pages first, then the least recently cached."""
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._cached.popitem(last=False)
                del self._page_of[self._hash_of.pop(p)]
                self.evictions += 1
            self._refs[p] = 1
            pages.append(p)
        return pages

    def share(self, page: int) -> None:
        """Another sequence starts reading `page`: a used page, or a cached one taken back."""
        if self._refs[page] == 0:
            if page not in self._cached:
                raise ValueError(f"page {page} is free and cannot be shared")
            del self._cached[page]
        self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._hash_of:
                    self._cached[p] = None  # most recently released: evicted last
                else:
                    self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # The prefix index -----------------------------------------------------------------

    def lookup(self, chain_hash: bytes) -> int | None:
        """The page indexed under `chain_hash`, used or cached; None if there is none."""
        return self._page_of.get(chain_hash)

    def index(self, page: int, chain_hash: bytes) -> bool:
        """List a used, fully written `page` under `chain_hash`. False (nothing changes) when
        another page already holds that chain or this page is indexed already."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is not held; only a held, written page can be indexed")
        if chain_hash in self._page_of or page in self._hash_of:
            return False
        self._page_of[chain_hash] = page
        self._hash_of[page] = chain_hash
        return True

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    def clear_index(self) -> None:
        """Forget every indexed chain (after a failed step, whose pages' contents are unknown):
        cached pages become free, used ones stay with their sequences."""
        self._free.extend(reversed(self._cached))
        self._cached.clear()
        self._page_of.clear()
        self._hash_of.clear()

    # Per-sequence block tables -------------------------------------------------------

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extend a block table in place to hold `num_tokens`; False (and no change) if short of pages."""
        need = self.pages_needed(num_tokens) - len(pages)
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        pages.extend(self.allocate(need))
        return True

    def release(self, pages: list[int]) -> None:
        """Return all of a block table's pages and empty it; the last page is released first,
        so among a sequence's cached pages the tail is evicted before the head."""
        self.free(pages[::-1])
        pages.clear()
