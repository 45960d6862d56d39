"""The op registry: every op the heads use has its reference and a Triton provider (DESIGN 4)."""

import mtpfactory.kernels  # noqa: F401  (defines every op)
from mtpfactory import ops


def test_every_op_has_a_triton_provider():
    defined = ops.all_ops()
    assert {"linear", "linear_fp8", "linear_nvfp4", "rms_norm", "rope_neox", "reshape_and_cache",
            "reshape_and_cache_fp8", "paged_decode_attention", "moe_route_softmax", "fused_moe",
            "fused_moe_nvfp4", "argmax", "embedding", "quantize_nvfp4", "quantize_fp8"} <= set(defined)
    assert [name for name, op in defined.items() if "triton" not in op.providers] == []
