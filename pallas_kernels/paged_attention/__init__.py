"""Attention that reads K/V straight through block tables, never gathering a whole context.

Cache layout (the engine's): k_cache, v_cache [L, NP, PS, K, D]; int8 caches carry
per-token scales [L, NP, PS, K]. A sequence's keys are pages block_tables[b, 0],
block_tables[b, 1], ... laid end to end.
"""

from pallas_kernels.paged_attention.decode import paged_decode_attention
from pallas_kernels.paged_attention.prefill import paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention"]
