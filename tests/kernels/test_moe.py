"""MoE ops: softmax top-k routing, `fused_moe` (unquantized experts) and `fused_moe_nvfp4` (NVFP4 experts,
W4A16), each with the shared-expert blend.

The references are checked against independent computations (a brute-force sort for the routing, every
expert computed densely and masked by the routing for the MoE); each Triton provider is checked against
its reference over odd shapes, with outputs and workspaces poisoned with NaN before the launch and every
expert that no row selected poisoned with NaN too (so a provider that reads an unselected expert, or
leaves an output unwritten, fails).

Tolerances, relative to the largest output magnitude:
- fp32: 1e-5. Provider and reference compute the same fp32 products and differ only in summation order
  (measured <= 5e-7); a wrong expert, slot, weight or NVFP4 code changes outputs by >= 1e-3.
- bf16: 2e-2 (about five bf16 ulps at the output's scale). The reference rounds the gate_up output, silu,
  the product, each expert's output and the result to bf16; the provider rounds only the intermediate
  h, each expert's output and the result. Against an fp64 evaluation of the same inputs the provider is
  off by <= 4e-3 and the reference by <= 6.5e-3 (measured), so they can differ by ~1e-2.
- routing: expert ids exactly; weights 1e-6 absolute (probabilities <= 1; exp differs by an ulp).
"""

from __future__ import annotations

import re

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError, MtpfError
from mtpfactory.kernels import moe
from mtpfactory.quant import E2M1_VALUES
from backend_refusal import assert_backend_refuses, assert_overlap_refused

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16]

# (N, E, top_k, H, I): N in {1, 3, 17}, E in {4, 9}, top_k in {1, 2, 3}; H and I multiples of 16 below
# and above one 32-wide tile. The launcher picks its candidates by (row, slot) pair when a row group has
# fewer pairs than E and by expert id otherwise: both occur here.
SHAPES = [(1, 4, 1, 32, 32), (1, 9, 3, 48, 32), (3, 9, 2, 48, 48), (3, 4, 3, 32, 48), (17, 9, 3, 32, 32),
          (17, 4, 2, 48, 32)]


def shape_id(shape) -> str:
    return "N{}-E{}-k{}-H{}-I{}".format(*shape)


def scaled_close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """|got - ref| <= tol * max|ref| elementwise; NaN anywhere fails."""
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=tol * ref.float().abs().max().item())


@pytest.fixture
def nvfp4_path(request, monkeypatch):
    """NVFP4 experts through the GEMV kernels (request.param "gemv": up to 32 rows, the default) or through the
    dot kernels ("dot": GEMV_MAX_ROWS 0), whatever the rows; set by the parametrizations below."""
    monkeypatch.setattr(moe, "GEMV_MAX_ROWS", 32 if request.param == "gemv" else 0)
    return request.param


# Both NVFP4 paths, and the unquantized experts once (the path does not apply to them)
NVFP4_PATHS = pytest.mark.parametrize("nvfp4_path", ["gemv", "dot"], indirect=True)
FMT_PATHS = pytest.mark.parametrize("fmt,nvfp4_path", [("unq", "gemv"), ("nvfp4", "gemv"), ("nvfp4", "dot")],
                                    indirect=["nvfp4_path"], ids=["unq", "nvfp4-gemv", "nvfp4-dot"])


def tied_logits(n: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """[N, E] fp32 router logits with planted ties: small integers (many equal values on the top-k
    boundary), the last row all equal."""
    logits = torch.randint(-2, 3, (n, e), generator=gen).float()
    logits[-1] = 0.5
    return logits


def routing(n: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [N, k], ids int64 [N, k]) from the reference router on tied logits."""
    return moe.moe_route_softmax(tied_logits(n, e, gen), k, True)


def unselected(e: int, ids: torch.Tensor) -> torch.Tensor:
    """Boolean [E]: experts no row selected."""
    mask = torch.ones(e, dtype=torch.bool, device=ids.device)
    mask[ids.flatten()] = False
    return mask


def dense_moe(x, w_gate_up, w_down, weights, ids, shared_out=None, shared_gate=None) -> torch.Tensor:
    """The MoE evaluated in fp64 with every expert computed for every row, masked by the routing."""
    x, w_gate_up, w_down = x.double(), w_gate_up.double(), w_down.double()
    inter = w_down.shape[-1]
    gate_up = torch.einsum("nh,eoh->neo", x, w_gate_up)                                   # [N, E, 2I]
    h = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    y = torch.einsum("nei,eoi->neo", h, w_down)                                            # [N, E, H]
    mask = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=torch.float64, device=x.device)
    mask.scatter_(1, ids, weights.double())                                                # [N, E]
    out = (mask[..., None] * y).sum(dim=1)
    if shared_out is not None:
        out = out + torch.sigmoid(shared_gate.double()) * shared_out.double()
    return out


def experts(e: int, h: int, i: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate_up [E, 2I, H], w_down [E, H, I] on gen's device, scaled so that activations stay O(1)."""
    w_gate_up = torch.randn(e, 2 * i, h, generator=gen, device=gen.device) / h**0.5
    w_down = torch.randn(e, h, i, generator=gen, device=gen.device) / i**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def nvfp4_stack(e: int, rows: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random NVFP4 weights on gen's device: every byte value (so every code in both nibbles) and e4m3
    block scales mostly normal around 1 (2**-2 .. 2**2), one block in eight zero or subnormal."""
    like = dict(generator=gen, device=gen.device)
    weight = torch.randint(0, 256, (e, rows, k // 2), dtype=torch.uint8, **like)
    bits = torch.randint(0x28, 0x48, (e, rows, k // 16), dtype=torch.uint8, **like)
    small = torch.randint(0, 8, (e, rows, k // 16), dtype=torch.uint8, **like)
    bits = torch.where(torch.rand(bits.shape, **like) < 0.125, small, bits)
    return weight, bits.view(torch.float8_e4m3fn)


def nvfp4_experts(e: int, h: int, i: int, gen) -> dict[str, torch.Tensor]:
    gu_weight, gu_scale = nvfp4_stack(e, 2 * i, h, gen)
    dn_weight, dn_scale = nvfp4_stack(e, h, i, gen)
    # |code| averages ~2.6 and scales ~1: globals that keep gate_up and down outputs O(1).
    gu_global = (0.5 + torch.rand(e, 2, generator=gen, device=gen.device)) / (3 * h**0.5)
    dn_global = (0.5 + torch.rand(e, generator=gen, device=gen.device)) / (3 * i**0.5)
    return dict(gu_weight=gu_weight, gu_scale=gu_scale, gu_global=gu_global, dn_weight=dn_weight,
                dn_scale=dn_scale, dn_global=dn_global)


def dequantize_stack(weight: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """[E, R, K/2] codes with [E, R, K/16] scales and per-expert globals [E] (or [E, R] per row) -> fp32
    [E, R, K], written independently of `dequantize_nvfp4`."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=weight.device)
    codes = torch.stack([weight & 15, weight >> 4], dim=-1).flatten(-2).long()          # element 2j low nibble
    values = table[codes] * scale.float().repeat_interleave(16, dim=-1)
    return values * (glob[:, None, None] if glob.dim() == 1 else glob[..., None])


def nvfp4_dense(q: dict[str, torch.Tensor], inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_row = q["gu_global"].repeat_interleave(inter, dim=1)                               # [E, 2I]
    return (dequantize_stack(q["gu_weight"], q["gu_scale"], per_row),
            dequantize_stack(q["dn_weight"], q["dn_scale"], q["dn_global"]))


def shared_inputs(n: int, h: int, dtype, gen) -> dict[str, torch.Tensor]:
    return dict(shared_out=torch.randn(n, h, generator=gen, device=gen.device).to(dtype),
                shared_gate=(2 * torch.randn(n, 1, generator=gen, device=gen.device)).to(dtype))


def poisoned(n: int, h: int, k: int, inter: int, dtype, device) -> dict[str, torch.Tensor]:
    return dict(out=torch.full((n, h), float("nan"), dtype=dtype, device=device),
                workspace=torch.full((n * k, inter), float("nan"), dtype=dtype, device=device))


# --- routing ---------------------------------------------------------------------------------------------

def brute_force_route(logits: torch.Tensor, k: int, renormalize: bool):
    ids = [sorted(range(len(row)), key=lambda e: (-row[e], e))[:k] for row in logits.float().tolist()]
    ids = torch.tensor(ids, dtype=torch.int64)
    weights = torch.softmax(logits.double(), dim=-1).gather(1, ids)
    return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (3, 9, 2), (17, 9, 3), (17, 4, 2), (3, 9, 9)])
def test_route_reference_ties_to_lower_id(n, e, k, renormalize):
    gen = torch.Generator().manual_seed(n * 100 + e * 10 + k)
    logits = tied_logits(n, e, gen)
    weights, ids = moe.moe_route_softmax(logits, k, renormalize)
    want_weights, want_ids = brute_force_route(logits, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_weights, rtol=0, atol=1e-6)


def check_route_triton(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton routing into poisoned outs equals the reference (ids exactly, weights within 1e-6); returns the
    reference's (weights, ids)."""
    n = logits.shape[0]
    want_weights, want_ids = moe.moe_route_softmax(logits, k, renormalize)
    out = (torch.full((n, k), float("nan")), torch.full((n, k), -7, dtype=torch.int64))
    with ops.use_backend("triton"):
        weights, ids = moe.moe_route_softmax(logits, k, renormalize, out=out)
    assert weights is out[0] and ids is out[1]
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-6)
    return want_weights, want_ids


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (3, 9, 2), (17, 9, 3), (17, 4, 2), (3, 512, 10)])
def test_route_triton_matches_reference(n, e, k, renormalize, dtype):
    gen = torch.Generator().manual_seed(n * 100 + e * 10 + k)
    logits = tied_logits(n, e, gen)
    logits[0] = torch.randn(e, generator=gen)             # one row of distinct values
    logits = logits.to(dtype)
    check_route_triton(logits, k, renormalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_triton_strided_and_very_negative_logits(dtype):
    """Logits a column slice of a wider [N, E + 3] tensor (rows E + 3 apart: the kernel steps rows by their
    stride, which no other routing test makes differ from E), E = 9 (seven padding lanes in the kernel's
    block of 16), every logit near -1000. Softmax is shift-invariant, so the weights are those of the
    logits + 1000: a padding lane read as 0 into the row's max would underflow every exp to 0 and give NaN."""
    gen = torch.Generator().manual_seed(21)
    n, e, k = 5, 9, 3
    wide = (torch.randn(n, e + 3, generator=gen) - 1000.0).to(dtype)
    logits = wide[:, :e]
    assert logits.stride(0) == e + 3
    want_weights, _ = check_route_triton(logits, k, False)
    assert bool(want_weights.isfinite().all()) and bool((want_weights > 0).all())


NAN, INF = float("nan"), float("inf")
# [N, E 5] router logits with NaN and infinities (E 5 leaves three padding lanes in the kernel's block of 8):
# the reference's stable descending sort puts NaN first (lowest id first among NaNs), then +inf, ..., -inf;
# softmax over a row with a NaN or an infinity is NaN throughout. The last row is finite.
NONFINITE_LOGITS = [[NAN] * 5, [NAN, 1, 2, 3, 0], [1, NAN, 3, NAN, 2], [INF, NAN, -INF, 0, NAN],
                    [-INF, INF, INF, 1, -INF], [-INF] * 5, [0.5, -1, 2, 0, 2]]


def check_route_nonfinite(k: int, renormalize: bool, dtype, device: str) -> None:
    """The Triton provider's ids equal the reference's (so they lie in [0, E)) and its weights too, NaN
    where the reference's are; written into poisoned `out`."""
    logits = torch.tensor(NONFINITE_LOGITS, device=device).to(dtype)
    n, e = logits.shape
    want_weights, want_ids = moe.moe_route_softmax(logits, k, renormalize)
    # poisoned with -1, not NaN: the weights the reference gives are NaN, so NaN would hide a slot left unwritten
    out = (torch.full((n, k), -1.0, device=device), torch.full((n, k), -7, dtype=torch.int64, device=device))
    with ops.use_backend("triton"):
        weights, ids = moe.moe_route_softmax(logits, k, renormalize, out=out)
    assert weights is out[0] and ids is out[1]
    assert bool(((ids >= 0) & (ids < e)).all())
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-6, equal_nan=True)
    assert bool(weights[-1].isfinite().all())              # a finite row keeps finite weights


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_route_triton_nonfinite_logits(k, renormalize, dtype):
    check_route_nonfinite(k, renormalize, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_route_triton_signed_zeros_tie(dtype):
    """-0.0 equals +0.0, so of the two the lower id comes first, as in the reference's stable sort (the kernel
    ranks a logit by its float bits, and -0.0's would rank below +0.0's: it takes every zero as +0.0's bits)."""
    logits = torch.tensor([[-0.0, 0.0, -0.0, -1.0, 0.0], [0.0, -0.0, 1.0, -0.0, -2.0]]).to(dtype)
    _, ids = check_route_triton(logits, 4, False)
    assert ids.tolist() == [[0, 1, 2, 4], [2, 0, 1, 3]]


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_route_refuses_out_that_does_not_fit(backend):
    """ids in int32, or weights as a column slice: refused by name, nothing written."""
    logits = torch.randn(3, 9)
    for field, out in ((r"out\[1\] \(ids\)", (torch.full((3, 2), 7.0), torch.full((3, 2), 7, dtype=torch.int32))),
                       (r"out\[0\] \(weights\)", (torch.full((3, 4), 7.0)[:, :2],
                                                   torch.full((3, 2), 7, dtype=torch.int64)))):
        with ops.use_backend(backend), pytest.raises(InputError, match=f"^{field}="):
            moe.moe_route_softmax(logits, 2, True, out=out)
        assert all(bool((t == 7).all()) for t in out)


def test_route_triton_weights_in_place_on_the_logits():
    """The weights the logits themselves (fp32, top_k = E): program n reads its whole row of logits before it
    writes that row of the weights and ids, and no other program reads the row; the provider takes it and gives
    the reference's answer."""
    logits = tied_logits(3, 4, torch.Generator().manual_seed(12))
    want_weights, want_ids = moe.moe_route_softmax(logits, 4, False)
    ids = torch.full((3, 4), -7, dtype=torch.int64)
    with ops.use_backend("triton"):
        weights, got_ids = moe.moe_route_softmax(logits, 4, False, out=(logits, ids))
    assert weights is logits and got_ids is ids and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("i, field", [(0, "out[0] (weights)"), (1, "out[1] (ids)")])
def test_route_outs_sharing_memory_with_the_logits_are_left_to_the_reference(i, field):
    """The weights one row past the logits' start, or the ids (int64) over the bytes of logit rows 1 and 2:
    program 0 wrote into row 1 before its program read it. The provider refuses it naming both, writing nothing;
    `auto` runs the reference, which routes every row before it writes."""
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(13))
    over = (logits.view(-1)[8:14].view(3, 2), logits.view(-1).view(torch.int64)[4:10].view(3, 2))
    out = tuple(over[j] if j == i else torch.full((3, 2), -7, dtype=over[j].dtype) for j in range(2))
    want = moe.moe_route_softmax(logits.clone(), 2, True)
    assert_overlap_refused(moe.moe_route_softmax, field, "router_logits", logits, 2, True, out=out)
    with pytest.raises(InputError, match=rf"^{re.escape(field)}='memory shared with router_logits'"):
        moe.moe_route_softmax_triton(logits, 2, True, out=out)
    with ops.use_backend("auto"):
        got = moe.moe_route_softmax(logits, 2, True, out=out)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_route_refuses_more_experts_than_there_are():
    """top_k above E: the reference would return E columns; it refuses, under every backend."""
    logits = torch.randn(3, 4)
    for backend in ("native", "triton"):
        with ops.use_backend(backend), pytest.raises(InputError, match="top_k=5: from 1 to the 4 experts"):
            moe.moe_route_softmax(logits, 5, True)


# Routing calls the kernel cannot take, as changes to a served one (logits fp32 [3, 9], top_k 2): the logits and
# top_k, the argument at fault, and what the reference does: refuse the call by the same name, or (None) serve it.
ROUTE_MISFITS = {
    "logits-1d": (lambda: torch.randn(9), 2, "router_logits", "router_logits"),
    "logits-3d": (lambda: torch.randn(1, 3, 9), 2, "router_logits", "router_logits"),
    "top_k-0": (lambda: torch.randn(3, 9), 0, "top_k", "top_k"),
    "top_k-above-E": (lambda: torch.randn(3, 9), 10, "top_k", "top_k"),
    "top_k-float": (lambda: torch.randn(3, 9), 2.0, "top_k", "top_k"),
    "top_k-tensor": (lambda: torch.randn(3, 9), torch.tensor(2), "top_k", "top_k"),
    "top_k-bool": (lambda: torch.randn(3, 9), True, "top_k", "top_k"),
    "logits-float64": (lambda: torch.randn(3, 9).double(), 2, "router_logits", None),
    "logits-int64": (lambda: torch.randint(-3, 3, (3, 9)), 2, "router_logits", None),
    "E-above-max": (lambda: torch.randn(3, moe.MAX_ROUTED_EXPERTS + 1), 2, "router_logits", None),
    "top_k-above-max": (lambda: torch.randn(3, 80), moe.MAX_ROUTED_TOP_K + 1, "top_k", None),
}


@pytest.mark.parametrize("case", ROUTE_MISFITS, ids=str)
def test_route_refusal_names_the_argument(case):
    """One rule (`moe_route_softmax_refusal`) for the predicate, the provider called directly and the error of
    backend=triton (the reference's own where it refuses the call too): each call the kernel cannot take is
    refused naming the argument at fault, nothing written.
    The reference refuses the shapes it cannot compute with by the same name, and serves the others."""
    make, top_k, field, ref_field = ROUTE_MISFITS[case]
    logits = make()
    supports = moe.moe_route_softmax.providers["triton"].supports
    out = (torch.full((3, 2), NAN), torch.full((3, 2), -7, dtype=torch.int64))
    with ops.use_backend("triton"):
        assert supports(torch.randn(3, 9), 2, True)
        assert not supports(logits, top_k, True)
        assert_backend_refuses(moe.moe_route_softmax, field, logits, top_k, True, out=out)
        with pytest.raises(InputError, match=f"^{re.escape(field)}="):
            moe.moe_route_softmax_triton(logits, top_k, True, out=out)
    assert bool(out[0].isnan().all()) and bool((out[1] == -7).all())
    with ops.use_backend("native"):
        if ref_field is None:
            assert moe.moe_route_softmax(logits, top_k, True)[1].shape == (3, top_k)
        else:
            with pytest.raises(InputError, match=f"^{re.escape(ref_field)}="):
                moe.moe_route_softmax(logits, top_k, True)


# --- the references --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("shape", SHAPES[::2], ids=shape_id)
def test_fused_moe_reference_against_dense(shape, shared, dtype):
    n, e, k, h, i = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(n, h, generator=gen).to(dtype)
    w_gate_up, w_down = experts(e, h, i, dtype, gen)
    weights, ids = routing(n, e, k, gen)
    blend = shared_inputs(n, h, dtype, gen) if shared else {}
    got = moe.fused_moe(x, w_gate_up, w_down, weights, ids, **blend)
    assert got.dtype == dtype and got.shape == (n, h)
    scaled_close(got, dense_moe(x, w_gate_up, w_down, weights, ids, **blend), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[1::2], ids=shape_id)
def test_fused_moe_nvfp4_reference_against_dense(shape, dtype):
    n, e, k, h, i = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(n, h, generator=gen).to(dtype)
    q = nvfp4_experts(e, h, i, gen)
    weights, ids = routing(n, e, k, gen)
    blend = shared_inputs(n, h, dtype, gen)
    got = moe.fused_moe_nvfp4(x, **q, topk_weights=weights, topk_ids=ids, **blend)
    # dense from the fp32 dequantized weights rounded to x's dtype, as the reference defines
    w_gate_up, w_down = (w.to(dtype) for w in nvfp4_dense(q, i))
    scaled_close(got, dense_moe(x, w_gate_up, w_down, weights, ids, **blend), TOL[dtype])


def test_references_write_into_out():
    """`out` (and `workspace`) mean the same to the references as to the Triton providers: under `auto` a call
    with them that falls back to the reference (here, on the CPU) writes the result into `out` and returns it."""
    n, e, k, h, i = 3, 4, 2, 32, 32
    gen = torch.Generator().manual_seed(10)
    logits, x = torch.randn(n, e, generator=gen), torch.randn(n, h, generator=gen)
    w_gate_up, w_down = experts(e, h, i, torch.float32, gen)
    q = nvfp4_experts(e, h, i, gen)
    route_out = (torch.full((n, k), float("nan")), torch.full((n, k), -7, dtype=torch.int64))
    with ops.use_backend("auto"):
        weights, ids = moe.moe_route_softmax(logits, k, True, out=route_out)
        assert weights is route_out[0] and ids is route_out[1]
        assert all(torch.equal(a, b) for a, b in zip(route_out, moe.moe_route_softmax(logits, k, True)))
        for op, args in ((moe.fused_moe, dict(w_gate_up=w_gate_up, w_down=w_down)), (moe.fused_moe_nvfp4, q)):
            buffers = poisoned(n, h, k, i, x.dtype, x.device)
            got = op(x, **args, topk_weights=weights, topk_ids=ids, **buffers)
            assert got is buffers["out"]
            assert torch.equal(got, op(x, **args, topk_weights=weights, topk_ids=ids))


def test_shared_blend_needs_both_arguments():
    x = torch.randn(2, 32)
    w_gate_up, w_down = experts(4, 32, 32, torch.float32, torch.Generator().manual_seed(0))
    weights, ids = torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(InputError, match="together"):
        moe.fused_moe(x, w_gate_up, w_down, weights, ids, shared_out=x)


# --- the Triton providers --------------------------------------------------------------------------------

def run_triton(op, x, args: dict, k: int, inter: int) -> torch.Tensor:
    """The Triton provider's output, written into NaN-poisoned buffers."""
    buffers = poisoned(x.shape[0], x.shape[1], k, inter, x.dtype, x.device)
    with ops.use_backend("triton"):
        got = op(x, **args, **buffers)
    assert got is buffers["out"]
    return got


def run_both(op, x, args: dict, blend: dict, k: int, inter: int):
    """(provider output into NaN-poisoned buffers, reference output)."""
    return run_triton(op, x, {**args, **blend}, k, inter), op.reference(x, **args, **blend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fused_moe_triton_matches_reference(shape, shared, dtype):
    n, e, k, h, i = shape
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x = torch.randn(n, h, generator=gen).to(dtype)
    w_gate_up, w_down = experts(e, h, i, dtype, gen)
    weights, ids = routing(n, e, k, gen)
    off = unselected(e, ids)
    w_gate_up[off], w_down[off] = float("nan"), float("nan")
    blend = shared_inputs(n, h, dtype, gen) if shared else {}
    got, want = run_both(moe.fused_moe, x, dict(w_gate_up=w_gate_up, w_down=w_down, topk_weights=weights,
                                                topk_ids=ids), blend, k, i)
    scaled_close(got, want, TOL[dtype])


@NVFP4_PATHS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fused_moe_nvfp4_triton_matches_reference(shape, dtype, nvfp4_path):
    n, e, k, h, i = shape
    gen = torch.Generator().manual_seed(sum(shape) + 2)
    x = torch.randn(n, h, generator=gen).to(dtype)
    q = nvfp4_experts(e, h, i, gen)
    weights, ids = routing(n, e, k, gen)
    off = unselected(e, ids)
    q["gu_global"][off], q["dn_global"][off] = float("nan"), float("nan")
    shared = shape[0] != 3                                 # with and without the blend
    blend = shared_inputs(n, h, dtype, gen) if shared else {}
    got, want = run_both(moe.fused_moe_nvfp4, x, dict(**q, topk_weights=weights, topk_ids=ids), blend, k, i)
    scaled_close(got, want, TOL[dtype])


@pytest.mark.parametrize("capability,pdl", [((8, 9), False), ((9, 0), True)])
def test_moe_launches_with_pdl_only_at_few_rows_on_a_gpu_that_has_it(capability, pdl, monkeypatch):
    """The down kernel and the blend launch beside the kernel before them at up to GEMV_MAX_ROWS rows on sm_90 and
    later only (sm_89 runs the NVFP4 experts and has no `griddepcontrol`), never on the CPU, and not with the
    switch off."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    moe.has_pdl.cache_clear()
    try:
        x = torch.zeros(1, 16)
        assert moe.moe_pdl(x) is pdl
        assert moe.moe_pdl(torch.zeros(moe.GEMV_MAX_ROWS, 16)) is pdl
        assert moe.moe_pdl(torch.zeros(moe.GEMV_MAX_ROWS + 1, 16)) is False      # several waves of gate_up
        monkeypatch.setattr(moe, "MOE_PDL", False)
        assert moe.moe_pdl(x) is False
    finally:
        moe.has_pdl.cache_clear()
    monkeypatch.undo()
    assert moe.moe_pdl(torch.zeros(1, 16)) is False


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_up_rows,down_rows", [(8, 32), (16, 64), (32, 32)])
def test_fused_moe_nvfp4_gemvs_at_the_gpus_tiles(gate_up_rows, down_rows, dtype, monkeypatch):
    """The GEMVs at the tiles `_gemv_tiles` takes on a GPU (8, 16 or 32 rows of gate and up a program, 32 or 64 of
    down; the interpreter runs the largest, fewest programs), I 48 and H 80: tiles cut at the edge of I and H."""
    monkeypatch.setattr(moe, "_gemv_tiles", lambda *a: ((gate_up_rows, moe.GEMV_K_TILE), (down_rows, moe.GEMV_K_TILE)))
    n, e, k, h, i = 3, 9, 2, 80, 48
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(n, h, generator=gen).to(dtype)
    q = nvfp4_experts(e, h, i, gen)
    weights, ids = routing(n, e, k, gen)
    off = unselected(e, ids)
    q["gu_global"][off], q["dn_global"][off] = float("nan"), float("nan")
    got, want = run_both(moe.fused_moe_nvfp4, x, dict(**q, topk_weights=weights, topk_ids=ids), {}, k, i)
    scaled_close(got, want, TOL[dtype])


def test_fused_moe_triton_fp16_and_strided_rows():
    """fp16 activations, and x / shared_out / out given as row slices of wider tensors (a row stride != H), the
    gate [N, 1] a column of a transposed tensor (strides (1, N): the kernels read one gate a row, by its stride)."""
    n, e, k, h, i = 5, 6, 2, 32, 32
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(n, 2 * h, generator=gen).half()
    x = wide[:, h:]
    w_gate_up, w_down = experts(e, h, i, torch.float16, gen)
    weights, ids = routing(n, e, k, gen)
    blend = dict(shared_out=wide[:, :h], shared_gate=torch.randn(1, n, generator=gen).half().t())
    args = dict(w_gate_up=w_gate_up, w_down=w_down, topk_weights=weights, topk_ids=ids)
    got, want = run_both(moe.fused_moe, x, args, blend, k, i)
    scaled_close(got, want, TOL[torch.float16])
    wide_out = torch.full((n, 2 * h), float("nan"), dtype=torch.float16)
    with ops.use_backend("triton"):
        moe.fused_moe(x, **args, **blend, out=wide_out[:, :h])
    assert torch.equal(wide_out[:, :h], got) and bool(wide_out[:, h:].isnan().all())


@pytest.mark.parametrize("h,i", [(512, 32), (32, 512), (768, 32)], ids=["H512", "I512", "H768"])
@pytest.mark.parametrize("dtype,powers", [(torch.bfloat16, (-20, 0, 20)), (torch.float16, (-3, 0, 3))],
                         ids=["bf16", "fp16"])
def test_fused_moe_nvfp4_gemvs_16bit_x_over_whole_k_steps(dtype, powers, h, i):
    """The GEMVs' 16-bit path (x and h times 2^e, each block summed in fp16 pairs) over whole K steps of 256 (H 512
    and I 512: two steps of gate_up and of down, one iteration of their loop, the second step's words loaded during
    the first's sums; H 768: three, the loop's second iteration half past H, its x masked) and rows
    of x far apart in magnitude (times 2^powers: each row's own e keeps its sums in fp16's range; fp16 rows far
    smaller would leave the reference's outputs subnormal). Measured against the reference row by row (3 rows, 9
    experts, top-2, H 512 and I 256, seeds 11 and 12): 9e-4 to 1.4e-3 in fp16, 5e-3 to 1e-2 in bf16 (its rounding
    of h dominates); either kernel's next words loaded from the wrong step fail its shape. Interpreted, the fp16
    sums cost about 0.1 s a [32, 16] block tile: the shapes keep the other side small."""
    n, e, k = 3, 9, 1
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(n, h, generator=gen) * torch.tensor([2.0**p for p in powers])[:, None]).to(dtype)
    q = nvfp4_experts(e, h, i, gen)
    weights, ids = routing(n, e, k, gen)
    off = unselected(e, ids)
    q["gu_global"][off], q["dn_global"][off] = float("nan"), float("nan")
    got, want = run_both(moe.fused_moe_nvfp4, x, dict(**q, topk_weights=weights, topk_ids=ids), {}, k, i)
    for row in range(n):                                   # each row against its own scale
        scaled_close(got[row], want[row], TOL[dtype])


def test_fused_moe_triton_transposed_x():
    """x stored transposed (strides (1, N)) and no `out` given: the result is still [N, H] row by row."""
    n, e, k, h, i = 3, 4, 2, 32, 32
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(h, n, generator=gen).t()
    w_gate_up, w_down = experts(e, h, i, torch.float32, gen)
    weights, ids = routing(n, e, k, gen)
    with ops.use_backend("triton"):
        got = moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    scaled_close(got, moe.fused_moe.reference(x, w_gate_up, w_down, weights, ids), TOL[torch.float32])


def apart(t: torch.Tensor, fill) -> torch.Tensor:
    """t [E, R, C]'s values in a view of a wider tensor [E, R + 1, C + 8] filled with `fill`: its rows and its
    experts lie further apart than t's, and a read by t's own (contiguous) strides lands in the fill."""
    store = torch.full((t.shape[0], t.shape[1] + 1, t.shape[2] + 8), fill, dtype=t.dtype, device=t.device)
    return store[:, :t.shape[1], :t.shape[2]].copy_(t)


@FMT_PATHS
@pytest.mark.parametrize("e", [1, 4], ids=["one-candidate", "split"])
def test_triton_reads_the_experts_and_writes_out_by_their_strides(e, fmt, nvfp4_path):
    """The experts' weights (and NVFP4 block scales) with their rows and their experts further apart than
    contiguous ones (any strides but the last are taken), the gap filled with NaN (codes: 0x77, +-6 in both
    nibbles, where NaN has no code); the NVFP4 globals strided too ([E, 2] a transpose, [E] every other element);
    H 48 and I 32, so the rows' strides differ from both. `out` the first half of NaN rows twice as wide: one
    expert makes one candidate, whose down kernel stores `out` itself (E 4: split candidates, the blend kernel
    stores); the other half stays NaN. Against the reference at fp32's tolerance."""
    n, k, h, i = 3, 1 if e == 1 else 2, 48, 32
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(n, h, generator=gen)
    if fmt == "unq":
        op, args = moe.fused_moe, dict(zip(("w_gate_up", "w_down"),
                                           (apart(w, float("nan")) for w in experts(e, h, i, torch.float32, gen))))
    else:
        q = nvfp4_experts(e, h, i, gen)
        op, args = moe.fused_moe_nvfp4, {name: apart(q[name], 0x77 if "weight" in name else float("nan"))
                                         for name in ("gu_weight", "gu_scale", "dn_weight", "dn_scale")}
        args["gu_global"] = q["gu_global"].t().contiguous().t()
        args["dn_global"] = torch.stack([q["dn_global"], torch.full_like(q["dn_global"], float("nan"))], 1)[:, 0]
    args.update(zip(("topk_weights", "topk_ids"), routing(n, e, k, gen)), **shared_inputs(n, h, torch.float32, gen))
    wide = torch.full((n, 2 * h), float("nan"))
    with ops.use_backend("triton"):
        got = op(x, **args, out=wide[:, :h], workspace=torch.full((n * k, i), float("nan")))
    scaled_close(got, op.reference(x, **args), TOL[torch.float32])
    assert bool(wide[:, h:].isnan().all())


def nvfp4_exact(dense: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [E, R, K/2], e4m3 scales) of fp32 values [E, R, K] >= 0, each an E2M1 value times its block's
    scale in `scale` [E, R, K/16], which e4m3 holds exactly: no rounding anywhere (checked)."""
    table = torch.tensor(E2M1_VALUES)
    mag = dense / scale.repeat_interleave(16, dim=-1)
    codes = (mag[..., None] == table).int().argmax(dim=-1)
    assert torch.equal(table[codes], mag) and torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale.to(torch.float8_e4m3fn)


@FMT_PATHS
def test_triton_rounds_each_expert_output_to_bf16_before_weighting(fmt, nvfp4_path):
    """Exact, in bf16: one row, expert 2 of 4 with weight 1, whose down output is 1 + 3 * 2^-9 in fp32 (between
    bf16's 1 and 1 + 2^-7). Rounded to bf16 before it is weighted, as the reference rounds it, it is 1 + 2^-7,
    and the shared blend sigmoid(30) * -1 = -1 (sigmoid(30) is 1 in fp32) leaves 2^-7; unrounded it would leave
    3 * 2^-9. x is one-hot, gate 32 (silu(32) = 32 in fp32) and up 1/32 make h 1 at i = 0 and 16, and down's
    row 0 is 1 at i = 0 and 3 * 2^-9 at 16 (two NVFP4 blocks, each of its own scale): every value and sum is
    exact in bf16, NVFP4 and fp32. The other outputs are 0. Unquantized experts through the dot kernels (their
    only path), NVFP4 ones through the GEMVs and through the dot kernels."""
    n, e, k, h, i = 1, 4, 1, 32, 32
    x = torch.zeros(n, h, dtype=torch.bfloat16)
    x[0, 0] = 1
    w_gate_up, w_down = torch.zeros(e, 2 * i, h), torch.zeros(e, h, i)
    w_gate_up[:, [0, 16], 0], w_gate_up[:, [i, i + 16], 0] = 32.0, 1 / 32
    w_down[:, 0, 0], w_down[:, 0, 16] = 1.0, 3 * 2**-9
    if fmt == "unq":
        op, args = moe.fused_moe, dict(w_gate_up=w_gate_up.bfloat16(), w_down=w_down.bfloat16())
        off_names = ("w_gate_up", "w_down")
    else:
        # gate 32 = 4 * a block scale 8, up 1/32 = 1 * 2^-5; down over a global 2^-4: 1 = 4 * 4, 3 * 2^-9 = 3 * 2^-5
        gu_scale, dn_scale = torch.ones(e, 2 * i, h // 16), torch.ones(e, h, i // 16)
        gu_scale[:, [0, 16], 0], gu_scale[:, [i, i + 16], 0] = 8.0, 2**-5
        dn_scale[:, 0, 0], dn_scale[:, 0, 1] = 4.0, 2**-5
        gu_weight, gu_scale = nvfp4_exact(w_gate_up, gu_scale)
        dn_weight, dn_scale = nvfp4_exact(w_down / 2**-4, dn_scale)
        args = dict(gu_weight=gu_weight, gu_scale=gu_scale, gu_global=torch.ones(e, 2), dn_weight=dn_weight,
                    dn_scale=dn_scale, dn_global=torch.full((e,), 2**-4))
        dense_gu, dense_dn = nvfp4_dense(args, i)
        assert torch.equal(dense_gu, w_gate_up) and torch.equal(dense_dn, w_down)
        op, off_names = moe.fused_moe_nvfp4, ("gu_global", "dn_global")
    for name in off_names:
        args[name][[0, 1, 3]] = float("nan")
    shared_out = torch.zeros(n, h, dtype=torch.bfloat16)
    shared_out[0, 0] = -1
    blend = dict(shared_out=shared_out, shared_gate=torch.full((n, 1), 30.0, dtype=torch.bfloat16))
    routed = dict(topk_weights=torch.ones(n, k), topk_ids=torch.tensor([[2]]))
    got, want = run_both(op, x, {**args, **routed}, blend, k, i)
    expected = torch.zeros(n, h, dtype=torch.bfloat16)
    expected[0, 0] = 2**-7
    assert torch.equal(want, expected) and torch.equal(got, expected)


def far_rows(n: int, cols: int, dtype, device) -> torch.Tensor:
    """[n, cols] of NaN, rows 2^30 elements apart (row 2 from element 2^31 on), in a storage of which only these
    rows are written (torch.empty maps its pages when they are touched)."""
    t = torch.empty(2**30 * (n - 1) + cols, dtype=dtype, device=device).as_strided((n, cols), (2**30, 1))
    return t.fill_(float("nan"))


def check_far_rows(fmt: str, device: str) -> None:
    """The routing's logits, and the MoE's x, shared_out and out, with rows 2^30 elements apart: row 2's offsets
    pass int32's range, so the kernels compute rows' offsets in int64 (in int32 they wrapped to 2^32 elements
    before the row: a crash, or a read of other memory). Against the reference on the same values."""
    n, e, k, h, i = 3, 4, 2, 32, 32
    gen = torch.Generator(device).manual_seed(9)
    op, args = moe_call(fmt, (n, e, k, h, i), torch.bfloat16, gen)
    logits = torch.randn(n, e, generator=gen, device=device)
    far = {name: far_rows(n, h, torch.bfloat16, device).copy_(args[name]) for name in ("x", "shared_out")}
    out, far_logits = far_rows(n, h, torch.bfloat16, device), far_rows(n, e, torch.float32, device).copy_(logits)
    with ops.use_backend("triton"):
        assert op(**{**args, **far}, out=out) is out
        weights, ids = moe.moe_route_softmax(far_logits, k, True)
    scaled_close(out, op.reference(**args), TOL[torch.bfloat16])
    want_weights, want_ids = moe.moe_route_softmax(logits, k, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=1e-6)


@FMT_PATHS
def test_triton_rows_past_int32_offsets(fmt, nvfp4_path):
    check_far_rows(fmt, "cpu")


# Buffers that do not fit a call with N 3, k 2, H 32, I 32 in fp32: out [3, 32] (rows may be strided),
# workspace [6, 32] contiguous.
BAD_BUFFERS = {
    "out-shape": ("out", lambda: torch.full((3, 16), 7.0)),
    "out-dtype": ("out", lambda: torch.full((3, 32), 7.0, dtype=torch.bfloat16)),
    "out-columns-strided": ("out", lambda: torch.full((32, 3), 7.0).t()),
    "workspace-small": ("workspace", lambda: torch.full((5, 32), 7.0)),
    "workspace-strided": ("workspace", lambda: torch.full((32, 6), 7.0).t()),
}


@pytest.mark.parametrize("backend", ["triton", "native"])
@pytest.mark.parametrize("case", BAD_BUFFERS, ids=str)
def test_fused_moe_refuses_buffers_that_do_not_fit(case, backend):
    """Both providers refuse, naming the buffer, and write nothing (the kernels would index out of it)."""
    field, make = BAD_BUFFERS[case]
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 32, generator=gen)
    w_gate_up, w_down = experts(4, 32, 32, torch.float32, gen)
    weights, ids = routing(3, 4, 2, gen)
    buffers = dict(out=torch.full((3, 32), 7.0), workspace=torch.full((6, 32), 7.0))
    buffers[field] = make()
    with ops.use_backend(backend), pytest.raises(InputError, match=f"^{field}="):
        moe.fused_moe(x, w_gate_up, w_down, weights, ids, **buffers)
    assert all(bool((t == 7).all()) for t in buffers.values())


def padded_experts(fmt: str, e: int, h: int, i: int, gen) -> tuple[object, dict[str, torch.Tensor]]:
    """(op, its weight arguments) for E experts stored as the middle of E + 2, the two neighbours NaN: a
    provider that reads expert -1 or E reads NaN."""
    if fmt == "unq":
        w_gate_up, w_down = experts(e + 2, h, i, torch.float32, gen)
        for w in (w_gate_up, w_down):
            w[0], w[-1] = float("nan"), float("nan")
        return moe.fused_moe, dict(w_gate_up=w_gate_up[1:-1], w_down=w_down[1:-1])
    q = nvfp4_experts(e + 2, h, i, gen)
    for name in ("gu_global", "dn_global"):
        q[name][0], q[name][-1] = float("nan"), float("nan")
    return moe.fused_moe_nvfp4, {name: t[1:-1] for name, t in q.items()}


@FMT_PATHS
@pytest.mark.parametrize("e", [4, 9], ids=["by-expert", "by-pair"])
def test_triton_skips_expert_ids_out_of_range(e, fmt, nvfp4_path):
    """Ids -1 and E contribute nothing and read nothing outside the weights; valid pairs match the reference."""
    n, k, h, i = 3, 2, 32, 32
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(n, h, generator=gen)
    op, args = padded_experts(fmt, e, h, i, gen)
    weights, ids = routing(n, e, k, gen)
    bad_ids = ids.clone()
    bad_ids[0, 1], bad_ids[1, 0] = -1, e
    got = run_triton(op, x, dict(**args, topk_weights=weights, topk_ids=bad_ids), k, i)
    want = op.reference(x, **args, topk_weights=weights.masked_fill(bad_ids != ids, 0.0), topk_ids=ids)
    scaled_close(got, want, TOL[torch.float32])


@pytest.mark.parametrize("bad_id", [-1, 4])
def test_reference_refuses_expert_ids_out_of_range(bad_id):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 32, generator=gen)
    w_gate_up, w_down = experts(4, 32, 32, torch.float32, gen)
    weights, ids = routing(3, 4, 2, gen)
    ids[1, 1] = bad_id
    with pytest.raises(InputError, match=f"topk_ids={bad_id}: expert ids lie in \\[0, 4\\)"):
        moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    with pytest.raises(InputError, match=f"topk_ids={bad_id}: expert ids lie in \\[0, 4\\)"):
        moe.fused_moe_nvfp4(x, **nvfp4_experts(4, 32, 32, gen), topk_weights=weights, topk_ids=ids)


@FMT_PATHS
@pytest.mark.parametrize("e", [4, 12], ids=["by-expert", "by-pair"])
def test_fused_moe_triton_repeated_ids_in_a_row(e, fmt, nvfp4_path):
    """A row that names an expert twice or three times (k 3) gets the reference's result, the expert
    weighted by the sum; the kernels keep one workspace row for it (the last row's would lie past the end)."""
    n, k, h, i = 3, 3, 32, 32
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(n, h, generator=gen)
    if fmt == "unq":
        op, args = moe.fused_moe, dict(zip(("w_gate_up", "w_down"), experts(e, h, i, torch.float32, gen)))
    else:
        op, args = moe.fused_moe_nvfp4, nvfp4_experts(e, h, i, gen)
    weights, ids = routing(n, e, k, gen)
    ids[1, 1] = ids[1, 0]
    ids[2] = ids[2, 0]
    got, want = run_both(op, x, dict(**args, topk_weights=weights, topk_ids=ids), {}, k, i)
    scaled_close(got, want, TOL[torch.float32])


def check_nonfinite_expert(fmt: str, where: str, e: int, device: str) -> None:
    """An Inf in the weights of expert 1, which only row 1 chose, reaches row 1 and no other: rows 0 and 2 match
    the reference over the same experts without the Inf (the NVFP4 reference refuses a non-finite weight, so the
    clean experts are its oracle for both formats). Unselected experts are NaN, outputs poisoned."""
    n, k, h, i = 3, 2, 32, 32
    gen = torch.Generator(device).manual_seed(16)
    x = torch.randn(n, h, generator=gen, device=device)
    ids = torch.tensor([[0, 2], [1, 2], [2, 3]], device=device)
    weights = torch.softmax(torch.randn(n, k, generator=gen, device=device), dim=-1)
    off = unselected(e, ids)
    if fmt == "unq":
        op = moe.fused_moe
        w_gate_up, w_down = experts(e, h, i, torch.float32, gen)
        args = dict(w_gate_up=w_gate_up, w_down=w_down)
        names = ("w_gate_up", "w_down")
    else:
        op = moe.fused_moe_nvfp4
        args = nvfp4_experts(e, h, i, gen)
        names = ("gu_global", "dn_global")
    for name in names:
        args[name][off] = float("nan")
    bad = dict(args)
    name = names[0] if where == "gate_up" else names[1]
    bad[name] = args[name].clone()
    bad[name][1].view(-1)[0] = float("inf")               # unq: one weight; NVFP4: the expert's gate or down global
    got = run_triton(op, x, dict(**bad, topk_weights=weights, topk_ids=ids), k, i)
    want = op.reference(x, **args, topk_weights=weights, topk_ids=ids)
    others = torch.tensor([0, 2], device=device)
    scaled_close(got[others], want[others], TOL[torch.float32])
    assert not bool(got[1].isfinite().all())              # the Inf did go in


@pytest.mark.parametrize("where", ["gate_up", "down"])
@FMT_PATHS
@pytest.mark.parametrize("e", [4, 9], ids=["by-expert", "by-pair"])
def test_triton_nonfinite_expert_stays_in_its_rows(e, fmt, where, nvfp4_path):
    check_nonfinite_expert(fmt, where, e, "cpu")


def moe_call(fmt: str, shape, dtype, gen) -> tuple[object, dict[str, torch.Tensor]]:
    """(op, every argument) of a MoE call with the shared blend, shape (N, E, k, H, I), experts unquantized
    ("unq") or NVFP4, on gen's device; experts no row selected are NaN (their weights or NVFP4 globals), so a
    provider that reads one fails."""
    n, e, k, h, i = shape
    args = dict(x=torch.randn(n, h, generator=gen, device=gen.device).to(dtype))
    if fmt == "unq":
        args["w_gate_up"], args["w_down"] = experts(e, h, i, dtype, gen)
    else:
        args.update(nvfp4_experts(e, h, i, gen))
    logits = torch.randn(n, e, generator=gen, device=gen.device)
    args["topk_weights"], args["topk_ids"] = moe.moe_route_softmax(logits, k, True)
    off = unselected(e, args["topk_ids"])
    for name in ("w_gate_up", "w_down") if fmt == "unq" else ("gu_global", "dn_global"):
        args[name][off] = float("nan")
    args.update(shared_inputs(n, h, dtype, gen))
    return (moe.fused_moe if fmt == "unq" else moe.fused_moe_nvfp4), args


# Past one group of 32 rows (N 40 and 33: two groups, candidates by expert id and by (row, slot) pair; the
# row grouping is the same code for both formats) and past one tile along H and I (144: three 64-wide output
# tiles, two 128-wide chunks of H and of I, five 32-wide tiles of I). Interpreted, a case takes 0.5-2 s.
@pytest.mark.parametrize("fmt,shape,dtype,nvfp4_path", [
    ("unq", (40, 4, 2, 32, 32), torch.bfloat16, "gemv"), ("unq", (33, 33, 1, 32, 32), torch.float32, "gemv"),
    ("unq", (3, 4, 2, 144, 144), torch.bfloat16, "gemv"), ("nvfp4", (2, 4, 1, 144, 144), torch.bfloat16, "gemv"),
    ("nvfp4", (2, 4, 1, 144, 144), torch.bfloat16, "dot")], indirect=["nvfp4_path"],
    ids=lambda v: shape_id(v) if isinstance(v, tuple) else str(v).removeprefix("torch."))
def test_triton_past_one_row_group_and_one_tile(fmt, shape, dtype, nvfp4_path):
    op, args = moe_call(fmt, shape, dtype, torch.Generator().manual_seed(sum(shape)))
    got, want = run_both(op, args.pop("x"), args, {}, shape[2], shape[4])
    scaled_close(got, want, TOL[dtype])


def nvfp4_sized(h: int, i: int) -> dict[str, torch.Tensor]:
    """The NVFP4 arguments of a call at N 3, E 4 resized to H, I (x, shared_out and the experts; H/16 and I/16 rounded
    down where they are not whole, as a caller's arithmetic would)."""
    return dict(x=torch.zeros(3, h), shared_out=torch.zeros(3, h),
                gu_weight=torch.zeros(4, 2 * i, h // 2, dtype=torch.uint8),
                gu_scale=torch.zeros(4, 2 * i, h // 16).to(torch.float8_e4m3fn),
                dn_weight=torch.zeros(4, h, i // 2, dtype=torch.uint8),
                dn_scale=torch.zeros(4, h, i // 16).to(torch.float8_e4m3fn))


def strided(shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """Zeros of `shape` whose last two dims are swapped in memory (the last dim not of unit stride)."""
    return torch.zeros(*shape[:-2], shape[-1], shape[-2]).to(dtype).transpose(-1, -2)


def as_double(args: dict) -> dict:
    return {name: args[name].double() for name in ("x", "w_gate_up", "w_down", "shared_out", "shared_gate")}


E4M3 = torch.float8_e4m3fn
# Calls the MoE kernels cannot take, as changes to a served call at N 3, E 4, k 2, H 32, I 32 (fp32, with the shared
# blend): (format, the arguments that replace the call's (from its arguments), the argument at fault, what the
# reference does: refuse the call by that name (a regex; `dequantize_nvfp4` names an expert's tensor), or (None)
# serve it).
MISFITS = {
    "x-1d": ("unq", lambda a: dict(x=torch.zeros(32)), "x", "x"),
    "x-3d": ("unq", lambda a: dict(x=torch.zeros(1, 3, 32)), "x", "x"),
    "x-float64": ("unq", as_double, "x", None),
    "x-H-not-the-experts": ("unq", lambda a: dict(x=torch.zeros(3, 16), shared_out=torch.zeros(3, 16)), "w_gate_up",
                            "w_gate_up"),
    "x-rows-not-the-ids": ("unq", lambda a: dict(x=torch.zeros(2, 32)), "topk_ids", "topk_ids"),
    "ids-fewer-rows-than-x": ("unq", lambda a: dict(topk_ids=a["topk_ids"][:2], topk_weights=a["topk_weights"][:2]),
                              "topk_ids", None),
    "no-expert-per-row": ("unq", lambda a: dict(topk_weights=torch.ones(3, 0),
                                                topk_ids=torch.zeros(3, 0, dtype=torch.int64)), "topk_ids", None),
    "ids-float": ("unq", lambda a: dict(topk_ids=a["topk_ids"].float()), "topk_ids", "topk_ids"),
    "ids-int16": ("unq", lambda a: dict(topk_ids=a["topk_ids"].to(torch.int16)), "topk_ids", None),
    "weights-not-ids-shape": ("unq", lambda a: dict(topk_weights=torch.ones(3, 1)), "topk_weights", "topk_weights"),
    "weights-wider-than-ids": ("unq", lambda a: dict(topk_weights=torch.ones(3, 3)), "topk_weights", None),
    "weights-int64": ("unq", lambda a: dict(topk_weights=torch.ones(3, 2, dtype=torch.int64)), "topk_weights", None),
    "shared_out-H": ("unq", lambda a: dict(shared_out=torch.zeros(3, 16)), "shared_out", "shared_out"),
    "shared_out-columns-strided": ("unq", lambda a: dict(shared_out=strided((3, 32))), "shared_out", None),
    "gate-per-element": ("unq", lambda a: dict(shared_gate=torch.zeros(3, 32)), "shared_gate", None),
    "gate-bf16": ("unq", lambda a: dict(shared_gate=torch.zeros(3, 1, dtype=torch.bfloat16)), "shared_gate", None),
    "gate-1d-rows-equal-H": ("unq", lambda a: dict(x=torch.zeros(32, 32), shared_out=torch.zeros(32, 32),
                                                   shared_gate=torch.zeros(32),
                                                   topk_ids=a["topk_ids"].repeat(11, 1)[:32],
                                                   topk_weights=a["topk_weights"].repeat(11, 1)[:32]),
                             "shared_gate", "shared_gate"),
    "gate_up-odd-rows": ("unq", lambda a: dict(w_gate_up=torch.zeros(4, 65, 32)), "w_gate_up", "w_gate_up"),
    "gate_up-bf16": ("unq", lambda a: dict(w_gate_up=a["w_gate_up"].bfloat16()), "w_gate_up", "w_gate_up"),
    "gate_up-H-strided": ("unq", lambda a: dict(w_gate_up=strided((4, 64, 32))), "w_gate_up", None),
    "no-experts": ("unq", lambda a: dict(w_gate_up=torch.zeros(0, 64, 32), w_down=torch.zeros(0, 32, 32)),
                   "w_gate_up", "topk_ids"),
    "down-I-not-gate_up": ("unq", lambda a: dict(w_down=torch.zeros(4, 32, 16)), "w_down", "w_down"),
    "down-H-not-x": ("unq", lambda a: dict(w_down=torch.zeros(4, 16, 32)), "w_down", "w_down"),
    "down-E-more-than-gate_up": ("unq", lambda a: dict(w_down=torch.zeros(5, 32, 32)), "w_down", None),
    "down-E-fewer-than-gate_up": ("unq", lambda a: dict(w_down=torch.zeros(3, 32, 32)), "w_down", "w_down"),
    "down-I-strided": ("unq", lambda a: dict(w_down=strided((4, 32, 32))), "w_down", None),
    "nvfp4-H-40": ("nvfp4", lambda a: nvfp4_sized(40, 32), "x", r"experts\.\d+\.gate_proj\.weight"),
    "nvfp4-I-24": ("nvfp4", lambda a: nvfp4_sized(32, 24), "gu_weight", r"experts\.\d+\.down_proj\.weight"),
    "nvfp4-x-H-not-the-experts": ("nvfp4", lambda a: dict(x=torch.zeros(3, 48), shared_out=torch.zeros(3, 48)),
                                  "gu_weight", "gu_weight"),
    "nvfp4-gu_weight-int8": ("nvfp4", lambda a: dict(gu_weight=a["gu_weight"].view(torch.int8)), "gu_weight",
                             "gu_weight"),
    "nvfp4-gu_scale-float32": ("nvfp4", lambda a: dict(gu_scale=a["gu_scale"].float()), "gu_scale", None),
    "nvfp4-gu_scale-strided": ("nvfp4", lambda a: dict(gu_scale=strided((4, 64, 2), E4M3)), "gu_scale", None),
    "nvfp4-gu_global-per-expert": ("nvfp4", lambda a: dict(gu_global=torch.ones(4)), "gu_global", "gu_global"),
    "nvfp4-gu_global-3-columns": ("nvfp4", lambda a: dict(gu_global=torch.ones(4, 3)), "gu_global", None),
    "nvfp4-dn_weight-E-fewer": ("nvfp4", lambda a: dict(dn_weight=a["dn_weight"][:3]), "dn_weight", "dn_weight"),
    "nvfp4-dn_weight-strided": ("nvfp4", lambda a: dict(dn_weight=strided((4, 32, 16), torch.uint8)), "dn_weight",
                                None),
    "nvfp4-dn_scale-rows": ("nvfp4", lambda a: dict(dn_scale=torch.zeros(4, 16, 2).to(E4M3)), "dn_scale", "dn_scale"),
    "nvfp4-dn_scale-E-fewer": ("nvfp4", lambda a: dict(dn_scale=a["dn_scale"][:3]), "dn_scale", "dn_scale"),
    "nvfp4-dn_global-E-more": ("nvfp4", lambda a: dict(dn_global=torch.ones(5)), "dn_global", None),
    "nvfp4-gu_weight-off-a-word": ("nvfp4", lambda a: dict(gu_weight=off_a_word(a["gu_weight"])), "gu_weight", None),
    "nvfp4-dn_weight-rows-18-bytes-apart": ("nvfp4", lambda a: dict(dn_weight=rows_apart(a["dn_weight"], 18)),
                                            "dn_weight", None),
    "nvfp4-dn_global-int64": ("nvfp4", lambda a: dict(dn_global=torch.ones(4, dtype=torch.int64)), "dn_global",
                              "dn_global"),
    "nvfp4-gu_global-3-d": ("nvfp4", lambda a: dict(gu_global=torch.ones(4, 2, 2)), "gu_global", "gu_global"),
}


def off_a_word(codes: torch.Tensor) -> torch.Tensor:
    """codes' values, from byte 1 of their storage: the kernels read codes as int32 words, the reference any."""
    return torch.cat([codes.new_zeros(1), codes.flatten()])[1:].view(codes.shape)


def rows_apart(codes: torch.Tensor, stride: int) -> torch.Tensor:
    """codes' values with their rows `stride` bytes apart."""
    wide = codes.new_zeros(*codes.shape[:-1], stride)
    wide[..., :codes.shape[-1]] = codes
    return wide[..., :codes.shape[-1]]


@pytest.mark.parametrize("case", MISFITS, ids=str)
def test_moe_refusal_names_the_argument(case):
    """One rule per op (`fused_moe_refusal`, `fused_moe_nvfp4_refusal`) for the predicate, the provider called
    directly and the error of backend=triton (the reference's own where it refuses the call too): each call the
    kernels cannot take (the call it was changed from is served) is refused naming the argument at fault, nothing
    written into `out` or `workspace`. The reference
    refuses by name the shapes it cannot compute with (never a torch error from inside), and serves the others."""
    fmt, change, field, ref_field = MISFITS[case]
    op, args = moe_call(fmt, (3, 4, 2, 32, 32), torch.float32, torch.Generator().manual_seed(14))
    bad = {**args, **change(args)}
    buffers = poisoned(3, 32, 2, 32, torch.float32, "cpu")
    supports = op.providers["triton"].supports
    with ops.use_backend("triton"):
        assert supports(**args)
        assert not supports(**bad)
        assert_backend_refuses(op, field, **bad, **buffers)   # the reference's error where it refuses too
        with pytest.raises(InputError, match=f"^{re.escape(field)}="):
            getattr(moe, f"{op.name}_triton")(**bad, **buffers)          # the provider, called directly
    assert all(bool(t.isnan().all()) for t in buffers.values())
    with ops.use_backend("native"):
        if ref_field is None:
            assert op(**bad).shape == bad["x"].shape
        else:
            with pytest.raises(MtpfError, match=f"^{ref_field}="):
                op(**bad)


def test_triton_backend_refuses_what_it_cannot_serve():
    """Weights in another dtype than x: wrong under every backend, so backend=triton raises the reference's
    error naming them; an fp64 call, which the reference serves and no provider does, gets the backend's."""
    x = torch.randn(2, 32)
    w_gate_up, w_down = experts(4, 32, 32, torch.bfloat16, torch.Generator().manual_seed(0))
    ids = torch.zeros(2, 1, dtype=torch.int64)
    with ops.use_backend("triton"), pytest.raises(InputError, match=r"^w_gate_up='bfloat16 \[4, 64, 32\]'"):
        moe.fused_moe(x, w_gate_up, w_down, torch.ones(2, 1), ids)
    with ops.use_backend("triton"), pytest.raises(ConfigError, match="op fused_moe has no triton provider"):
        moe.fused_moe(x.double(), w_gate_up.double(), w_down.double(), torch.ones(2, 1), ids)


# --- the real Qwen3-Next shape, on the GPU ---------------------------------------------------------------

QWEN3_NEXT = dict(e=512, k=10, h=2048, i=512)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@needs_cuda
@pytest.mark.parametrize("n", [1, 8, 32])
def test_route_triton_qwen3_next_gpu(n):
    gen = torch.Generator("cuda").manual_seed(n)
    logits = torch.randn(n, QWEN3_NEXT["e"], generator=gen, device="cuda").bfloat16()  # bf16: real ties
    want = moe.moe_route_softmax(logits, QWEN3_NEXT["k"], True)
    with ops.use_backend("triton"):
        got = moe.moe_route_softmax(logits, QWEN3_NEXT["k"], True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)


@gpu
@needs_cuda
@FMT_PATHS
@pytest.mark.parametrize("n", [1, 8, 32, 40])
def test_fused_moe_triton_qwen3_next_gpu(n, fmt, nvfp4_path):
    e, k, h, i = QWEN3_NEXT.values()
    op, args = moe_call(fmt, (n, e, k, h, i), torch.bfloat16, torch.Generator("cuda").manual_seed(n))
    got, want = run_both(op, args.pop("x"), args, {}, k, i)
    scaled_close(got, want, TOL[torch.bfloat16])


@gpu
@needs_cuda
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_route_triton_nonfinite_logits_gpu(k, renormalize):
    """On the GPU `tl.max` has its own NaN rule; the ranking must not depend on it."""
    for dtype in DTYPES + [torch.float16]:
        check_route_nonfinite(k, renormalize, dtype, "cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("where", ["gate_up", "down"])
@FMT_PATHS
@pytest.mark.parametrize("e", [4, 9], ids=["by-expert", "by-pair"])
def test_triton_nonfinite_expert_stays_in_its_rows_gpu(e, fmt, where, nvfp4_path):
    check_nonfinite_expert(fmt, where, e, "cuda")


@pytest.mark.gpu_memory
@gpu
@needs_cuda
@FMT_PATHS
def test_triton_rows_past_int32_offsets_gpu(fmt, nvfp4_path):
    check_far_rows(fmt, "cuda")


def _small_moe(seed: int) -> dict:
    """fused_moe's operands at N = 3, E = 4, top_k 2, H = I = 32, fp32, with the shared blend."""
    gen = torch.Generator().manual_seed(seed)
    w_gate_up, w_down = experts(4, 32, 32, torch.float32, gen)
    weights, ids = routing(3, 4, 2, gen)
    return dict(x=torch.randn(3, 32, generator=gen), w_gate_up=w_gate_up, w_down=w_down, topk_weights=weights,
                topk_ids=ids, **shared_inputs(3, 32, torch.float32, gen))


@pytest.mark.parametrize("into", ["x", "x a row on", "shared_out"])
def test_fused_moe_triton_out_over_x_or_in_place_on_the_shared_output(into):
    """x is read only by the gate_up launch, which ends before any launch writes out, so out may overlap it
    anyhow (x itself, or a row past its start); each element of the shared output is read just before the same
    program writes that element of out, so out may be it itself. The provider takes them and gives the
    reference's answer."""
    a = _small_moe(14)
    want = moe.fused_moe.reference(**a)
    if into == "x a row on":
        buf = torch.cat([a["x"].flatten(), torch.randn(32)])
        a["x"], out = buf[:96].view(3, 32), buf[32:].view(3, 32)
    else:
        out = a[into]
    with ops.use_backend("triton"):
        assert moe.fused_moe(**a, out=out) is out
    scaled_close(out, want, TOL[torch.float32])


@pytest.mark.parametrize("shares", ["shared_out", "topk_weights", "w_down", "dn_weight"])
def test_an_out_the_kernels_still_read_is_left_to_the_reference(shares):
    """out a row past the shared output's start (the program writing row 0 overwrote row 1's shared output
    before it was read: off by 1.06 of the largest), over the routing weights, or over the down experts (NVFP4's
    codes too), which the down kernel reads while it writes out where it runs as one split (a large grid; this
    one runs in several, which the blend sums after): the provider refuses it naming both, writing nothing;
    `auto` runs the reference, which computes before it writes."""
    a = _small_moe(15)
    op = moe.fused_moe
    if shares == "shared_out":
        buf = torch.cat([a["shared_out"].flatten(), torch.randn(32)])
        a["shared_out"], out = buf[:96].view(3, 32), buf[32:].view(3, 32)
    elif shares == "topk_weights":
        out = torch.randn(3, 32)
        a["topk_weights"] = out.view(-1)[:6].view(3, 2).copy_(a["topk_weights"])
    elif shares == "w_down":
        out = a["w_down"].view(-1)[:96].view(3, 32)
    else:
        op = moe.fused_moe_nvfp4
        del a["w_gate_up"], a["w_down"]
        a.update(nvfp4_experts(4, 32, 32, torch.Generator().manual_seed(16)))
        out = a["dn_weight"].view(-1)[: 96 * 4].view(torch.float32).view(3, 32)
    want = op.reference(**{n: t.clone() for n, t in a.items()})
    assert_overlap_refused(op, "out", shares, **a, out=out)
    with pytest.raises(InputError, match=f"^out='memory shared with {shares}'"):
        (moe.fused_moe_triton if op is moe.fused_moe else moe.fused_moe_nvfp4_triton)(**a, out=out)
    with ops.use_backend("auto"):
        assert torch.equal(op(**a, out=out), want)


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("shares", ["out", "x", "shared_out"])
def test_a_workspace_sharing_memory_with_an_operand_is_refused(backend, shares):
    """The kernels write the workspace while they read x and shared_out and write out: one sharing their memory
    gave wrong results (0.95 relative error at one token, top_k 1, H = I = 128). Refused under every backend,
    nothing written."""
    n, e, h, i = 1, 4, 128, 128
    g = torch.Generator().manual_seed(5)
    x, shared_out = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    w_gate_up, w_down = experts(e, h, i, torch.float32, g)
    out = torch.full((n, h), NAN)
    workspace = {"out": out, "x": x, "shared_out": shared_out}[shares].view(n, i)
    before = workspace.clone()
    with ops.use_backend(backend), pytest.raises(InputError, match=rf"^workspace='memory shared with {shares}'"):
        moe.fused_moe(x, w_gate_up, w_down, torch.ones(n, 1), torch.tensor([[2]]), shared_out, torch.zeros(n, 1),
                      out=out, workspace=workspace)
    assert bool(out.isnan().all()) and (shares == "out" or torch.equal(workspace, before))


@gpu
@needs_cuda
def test_gpu_route_weights_in_place_on_the_logits():
    """The weights the logits themselves (fp32, top_k = E at the kernel's largest top_k), 4096 rows: bit for bit
    the provider's answer into buffers of their own."""
    k = moe.MAX_ROUTED_TOP_K
    logits = torch.randn(4096, k, generator=torch.Generator("cuda").manual_seed(3), device="cuda")
    with ops.use_backend("triton"):
        want_weights, want_ids = moe.moe_route_softmax(logits, k, True)
        weights, ids = moe.moe_route_softmax(logits, k, True, out=(logits, torch.empty_like(want_ids)))
    assert weights is logits and torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@gpu
@needs_cuda
@FMT_PATHS
@pytest.mark.parametrize("into", ["x", "shared_out"])
@pytest.mark.parametrize("n", [8, 40])
def test_gpu_fused_moe_out_over_x_or_in_place_on_the_shared_output(n, into, fmt, nvfp4_path):
    """out x or the shared output itself at Qwen3-Next's size: bit for bit the provider's answer into a buffer of
    its own."""
    e, k, h, i = QWEN3_NEXT.values()
    op, args = moe_call(fmt, (n, e, k, h, i), torch.bfloat16, torch.Generator("cuda").manual_seed(n))
    want = run_triton(op, args["x"], {a: t for a, t in args.items() if a != "x"}, k, i)
    out = args[into]
    with ops.use_backend("triton"):
        assert op(**args, out=out) is out
    assert torch.equal(out, want)
