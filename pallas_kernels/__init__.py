"""Pallas kernels (Triton lowering) for the GPU hot paths, each with a pure-jnp reference.

    paged_attention/   decode attention over block tables; prefill/extend attention
    quantized_matmul/  int8 and int4 weight-only matmuls

Every kernel takes `interpret=True`, which runs it on any backend (the CPU tests), and
lowers for CUDA from a CPU-only machine (the lowering tests).
"""
