"""Number formats (DESIGN 3): NVFP4 and FP8 E4M3, defined in plain PyTorch; kernels are tested against these."""

from mtpfactory.quant.fp8 import (
    FP8_E4M3_MAX,
    dequantize_fp8,
    dequantize_fp8_block,
    quantize_fp8,
    quantize_fp8_block,
)
from mtpfactory.quant.nvfp4 import E2M1_VALUES, NVFP4_BLOCK, dequantize_nvfp4, quantize_nvfp4

__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "NVFP4_BLOCK",
    "dequantize_fp8",
    "dequantize_fp8_block",
    "dequantize_nvfp4",
    "quantize_fp8",
    "quantize_fp8_block",
    "quantize_nvfp4",
]
