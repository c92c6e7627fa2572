"""Weight-only quantized matmuls: int8 per output channel, int4 group-wise (formats in ref.py)."""

from pallas_kernels.quantized_matmul.kernels import int4_matmul, int8_matmul
from pallas_kernels.quantized_matmul.ref import (int4_group_size, int4_matmul_ref, int8_matmul_ref, quantize_int4,
                                                 quantize_int8, unpack_int4)

__all__ = ["int4_group_size", "int4_matmul", "int4_matmul_ref", "int8_matmul", "int8_matmul_ref", "quantize_int4",
           "quantize_int8", "unpack_int4"]
