"""Bit-exact rounding and decoding that the kernels share. Triton's interpreter (the CPU tests) stores
bf16 / fp8 as raw bits and rounds fp32 -> bf16 / fp8 wrongly, so the kernels round in integer math on the
fp32 bits: the same result compiled on the GPU and interpreted on the CPU, equal to torch's casts."""

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """fp32 `x` to `dtype`, rounding to nearest even. bf16 rounds in integer math: Triton's interpreter
    truncates fp32 -> bf16 (1 + 3 * 2**-8 becomes 1 + 2**-7), the GPU's cvt.rn does not; this way both
    agree with torch. NaN stays NaN, overflow goes to inf."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def e4m3_rne_bits(v):
    """fp32 `v`, already clamped to +-448 -> float8_e4m3fn bits (int32 in [0, 255]), round to nearest even;
    NaN -> 0x7F with its sign bit (0x7F or 0xFF), as torch's cast gives.

    |v| >= 2**-6 (e4m3 normal): round the 23 fp32 mantissa bits to 3 by adding 0x7FFFF plus the kept lsb
    (a carry moves into the exponent, as it should), then rebias the exponent (127 -> 7: minus 120 << 3).
    |v| < 2**-6: the e4m3 value is an integer count of 2**-9 (8 of them being 2**-6, the smallest normal,
    whose bits are also 8), so round the 24-bit significand shifted right by 141 - exponent, ties to even;
    fp32 zeros and subnormals shift out to 0. The sign bit is kept on a zero result, as torch keeps it.
    """
    b = v.to(tl.int32, bitcast=True)
    a = b & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    shift = tl.minimum(tl.maximum(141 - (a >> 23), 21), 26)       # >= 25 leaves nothing: the result is 0
    sig = (a & 0x7FFFFF) | 0x800000                                # 24-bit significand
    h = sig >> (shift - 1)                                         # kept bits and the round bit
    kept = h >> 1
    sticky = (h << (shift - 1)) != sig
    up = ((h & 1) == 1) & (sticky | ((kept & 1) == 1))
    sub = kept + up.to(tl.int32)
    mag = tl.where(a >= (121 << 23), normal, sub)
    mag = tl.where(a > 0x7F800000, 0x7F, mag)                      # NaN (its bits would round as a normal)
    return tl.where(b < 0, mag | 0x80, mag)


@triton.jit
def e4m3_value(bits):
    """float8_e4m3fn bits (int32 in [0, 255]) -> the exact fp32 value: 2**(e-7) * (1 + m/8), subnormals
    m * 2**-9, sign in bit 7 (the NaN patterns 0x7F / 0xFF are not special-cased)."""
    e = (bits >> 3) & 15
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)   # subnormal: m * 2**-9
    return tl.where((bits & 128) != 0, -mag, mag)


@triton.jit
def pow2(e):
    """2^e as fp32, for int32 e in [-126, 127] (built from its exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def times_pow2(v, p):
    """v * 2^p, exact for p in [-252, 254] where the result is a normal fp32: two steps of half p each, as
    one power of two can leave fp32's range."""
    half = p >> 1
    return v * pow2(half) * pow2(p - half)
