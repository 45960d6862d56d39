"""reshape_and_cache_fp8: the reference against hand-computed values, and the Triton provider against the
reference, bit for bit. The provider rounds fp32 -> E4M3 in integer math, so it is exact under the
interpreter too (whose own fp32 -> fp8 cast rounds 1.0625 to 1.125, DESIGN 4): no tolerance anywhere."""

from __future__ import annotations

import os

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError
from mtpfactory.kernels.reshape_and_cache_fp8 import reshape_and_cache_fp8

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
    with ops.use_backend("triton"), pytest.raises(ConfigError, match="reshape_and_cache_fp8"):
        reshape_and_cache_fp8(k, k, _fp8_cache(2, 2, 1, 16), _fp8_cache(2, 2, 1, 16), torch.ones(2, dtype=dtype))


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
