"""The page pool of the paged KV cache (host-side bookkeeping; the arrays live in runner.py).

The cache is cut into `num_pages` pages of `page_size` token slots. A sequence holds
a list of pages (its block table) that grows a page at a time as tokens arrive:
nothing is reserved for a maximum length. Pages carry reference counts so that a
later prefix cache can share full pages between sequences; a page returns to the
free list when its count drops to zero.

Safety across requests does not depend on clearing pages: attention only reads a
sequence's slots below its context length, and every one of those was written by
that sequence in the same or an earlier step.
"""

from __future__ import annotations

import math


class OutOfPages(RuntimeError):
    """More pages were asked for than are free; callers check `can_allocate` first."""


def kv_bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V for one page over all layers."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype_bytes


def pages_for_budget(budget_bytes: int, bytes_per_page: int) -> int:
    return max(0, budget_bytes // bytes_per_page)


class PagePool:
    """Free list and reference counts of `num_pages` pages."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

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
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, page: int) -> None:
        """Another sequence starts reading `page` (prefix sharing)."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is free and cannot be shared")
        self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

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
        """Return all of a block table's pages and empty it."""
        self.free(pages)
        pages.clear()
