"""The op registry: every op the heads use has its reference and a Triton provider (DESIGN 4); a kernel the GPU
cannot load falls back under `auto`."""

import itertools
import os
import re

import pytest
import torch
import triton
import triton.language as tl

import mtpfactory.kernels  # noqa: F401  (defines every op)
from mtpfactory import ops
from mtpfactory.errors import ConfigError, MtpfError
from mtpfactory.kernels.paged_attention import paged_decode_attention

ACCEPTS = lambda *args, **kwargs: None  # noqa: E731  (an op contract that refuses nothing)


def test_every_op_has_a_triton_provider():
    defined = ops.all_ops()
    assert {"linear", "linear_fp8", "linear_nvfp4", "rms_norm", "rope_neox", "rms_norm_rope", "embed_norm_cat",
            "silu_mul", "reshape_and_cache", "reshape_and_cache_fp8", "paged_decode_attention", "moe_route_softmax",
            "fused_moe", "fused_moe_nvfp4", "argmax", "embedding", "quantize_nvfp4", "quantize_fp8"} <= set(defined)
    assert [name for name, op in defined.items() if "triton" not in op.providers] == []


# --- GPU: a kernel the GPU cannot load ---------------------------------------------------------------------

@triton.jit
def _product_kernel(a_ptr, b_ptr, out_ptr, K, BLOCK: tl.constexpr):
    """out = a @ b for a [BLOCK, K] and b [K, BLOCK] (fp32, K a multiple of BLOCK) in one program: at BLOCK 128
    and 4 stages its pipelined tiles need 512 KB of shared memory (compiled for sm_90), past any GPU's 227 KB
    a block."""
    r = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        a = tl.load(a_ptr + r[:, None] * K + (k0 + r)[None, :])
        b = tl.load(b_ptr + (k0 + r)[:, None] * BLOCK + r[None, :])
        acc += tl.dot(a, b)
    tl.store(out_ptr + r[:, None] * BLOCK + r[None, :], acc)


@pytest.mark.gpu
def test_gpu_a_provider_whose_kernel_the_gpu_cannot_load_falls_back_under_auto(monkeypatch):
    """Triton raises OutOfResources loading a kernel that needs more shared memory than the GPU has: `auto`
    runs the reference instead, `triton` refuses the call naming the op (the mechanism: test_registry.py)."""
    monkeypatch.setattr(ops, "_OPS", {})
    monkeypatch.setattr(ops, "_warned", set())

    def launch(a, b):
        out = torch.full((a.shape[0], b.shape[1]), float("nan"), device=a.device)
        _product_kernel[(1,)](a, b, out, a.shape[1], BLOCK=a.shape[0], num_stages=4)
        return out

    op = ops.Op("test_op_product", lambda a, b: a @ b, ACCEPTS)
    op.register_provider("triton", launch, lambda a, b: None)
    a, b = torch.randn(128, 512, device="cuda"), torch.randn(512, 128, device="cuda")
    with ops.use_backend("auto"):
        assert torch.equal(op(a, b), a @ b)
    with ops.use_backend("triton"), pytest.raises(ConfigError, match=r"test_op_product's triton provider cannot "
                                                                     r"launch .*shared memory"):
        op(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, dtype", [(64, torch.float32), (64, torch.bfloat16), (128, torch.float32)])
def test_gpu_paged_attention_at_its_largest_tiles_runs_or_falls_back(hq, dtype, monkeypatch, caplog):
    """Large tiles the op takes (64 or 128 q heads on one KV head, D 512) at its default tile. Compiled for
    sm_90: 64 fp32 heads need 196 KiB of shared memory, under the 227 KB a block, and run; 128 need more, so
    the GPU cannot load the kernel and `auto` runs the reference, warning once. 64 bf16 heads (192 KiB) gave
    wrong results on an H100 (2026-12-05): the provider refuses groups past 32 at D past 256 on a 16-bit or FP8
    cache, and `auto` runs the reference for them, silently (passed on an H100, 2026-12-05). Every way the call
    gives the reference's result."""
    monkeypatch.setattr(ops, "_warned", set())
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, hkv, d, bs, ctx = 2, 1, 512, 16, 300
    blocks = b * triton.cdiv(ctx, bs)
    q = torch.randn(b, hq, d, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(blocks, bs, hkv, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
    tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    with ops.use_backend("auto"), caplog.at_level("WARNING", logger="mtpfactory.ops"):
        got = paged_decode_attention(q, k, v, tables, lens, d ** -0.5)
    want = paged_decode_attention.reference(q, k, v, tables, lens, d ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    fell_back = [r for r in caplog.records if "paged_decode_attention" in r.getMessage()]
    assert len(fell_back) == (hq == 128) and all("shared memory" in r.getMessage() for r in fell_back)


def _wrong_everywhere() -> dict:
    """{case: (op, args, kwargs, the argument named)}: calls no backend can serve, which the references met with a
    raw torch error, or ran (a scale of one element, a norm weight of one, broadcast); and outputs that cannot
    hold the result beside operands only the reference takes (fp64, strided), which `triton` answered with "no
    triton provider" where the others named `out`."""
    from mtpfactory import kernels as K
    from mtpfactory.kernels.rope import rope_inv_freq
    from mtpfactory.quant import quantize_nvfp4
    x = torch.randn(3, 32)
    f8 = torch.randn(24, 32).to(torch.float8_e4m3fn)
    f64 = torch.randn(3, 64, dtype=torch.float64)
    return {
        "linear K": (K.linear, (x, torch.randn(24, 31)), {}, "weight"),
        "linear weight dtype": (K.linear, (x, torch.randn(24, 32, dtype=torch.bfloat16)), {}, "weight"),
        "linear x int": (K.linear, (x.int(), torch.randn(24, 32)), {}, "x"),
        "linear_fp8 scale [25]": (K.linear_fp8, (x, f8, torch.rand(25)), {}, "weight_scale"),
        "linear_fp8 scale [1]": (K.linear_fp8, (x, f8, torch.rand(1)), {}, "weight_scale"),
        "linear_fp8 bf16 weight": (K.linear_fp8, (x, f8.bfloat16(), torch.rand(24)), {}, "weight"),
        "linear_nvfp4 K": (K.linear_nvfp4, (torch.randn(3, 48), *quantize_nvfp4(torch.randn(24, 32))), {}, "x"),
        "rms_norm weight [H + 1]": (K.rms_norm, (torch.randn(3, 48), torch.randn(49), 1e-6, False), {}, "weight"),
        "rms_norm weight [1]": (K.rms_norm, (torch.randn(3, 48), torch.randn(1), 1e-6, False), {}, "weight"),
        "rope 4-D x, positions of other N": (K.rope_neox, (torch.randn(2, 3, 2, 16), torch.arange(5),
                                                           rope_inv_freq(8, 1e4)), {}, "positions"),
        "rms_norm strided x, out of other H": (K.rms_norm, (torch.randn(64, 3).T, torch.ones(64), 1e-6, False),
                                               {"out": torch.empty(3, 65)}, "out"),
        "argmax fp64, out of other B": (K.argmax, (f64,), {"out": torch.empty(4, dtype=torch.int64)}, "out"),
        "route fp64, out of other k": (K.moe_route_softmax, (f64, 2, True),
                                       {"out": (torch.empty(3, 3), torch.empty(3, 3, dtype=torch.int64))}, "out[0]"),
        "quantize_fp8 fp64, out of other N": (K.quantize_fp8, (f64,), {"out": (torch.empty(4, 64).to(
            torch.float8_e4m3fn), torch.empty(4))}, "out[0]"),
    }


@pytest.mark.parametrize("case", list(_wrong_everywhere()))
@pytest.mark.parametrize("backend", ["native", "auto", "triton"])
def test_calls_wrong_under_every_backend_are_refused_alike(case, backend):
    """A call no backend can serve is refused by its op's contract under every backend with the same error,
    naming the argument (`triton` said "no triton provider, use auto", which then raised the reference's error,
    or a raw torch error from inside the reference)."""
    op, args, kwargs, field = _wrong_everywhere()[case]
    assert op.contract(*args, **kwargs) is not None
    with ops.use_backend(backend), pytest.raises(MtpfError, match=rf"^{re.escape(field)}"):
        op(*args, **kwargs)


def test_an_ops_signature_is_its_references():
    """Serving code finds an op's arguments: `inspect.signature` showed (*args, **kwargs)."""
    import inspect
    for op in ops.all_ops().values():
        assert inspect.signature(op) == inspect.signature(op.reference), op.name


def test_auto_falls_back_per_op_logging_the_op_at_debug_level(caplog):
    """`auto` on CPU tensors: the reference, and a debug line naming the op and the call (DESIGN 4)."""
    from mtpfactory import kernels as K
    x, w = torch.randn(3, 64), torch.randn(64)
    with ops.use_backend("auto"), caplog.at_level("DEBUG", logger="mtpfactory.ops"):
        got = K.rms_norm(x, w, 1e-6, False)
    assert torch.equal(got, K.rms_norm.reference(x, w, 1e-6, False))
    lines = [r for r in caplog.records if r.name == "mtpfactory.ops" and "op rms_norm" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "DEBUG"
    assert "no fast provider serves this call ((3, 64) float32 cpu, (64,) float32 cpu); using native" in \
        lines[0].getMessage()


def test_the_interpreter_serves_cpu_tensors_only_under_an_explicit_triton():
    """TRITON_INTERPRET=1 is a testing tool: `auto` never picks it for CPU tensors (it would run every op
    interpreted), `triton` does."""
    cpu = torch.zeros(2)
    for backend, runs in (("auto", False), ("native", False), ("triton", os.environ.get("TRITON_INTERPRET") == "1")):
        with ops.use_backend(backend):
            assert ops.triton_can_run(cpu) is runs, backend


def test_use_backend_gives_the_previous_backend_back_on_exit_and_on_error():
    assert ops._backend.get() == "auto"
    with ops.use_backend("native"):
        with ops.use_backend("triton"):
            assert ops._backend.get() == "triton"
        assert ops._backend.get() == "native"
    with pytest.raises(RuntimeError), ops.use_backend("triton"):
        raise RuntimeError("a failing forward")
    assert ops._backend.get() == "auto"
    with pytest.raises(ConfigError, match="runtime.backend='cuda': allowed: auto, triton, native"), \
            ops.use_backend("cuda"):
        pass
    for device in ("cpu", torch.device("cpu")):   # `running` takes a device as torch.device does (a str raised
        with ops.running("native", device):        # AttributeError)
            assert ops._backend.get() == "native"


def _expanded_outs() -> dict:
    """Calls whose `out` is an expanded buffer (stride 0 along a dim of several elements): its elements share
    memory, so the result cannot be held."""
    from mtpfactory import kernels as K
    from mtpfactory.kernels.rope import rope_inv_freq
    table, x = torch.randn(6, 4), torch.randn(2, 2, 8)
    return {
        "embedding": (K.embedding, (torch.tensor([1, 2]), table), torch.zeros(1, 4).expand(2, 4)),
        "argmax": (K.argmax, (torch.randn(3, 5),), torch.zeros(1, dtype=torch.int64).expand(3)),
        "rope_neox": (K.rope_neox, (x, torch.tensor([1, 2]), rope_inv_freq(8, 1e4)),
                      torch.zeros(1, 2, 8).expand(2, 2, 8)),
        "rms_norm_rope": (K.rms_norm_rope, (x, torch.randn(8), 1e-6, True, torch.tensor([1, 2]),
                                            rope_inv_freq(8, 1e4)), torch.zeros(1, 2, 8).expand(2, 2, 8)),
    }


@pytest.mark.parametrize("case", list(_expanded_outs()))
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_an_out_whose_elements_share_memory_is_refused_by_every_backend(case, backend):
    """An `out` expanded from one row cannot hold a result a row: the reference met it with torch's raw
    "more than one element of the written-to tensor refers to a single memory location" after computing, and the
    Triton providers (which write by strides) raced their rows into it and returned one row's values for all."""
    op, args, out = _expanded_outs()[case]
    before = out.clone()
    shared = r"^out=.*strides \(0[,)].*elements have memory of their own"
    with ops.use_backend(backend), pytest.raises(MtpfError, match=shared):
        op(*args, out=out)
    assert torch.equal(out, before)


def test_overlap_refusal_takes_an_out_apart_or_in_place_and_names_any_other():
    """An `out` apart from the inputs, or the same elements as an input named in_place (a dim of one element may
    have any stride), is taken; any other sharing is refused naming the out field and the input, with the fix."""
    buf = torch.zeros(4, 8)
    x, w = buf[:2], buf[3]
    assert ops.overlap_refusal("out", None, x=x) is None
    assert ops.overlap_refusal("out", buf[2], x=x, w=w) is None                     # apart
    assert ops.overlap_refusal("out", x, in_place=("x",), x=x, w=None) is None       # x itself
    row = buf[:1]
    assert ops.overlap_refusal("out", row.as_strided((1, 8), (1, 1)), in_place=("x",), x=row) is None
    for out, shares in ((buf[1:3], "x"), (x.as_strided((2, 8), (1, 2)), "x"), (buf[3:], "w"), (x, "x")):
        why = ops.overlap_refusal("out", out, in_place=("x",) if out is not x else (), x=x, w=w)
        assert (why.field, why.value) == ("out", f"memory shared with {shares}"), why
        assert "pass an out of its own" in why.fix
    why = ops.outs_overlap_refusal((buf[2], buf[3]), ("a", "b"), w=w)
    assert (why.field, why.value) == ("out[1] (b)", "memory shared with w")
    assert ops.outs_overlap_refusal((buf[2],), ("a", "b"), w=w) is None             # outs_refusal's to refuse


def _outs_sharing_memory() -> dict:
    """(op, arguments, the field refused, the outputs) for each op of several results, two of its outputs
    sharing memory: no backend can return both results."""
    x, res, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    both = torch.full((3, 16), float("nan"))
    scores = torch.full((16,), float("nan"))
    route_out = (scores[:8].view(4, 2), scores.view(torch.int64).view(4, 2))
    codes = torch.full((4, 32), 7, dtype=torch.uint8)
    q_out = (codes.view(torch.float8_e4m3fn), codes.view(-1)[:16].view(torch.float32))
    return {
        "rms_norm": (mtpfactory.kernels.rms_norm, (x, w, 1e-6, False, res), dict(out=both, residual_out=both),
                     "residual_out", (both,)),
        "moe_route_softmax": (mtpfactory.kernels.moe_route_softmax, (torch.randn(4, 8), 2, True),
                              dict(out=route_out), "out[1] (ids)", route_out),
        "quantize_fp8": (mtpfactory.kernels.quantize_fp8, (torch.randn(4, 32),), dict(out=q_out),
                         "out[1] (weight_scale)", q_out),
    }


@pytest.mark.parametrize("backend", ["native", "auto", "triton"])
@pytest.mark.parametrize("name", ["rms_norm", "moe_route_softmax", "quantize_fp8"])
def test_outputs_sharing_memory_with_each_other_are_refused_under_every_backend(name, backend):
    """rms_norm's out and residual_out one buffer, the routing's ids over its weights, the FP8 scales over the
    codes: one result would overwrite the other whichever provider ran, so each op's contract refuses it, naming
    the later output and the one it shares memory with, and writes nothing."""
    op, args, kwargs, field, outs = _outs_sharing_memory()[name]
    before = [o.clone() for o in outs]
    with ops.use_backend(backend), pytest.raises(MtpfError, match=rf"^{re.escape(field)}='memory shared with out"):
        op(*args, **kwargs)
    assert all(torch.equal(o.view(torch.uint8), b.view(torch.uint8)) for o, b in zip(outs, before))


def test_the_host_cdiv_and_next_power_of_2_are_tritons():
    """`ops.cdiv` / `ops.next_power_of_2` stand in for Triton's in the launchers (whose wrappers cost microseconds a
    call in Triton 3.6): the same integers, from 0 and negatives up past 2^20."""
    values = [*range(-5, 1100), 4095, 4096, 4097, 151936, (1 << 20) - 1, 1 << 20, (1 << 20) + 1]
    assert [ops.next_power_of_2(n) for n in values] == [triton.next_power_of_2(n) for n in values]
    assert all(ops.cdiv(a, b) == triton.cdiv(a, b) for a in values for b in (1, 2, 3, 7, 16, 128, 4096))


def test_broadcasts_to_is_torchs_rule():
    """`ops.broadcasts_to(shape, target)` is `torch.broadcast_shapes(shape, target) == target` (refused counts
    False), over every shape of up to 3 dims of 0, 1, 2 and 3 against targets of up to 3 dims."""
    def torchs(s, t):
        try:
            return torch.broadcast_shapes(s, t) == torch.Size(t)
        except RuntimeError:
            return False
    shapes = [c for n in range(4) for c in itertools.product((0, 1, 2, 3), repeat=n)]
    targets = [c for n in range(4) for c in itertools.product((0, 1, 3), repeat=n)]
    assert all(ops.broadcasts_to(s, t) == torchs(s, t) for s in shapes for t in targets)
