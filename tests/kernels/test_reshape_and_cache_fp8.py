"""reshape_and_cache_fp8: the reference against hand-computed values, and the Triton provider against the
reference, bit for bit. The provider rounds fp32 -> E4M3 in integer math, so it is exact under the
interpreter too (whose own fp32 -> fp8 cast rounds 1.0625 to 1.125, DESIGN 4): no tolerance anywhere."""

from __future__ import annotations

import os

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError, MtpfError
from mtpfactory.kernels.reshape_and_cache_fp8 import reshape_and_cache_fp8, reshape_and_cache_fp8_triton
from backend_refusal import assert_backend_refuses

FP8 = torch.float8_e4m3fn
NAN_CODE = 0x7F  # E4M3 (fn) NaN: the poison every unwritten byte must keep

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def _fp8_cache(nb: int, bs: int, h: int, d: int, device="cpu") -> torch.Tensor:
    return torch.full((nb, bs, h, d), NAN_CODE, dtype=torch.uint8, device=device).view(FP8)


def _scale_cache(nb: int, bs: int, h: int, device="cpu") -> torch.Tensor:
    return torch.full((nb, bs, h), float("nan"), device=device)


def _run(backend: str, k, v, slots, nb, bs, k_scaled: bool, v_scaled: bool):
    """Write into NaN-poisoned caches under `backend`; returns (K bytes, V bytes, K scales, V scales)."""
    h, d = k.shape[1:]
    kc, vc = _fp8_cache(nb, bs, h, d, k.device), _fp8_cache(nb, bs, h, d, k.device)
    ks = _scale_cache(nb, bs, h, k.device) if k_scaled else None
    vs = _scale_cache(nb, bs, h, k.device) if v_scaled else None
    with ops.use_backend(backend):
        reshape_and_cache_fp8(k, v, kc, vc, slots, ks, vs)
    return kc.view(torch.uint8), vc.view(torch.uint8), ks, vs


def _assert_same(a, b) -> None:
    for x, y in zip(a, b):
        if x is None:
            assert y is None
        elif x.dtype == torch.uint8:
            assert torch.equal(x, y), f"{(x != y).sum().item()} bytes differ"
        else:  # fp32 scales: bitwise, NaN poison included
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))


# --- the reference ------------------------------------------------------------------------------------

def test_reference_unit_scales_clamps_and_rounds_to_nearest_even():
    x = torch.tensor([1.0625, 1.1875, -500.0, 448.0, 2.0**-10, 3 * 2.0**-10, 0.0, 17.0])  # 2 ties, clamps,
    k = x.view(1, 1, -1)                                                                     # subnormal ties
    kc, vc = _fp8_cache(3, 2, 1, x.numel()), _fp8_cache(3, 2, 1, x.numel())
    reshape_and_cache_fp8(k, k, kc, vc, torch.tensor([3]))
    expect = torch.tensor([1.0, 1.25, -448.0, 448.0, 0.0, 2 * 2.0**-9, 0.0, 16.0])
    assert torch.equal(kc[1, 1, 0].float(), expect) and torch.equal(vc[1, 1, 0].float(), expect)
    assert (kc.view(torch.uint8)[torch.arange(3) != 1] == NAN_CODE).all()  # other slots untouched
    assert (kc.view(torch.uint8)[1, 0] == NAN_CODE).all()


def test_reference_per_token_scales():
    k = torch.tensor([[[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]],
                      [[300.0, 600.0, -900.0, 1.0], [1e-3, 0.0, 0.0, -4e-3]]])  # [N=2, kv_heads=2, D=4]
    kc, vc, ks, vs = _fp8_cache(2, 4, 2, 4), _fp8_cache(2, 4, 2, 4), _scale_cache(2, 4, 2), _scale_cache(2, 4, 2)
    reshape_and_cache_fp8(k, -k, kc, vc, torch.tensor([5, 2]), ks, vs)
    s = ks.view(8, 2)
    assert torch.equal(s[5], torch.tensor([2.0 / 448, 1.0]))  # an all-zero row stores scale 1
    assert torch.equal(s[2], torch.tensor([900.0, 4e-3]) / 448)  # amax / 448 in fp32
    assert torch.equal(vs.view(torch.int32), ks.view(torch.int32))  # -k: the same scales, same poison
    deq = kc.view(8, 2, 4)[[5, 2]].float() * torch.stack([s[5], s[2]])[..., None]
    assert (kc.view(8, 2, 4)[5, 0].float().abs().max() == 448) and (kc.view(8, 2, 4)[5, 1].float() == 0).all()
    # E4M3 keeps 3 mantissa bits: a normal value is off by at most 2**-4 of itself; a subnormal one
    # (|x| / scale < 2**-6) by at most half the subnormal step, 2**-10 * scale.
    bound = torch.maximum(k.abs() * 2.0**-4, 2.0**-10 * torch.stack([s[5], s[2]])[..., None])
    assert ((deq - k).abs() <= bound).all()
    assert (kc.view(8, 2, 4)[[0, 1, 3, 4, 6, 7]].view(torch.uint8) == NAN_CODE).all()


# --- the Triton provider ------------------------------------------------------------------------------

def _e4m3_probe_values() -> torch.Tensor:
    """Every finite E4M3 value, every midpoint between neighbours (ties: must go to the even code), one fp32
    ulp either side of each midpoint, values past 448 (clamped), and subnormal/underflow edges."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0 .. 0x7E: +0 .. 448
    vals = codes.view(FP8).float()
    mids = (vals[:-1] + vals[1:]) / 2  # exact in fp32
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(0.0))
    extra = torch.tensor([449.0, 464.0, 465.0, 1e6, float("inf"), 2.0**-10, 2.0**-11, 1e-30, 1.0625, 2.0**-6])
    pos = torch.cat([vals, mids, up, down, extra])
    return torch.cat([pos, -pos])


def test_triton_rounding_is_exact_over_every_e4m3_value_and_tie():
    x = _e4m3_probe_values()
    d = 16
    x = torch.cat([x, torch.zeros((-x.numel()) % (2 * d))]).view(-1, 2, d)  # [N, kv_heads=2, D=16]
    slots = torch.randperm(x.shape[0] + 3)[: x.shape[0]]
    args = (x, x.flip(0), slots, x.shape[0] + 3, 1)
    _assert_same(_run("triton", *args, False, False), _run("native", *args, False, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_scaled, v_scaled", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("n, h, d, bs", [(1, 1, 16, 4), (7, 2, 40, 5), (5, 3, 24, 16)])
def test_triton_matches_reference_bitwise(dtype, k_scaled, v_scaled, n, h, d, bs):
    gen = torch.Generator().manual_seed(n * 100 + d)
    nb = n // bs + 3
    # Rows whose magnitudes span 2**-12 .. 2**12 (subnormal codes to clamping under unit scales), one all zero.
    mag = torch.exp2(torch.randint(-12, 13, (n, h, 1), generator=gen).float())
    k = (torch.randn(n, h, d, generator=gen) * mag).to(dtype)
    v = (torch.randn(n, h, d, generator=gen) * mag.flip(0)).to(dtype)
    k[n // 2, 0] = 0
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[::2] -= nb * bs  # the same slots counted from the end
    args = (k, v, slots, nb, bs, k_scaled, v_scaled)
    _assert_same(_run("triton", *args), _run("native", *args))


def test_triton_strided_inputs_and_int32_slots():
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(4, 2, 2 * 24, generator=gen) * 50
    k, v = big[..., :24], big[..., 24:]  # views with row stride 96, as a fused projection would give
    slots = torch.tensor([[9, 0], [-16, 0], [14, 0], [-13, 0]], dtype=torch.int32)[:, 0]  # strided: stride 2
    args = (k, v, slots, 4, 4, True, False)
    _assert_same(_run("triton", *args), _run("native", *args))


def _kv_views(nb: int, bs: int, h: int, d: int):
    """K and V caches as the two halves of one poisoned head-major [nb, 2, h, bs, d] K|V buffer viewed as [nb,
    bs, h, d], and their scales as the two halves of one [nb, bs, h, 2] buffer: (buffer, k_cache, v_cache,
    scale buffer, k_scale, v_scale), no stride but D's the contiguous one (blocks 2 * h * bs * d apart, slots
    d, heads bs * d; scales' heads 2 apart)."""
    buf = torch.full((nb, 2, h, bs, d), NAN_CODE, dtype=torch.uint8).view(FP8)
    sbuf = torch.full((nb, bs, h, 2), float("nan"))
    return buf, buf[:, 0].transpose(1, 2), buf[:, 1].transpose(1, 2), sbuf, sbuf[..., 0], sbuf[..., 1]


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_strided_caches_scales_and_rows_strided_along_d(backend):
    """The provider takes any strides: k and v every other element of a row (stride 2 along D), the caches the
    K and V halves of one head-major [blocks, 2, kv_heads, block_size, D] buffer, the scales the halves of one [..., 2]
    buffer. The other tests' caches and scales are contiguous and their rows have unit stride along D, so a
    kernel that stepped D, heads or scales by the contiguous strides passed them. Compared bit for bit, poison
    included, with the reference writing into the same views of its own buffers."""
    gen = torch.Generator().manual_seed(15)
    n, h, d = 5, 3, 12
    wide = torch.randn(n, h, 2 * d, generator=gen) * torch.exp2(torch.randint(-6, 7, (n, h, 1), generator=gen))
    k, v = wide[..., ::2], wide[..., 1::2]
    assert k.stride(2) == 2
    slots = torch.tensor([7, -1, 0, 12, -10])  # slots 7, 15, 0, 12, 6 of 16
    got, want = _kv_views(4, 4, h, d), _kv_views(4, 4, h, d)
    with ops.use_backend(backend):
        reshape_and_cache_fp8(k, v, got[1], got[2], slots, got[4], got[5])
    reshape_and_cache_fp8.reference(k, v, want[1], want[2], slots, want[4], want[5])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[3].view(torch.int32), want[3].view(torch.int32))
    assert not want[3][1, 3].isnan().any() and want[3][0, 1].isnan().all()   # slot 7 written, slot 1 poison


def test_triton_heads_further_apart_than_int32_indexes_are_read_right():
    """k's heads 2^30 elements apart (head 2 at 2^31): the kernel reads a head at h * stride in int64, not at a
    wrapped int32 offset (2^32 elements before k). The 8 GiB behind k are only reserved; a head's 16 values and
    v's are touched."""
    gen = torch.Generator().manual_seed(4)
    k = torch.empty_strided((2, 3, 16), (16, 2**30, 1))
    k.copy_(torch.randn(2, 3, 16, generator=gen) * 30)
    v = torch.randn(2, 3, 16, generator=gen)
    args = (k, v, torch.tensor([5, 0]), 2, 4, True, False)
    _assert_same(_run("triton", *args), _run("native", *args))


def test_triton_slot_minus_one_is_the_last_slot_and_nothing_before_the_cache_is_written():
    k = torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(4))
    guarded = [_fp8_cache(2 * 3, 2, 1, 16) for _ in range(2)]  # blocks 2, 3 are the cache; the rest guard it
    kc, vc = (g[2:4] for g in guarded)
    with ops.use_backend("triton"):
        reshape_and_cache_fp8(k, -k, kc, vc, torch.tensor([-1, 0]))
    want = _run("native", k, -k, torch.tensor([3, 0]), 2, 2, False, False)
    _assert_same((kc.view(torch.uint8), vc.view(torch.uint8)), want[:2])
    for g in guarded:
        assert (g[:2].view(torch.uint8) == NAN_CODE).all() and (g[4:].view(torch.uint8) == NAN_CODE).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scaled, v_scaled", [(False, False), (True, True), (False, True)])
def test_triton_nan_and_inf_match_the_reference_bitwise(k_scaled, v_scaled, dtype, device):
    """NaN stays NaN, code 0x7F with its sign (V = -K brings both signs); Inf clamps to +-448 under unit
    scales. With per-token scales a NaN makes its row's scale NaN and every code in the row NaN; an Inf makes
    the scale Inf and its own code NaN. The other KV head of the token keeps its own finite scale."""
    nan, inf = float("nan"), float("inf")
    k = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(8)) * 10  # [N, kv_heads=2, D=16]
    k[0, 0, 0] = nan  # first element
    k[1, 0, 7] = -nan  # mid-row, sign set
    k[2, 1, 15] = inf  # last element, second head
    k[3, 0, 2], k[3, 0, 9] = -inf, nan  # both in one row
    k = k.to(dtype).to(device)
    slots = torch.tensor([5, 0, -1, 2], device=device)
    args = (k, -k, slots, 3, 3, k_scaled, v_scaled)
    got, want = _run("triton", *args), _run("native", *args)
    assert (want[0].view(-1, 2, 16)[[5, 0, 8, 2]][k.isnan()] & 0x7F == NAN_CODE).all()  # the reference: NaN
    _assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [4, -5, 2**40])
def test_slot_out_of_range_refused_by_the_reference_and_written_nowhere_by_the_kernel(bad, device):
    """Slots lie in [-4, 4) for 2 blocks of 2. The reference refuses another; the kernel writes nothing for it:
    not in the cache, its scales, or the guard blocks around them."""
    k = torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(5)).to(device)
    slots = torch.tensor([bad, 1], device=device)
    with pytest.raises(InputError, match=rf"^slots={bad}: cache slots .* lie in \[-4, 4\)"):
        _run("native", k, -k, slots, 2, 2, True, True)
    guarded = [_fp8_cache(3 * 2, 2, 1, 16, device) for _ in range(2)]  # blocks 2, 3 are the cache; the rest guard it
    scales = [_scale_cache(3 * 2, 2, 1, device) for _ in range(2)]
    with ops.use_backend("triton"):
        reshape_and_cache_fp8(k, -k, guarded[0][2:4], guarded[1][2:4], slots, scales[0][2:4], scales[1][2:4])
    want = _run("native", k[1:], -k[1:], slots[1:], 2, 2, True, True)
    _assert_same((guarded[0][2:4].view(torch.uint8), guarded[1][2:4].view(torch.uint8), scales[0][2:4],
                  scales[1][2:4]), want)
    for g, s in zip(guarded, scales):
        assert (g[:2].view(torch.uint8) == NAN_CODE).all() and (g[4:].view(torch.uint8) == NAN_CODE).all()
        assert s[:2].isnan().all() and s[4:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_triton_refuses_slots_that_torch_would_read_as_a_mask(dtype):
    k = torch.randn(2, 1, 16)
    with ops.use_backend("triton"), pytest.raises(InputError, match=r"^slots=.*int32 or int64"):
        reshape_and_cache_fp8(k, k, _fp8_cache(2, 2, 1, 16), _fp8_cache(2, 2, 1, 16), torch.ones(2, dtype=dtype))


# --- operands the kernel cannot take ---------------------------------------------------------------------

def _ops():
    """k, v [3, 2, 16] fp32, NaN caches [2 blocks, 4, 2, 16] and scales, slots [3] int64: operands the kernel
    takes (as a list, for the cases to replace one)."""
    gen = torch.Generator().manual_seed(21)
    return [torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen), _fp8_cache(2, 4, 2, 16),
            _fp8_cache(2, 4, 2, 16), torch.tensor([5, 0, 7]), _scale_cache(2, 4, 2), _scale_cache(2, 4, 2)]


def _with(**parts):
    """A case: `_ops()` with the named parts replaced (each a function of the parts)."""
    names = ("k", "v", "k_cache", "v_cache", "slots", "k_scale", "v_scale")

    def make():
        args = dict(zip(names, _ops()))
        args.update({n: f(args) for n, f in parts.items()})
        return [args[n] for n in names]
    return make


def _huge(n: int, h: int, d: int):
    """k, v [n, h, d] (zeros, stride 0), caches and scales of h, d, slots [n]: past a limit without the memory."""
    x = torch.zeros(1, 1, 1).expand(n, h, d)
    return [x, x, _fp8_cache(1, 2, h, d), _fp8_cache(1, 2, h, d), torch.zeros(1, dtype=torch.int64).expand(n),
            None, None]


def _empty_rows(scaled: bool):
    """Rows of D = 0 (caches of D = 0), with or without scales."""
    k = torch.zeros(3, 2, 0)
    return [k, k, _fp8_cache(2, 4, 2, 0), _fp8_cache(2, 4, 2, 0), torch.tensor([5, 0, 7]),
            _scale_cache(2, 4, 2) if scaled else None, None]


# case: a function making the operands, the field refused, what its message says it allows
BAD = {
    "slots bool": (_with(slots=lambda a: a["slots"] > 1), "slots", "int32 or int64 .* as a mask"),
    "slots uint8": (_with(slots=lambda a: a["slots"].to(torch.uint8)), "slots", "int32 or int64"),
    "slots float": (_with(slots=lambda a: a["slots"].float()), "slots", "int32 or int64"),
    "slots 2-D": (_with(slots=lambda a: a["slots"][:, None]), "slots", r"a 1-D \[N\] tensor"),
    "k_cache bf16": (_with(k_cache=lambda a: torch.full((2, 4, 2, 16), float("nan"), dtype=torch.bfloat16)),
                     "k_cache", r"a float8_e4m3fn \[blocks, block_size, kv_heads, D\]"),
    "v_cache e5m2": (_with(v_cache=lambda a: a["v_cache"].view(torch.uint8).view(torch.float8_e5m2)), "v_cache",
                     "a float8_e4m3fn"),
    "k_cache 3-D": (_with(k_cache=lambda a: a["k_cache"].view(2, 4, 32)), "k_cache", r"a 4-D \[blocks"),
    "v_cache of other blocks": (_with(v_cache=lambda a: a["v_cache"].view(4, 2, 2, 16)), "v_cache",
                                r"k_cache's shape \[2, 4, 2, 16\]"),
    "v_cache of other D": (_with(v=lambda a: a["v"][..., :8], v_cache=lambda a: _fp8_cache(2, 4, 2, 8)), "v_cache",
                           r"k_cache's shape \[2, 4, 2, 16\]"),
    "k of other D": (_with(k=lambda a: a["k"][..., :8]), "k", r"\[N, kv_heads, D\] = \[3, 2, 16\]"),
    "k of one head for two": (_with(k=lambda a: a["k"][:, :1]), "k", r"\[N, kv_heads, D\] = \[3, 2, 16\]"),
    "v of fewer rows": (_with(v=lambda a: a["v"][:2]), "v", r"\[N, kv_heads, D\] = \[3, 2, 16\]"),
    "k int": (_with(k=lambda a: a["k"].int()), "k", "bf16, fp16 or fp32"),
    "v fp64": (_with(v=lambda a: a["v"].double()), "v", "bf16, fp16 or fp32"),
    "k_scale bf16": (_with(k_scale=lambda a: a["k_scale"].bfloat16()), "k_scale",
                     r"None or a float32 \[blocks, block_size, kv_heads\] = \[2, 4, 2\]"),
    "v_scale 2-D": (_with(v_scale=lambda a: a["v_scale"].view(2, 8)), "v_scale", r"= \[2, 4, 2\]"),
    "k_scale of one head": (_with(k_scale=lambda a: a["k_scale"][..., :1]), "k_scale", r"= \[2, 4, 2\]"),
    "k_scale of more blocks": (_with(k_scale=lambda a: _scale_cache(3, 4, 2)), "k_scale", r"= \[2, 4, 2\]"),
    "k of D = 0 with scales": (lambda: _empty_rows(True), "k", "rows of D >= 1 with k_scale"),
    "v elsewhere": (_with(v=lambda a: a["v"].to("meta")), "v", "on k's device, cpu"),
    "k_cache elsewhere": (_with(k_cache=lambda a: a["k_cache"].to("meta")), "k_cache", "on k's device, cpu"),
    "v_scale elsewhere": (_with(v_scale=lambda a: a["v_scale"].to("meta")), "v_scale", "on k's device, cpu"),
    "k N past the grid": (lambda: _huge(2**31, 1, 1), "k", "N <= 2147483647"),
    "k heads x D past a tile": (lambda: _huge(1, 2, 2**19 + 1), "k", "at most 1048576"),
}


def _untouched(t: torch.Tensor | None) -> bool:
    """t still holds its NaN poison (an FP8 cache: the NaN code 0x7F), or is None or on the meta device."""
    if t is None or t.device.type == "meta":
        return True
    if t.element_size() == 1:
        return bool((t.view(torch.uint8) == NAN_CODE).all())
    return bool(t.isnan().all())


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`reshape_and_cache_fp8_refusal`): the predicate says no, `reshape_and_cache_fp8_triton` called
    directly raises it naming the operand and writes nothing (caches, scales), and an explicit
    `runtime.backend=triton` says which operand it refuses (with the reference's own error where it refuses the
    call too)."""
    make, field, allowed = BAD[case]
    args = make()
    with ops.use_backend("triton"):
        assert not reshape_and_cache_fp8.providers["triton"].supports(*args)
        with pytest.raises(MtpfError, match=rf"^{field}=.*{allowed}"):
            reshape_and_cache_fp8_triton(*args)
        assert_backend_refuses(reshape_and_cache_fp8, field, *args)
    assert all(_untouched(t) for t in args[2:4] + args[5:])


@pytest.mark.parametrize("case", ["slots bool", "slots uint8", "slots float", "k_cache bf16", "v_cache e5m2",
                                  "k of other D", "v of fewer rows", "k_scale bf16", "v_scale 2-D",
                                  "k_scale of one head", "k_scale of more blocks", "k of D = 0 with scales"])
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_slots_caches_and_shapes_no_provider_can_write_are_refused_by_the_reference(case, backend):
    """Slots torch would read as a mask or cannot index by, caches and scales of another dtype or shape and rows
    that do not fit the cache, which the reference met with a raw torch error (IndexError, RuntimeError) or a
    mask, are refused naming the operand, before anything is written."""
    make, field, _ = BAD[case]
    args = make()
    with ops.use_backend(backend), pytest.raises(InputError, match=rf"^{field}="):
        reshape_and_cache_fp8(*args)
    assert all(_untouched(t) for t in args[2:4] + args[5:])


def test_a_v_cache_of_fewer_slots_is_refused_by_the_reference_naming_the_slot():
    """Each cache is indexed by its own slots: a slot that K's cache holds and V's does not is refused (the
    reference met it with a raw IndexError), before anything is written."""
    k, v, kc, vc, slots, ks, vs = _ops()
    vc, vs = vc[:1], vs[:1]
    with pytest.raises(InputError, match=r"^slots=7: cache slots of these 1 blocks of 4 lie in \[-4, 4\)"):
        reshape_and_cache_fp8.reference(k, v, kc, vc, slots, ks, vs)
    assert all(_untouched(t) for t in (kc, vc, ks, vs))


def test_the_reference_takes_what_only_the_kernel_refuses():
    """Caches of other shapes each fit by its rows (a V cache of other blocks, or of another D; the halves of a
    [blocks, 2, block_size, ...] K|V cache), one K head broadcast to both, int or fp64 rows, rows of D = 0
    without scales: the reference writes them as it writes
    their plain form (under `auto` the op falls back to it)."""
    k, v, _, _, slots, _, _ = _ops()

    def written(k, v, v_shape=(2, 4, 2, 16), scaled=True):
        """(K cache, V cache, K scales) bytes after the reference, V unscaled."""
        kc, vc, ks = _fp8_cache(2, 4, 2, 16), _fp8_cache(*v_shape), _scale_cache(2, 4, 2) if scaled else None
        reshape_and_cache_fp8.reference(k, v, kc, vc, slots, ks)
        return kc.view(torch.uint8), vc.view(torch.uint8).reshape(8, 2, -1), ks

    _assert_same(written(k, v, (4, 2, 2, 16)), written(k, v))
    kc, vc, ks = written(k, v)
    _assert_same(written(k, v[..., :8], (2, 4, 2, 8)), (kc, vc[..., :8].contiguous(), ks))
    _assert_same(written(k[:, :1], v), written(k[:, :1].expand(3, 2, 16), v))
    _assert_same(written(k.double(), v), written(k, v))
    ints = (10 * k).round().int()
    _assert_same(written(ints, v, scaled=False), written(ints.float(), v, scaled=False))
    kc, vc = _fp8_cache(2, 4, 2, 0), _fp8_cache(2, 4, 2, 0)
    reshape_and_cache_fp8.reference(k[..., :0], v[..., :0], kc, vc, slots)
    # FlashInfer's [blocks, K|V, block_size, heads, D] cache and scales laid out alike: their halves cannot be
    # viewed as rows of slots (the reference met V's with a raw torch error after writing K's); the kernel,
    # which takes any strides, writes the same bytes
    want = _run("native", k, v, slots, 2, 4, True, True)
    for backend in ("native", "triton"):
        kv, sc = _fp8_cache(2, 8, 2, 16).view(2, 2, 4, 2, 16), _scale_cache(2, 8, 2).view(2, 2, 4, 2)
        with ops.use_backend(backend):
            reshape_and_cache_fp8(k, v, kv[:, 0], kv[:, 1], slots, sc[:, 0], sc[:, 1])
        _assert_same((kv[:, 0].view(torch.uint8), kv[:, 1].view(torch.uint8), sc[:, 0], sc[:, 1]), want)
    with ops.use_backend("auto"):
        kc, vc = _fp8_cache(2, 4, 2, 16), _fp8_cache(2, 4, 2, 16)
        reshape_and_cache_fp8(k[:, :1], v, kc, vc, slots)
        _assert_same((kc.view(torch.uint8),), written(k[:, :1].expand(3, 2, 16), v, scaled=False)[:1])


# --- GPU: realistic shapes, the hardware cast in torch's reference against the kernel's integer rounding

@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 32, 1000])
@pytest.mark.parametrize("scaled", [False, True])
def test_gpu_triton_matches_reference_bitwise(n, scaled):
    gen = torch.Generator(device="cuda").manual_seed(n)
    h, d, bs, nb = 2, 256, 16, 4096
    mag = torch.exp2(torch.randint(-12, 13, (n, h, 1), generator=gen, device="cuda").float())
    k = (torch.randn(n, h, d, generator=gen, device="cuda") * mag).bfloat16()
    v = (torch.randn(n, h, d, generator=gen, device="cuda") * 300).bfloat16()
    slots = torch.randperm(nb * bs, generator=gen, device="cuda")[:n]
    args = (k, v, slots, nb, bs, scaled, scaled)
    _assert_same(_run("triton", *args), _run("native", *args))


@pytest.mark.gpu
def test_gpu_rounding_is_exact_over_every_e4m3_value_and_tie():
    x = _e4m3_probe_values().cuda()
    x = torch.cat([x, torch.zeros((-x.numel()) % 512, device="cuda")]).view(-1, 2, 256)
    slots = torch.arange(x.shape[0], device="cuda")
    args = (x, -x, slots, x.shape[0], 1, False, False)
    _assert_same(_run("triton", *args), _run("native", *args))
