"""The batch engine: paged KV cache, scheduler, device runner, sampler, and the loop tying them."""
