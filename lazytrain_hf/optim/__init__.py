"""Hybrid 8-bit optimizer: AdamW with blockwise 8-bit states, master weights and fused gradient clipping.

Layout (bitsandbytes-style): `hybrid8` owns the loop, `functional` holds one update kernel per device plus the
pure-torch reference, `quant` the quantization maps and blockwise (de)quantization, `_cpu_kernel` the fused C++
CPU kernel (built on first use).
"""

from ._cpu_kernel import cpu_kernel_status
from .functional import AdamWHyper, Codebooks, adamw_step
from .hybrid8 import STATE_TENSOR_KEYS, Hybrid8bitOptimizer
from .kernel_select import bitsandbytes_cuda_status, select_kernel
from .quant import (
    code_lookup_table,
    code_midpoints,
    dequantize_blockwise,
    dynamic_map,
    max_code_gap,
    num_blocks,
    quantize_blockwise,
    zero_code,
)

__all__ = [
    "Hybrid8bitOptimizer",
    "STATE_TENSOR_KEYS",
    "dynamic_map",
    "code_midpoints",
    "code_lookup_table",
    "zero_code",
    "num_blocks",
    "max_code_gap",
    "quantize_blockwise",
    "dequantize_blockwise",
    "AdamWHyper",
    "Codebooks",
    "adamw_step",
    "select_kernel",
    "bitsandbytes_cuda_status",
    "cpu_kernel_status",
]

