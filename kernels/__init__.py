"""The op library (installed as `mtpfactory.kernels`): one file per op, each holding the op's PyTorch
reference (provider `native`, the definition) and, where one exists, its fast provider and launcher.

Importing this package defines every op in `mtpfactory.ops`.
"""

from mtpfactory.kernels.argmax import argmax
from mtpfactory.kernels.embed_norm_cat import embed_norm_cat
from mtpfactory.kernels.embedding import embedding
from mtpfactory.kernels.linear import linear
from mtpfactory.kernels.linear_fp8 import linear_fp8
from mtpfactory.kernels.linear_nvfp4 import linear_nvfp4
from mtpfactory.kernels.moe import fused_moe, fused_moe_nvfp4, moe_route_softmax
from mtpfactory.kernels.paged_attention import paged_decode_attention
from mtpfactory.kernels.quantize_fp8 import quantize_fp8
from mtpfactory.kernels.quantize_nvfp4 import quantize_nvfp4
from mtpfactory.kernels.reshape_and_cache import reshape_and_cache
from mtpfactory.kernels.reshape_and_cache_fp8 import reshape_and_cache_fp8
from mtpfactory.kernels.rms_norm import rms_norm
from mtpfactory.kernels.rms_norm_linear_nvfp4 import rms_norm_linear_nvfp4
from mtpfactory.kernels.rms_norm_rope import rms_norm_rope
from mtpfactory.kernels.rope import rope_neox
from mtpfactory.kernels.silu_mul import silu_mul

__all__ = ["argmax", "embed_norm_cat", "embedding", "fused_moe", "fused_moe_nvfp4", "linear", "linear_fp8",
           "linear_nvfp4", "moe_route_softmax", "paged_decode_attention", "quantize_fp8", "quantize_nvfp4",
           "reshape_and_cache", "reshape_and_cache_fp8", "rms_norm", "rms_norm_linear_nvfp4", "rms_norm_rope",
           "rope_neox", "silu_mul"]
