"""Throughput of single PTX instructions and of the W4A16 decode on the GPU: which pipe bounds the decode.

Each thread runs CHAINS independent chains of the instruction (or sequence) for ITERS steps, in enough programs
to fill every SM; the figure is warp-instructions per SM clock (the clock nvidia-smi reports right after the
timing), and for a sequence words decoded per SM clock. On the H200 (BENCHMARKS.md, fourteenth run AH): lop3,
shf, prmt and imad issue about 2 a clock and an SM, mul/fma.f16x2 about 4, and `cvt.rn.f16x2.e4m3x2` shares
the 2-a-clock pipe with the bit operations (alone 1.65, beside an xor 1.97 for the two) rather than running
at a conversion unit's quarter rate. So the decode's 6 bit operations and 4 conversions a word are 10 slots of
one pipe, and a decode with no conversions only pays if it needs fewer of them.

    python3 scripts/pipe_rates.py          (on the GPU machine, after the package's install)
"""

from __future__ import annotations

import subprocess
import sys

import torch
import triton
import triton.language as tl

from mtpfactory.kernels.linear_nvfp4 import _H, _e2m1_word_f16x2_ptx

CHAINS, ITERS, WARPS = 8, 2048, 8

# name: (asm of one step, $1 the chain's value and $2 another chain's -> $0, instructions a step)
OPS = {
    "lop3": ("lop3.b32 $0, $1, $2, 0x0F0F0F0F, 0x96;", 1),
    "shf": ("shf.l.wrap.b32 $0, $1, $1, 3;", 1),
    "prmt": ("prmt.b32 $0, $1, $2, 0x5173;", 1),
    "imad": ("mad.lo.u32 $0, $1, $2, $1;", 1),
    "mul.f16x2": ("mul.rn.f16x2 $0, $1, $2;", 1),
    "fma.f16x2": ("fma.rn.f16x2 $0, $1, $2, $1;", 1),
    "cvt e4m3x2": ("{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 $0, l; }", 1),
    "cvt e4m3x2 + xor": ("{ .reg .b16 l, h; .reg .b32 t; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 t, l; "
                         "xor.b32 $0, t, $2; }", 2),
}
# the four fp16 pairs of a word folded back into one register (two fma.f16x2), so that nothing is dead
_FOLD = "\n    fma.rn.f16x2 h0, h0, h1, h2;\n    fma.rn.f16x2 $0, h0, h3, $1;\n}"
# the decode of one word as the kernels run it (6 bit operations, 4 conversions), times a scale pair ($2)
DECODE = ("{\n    .reg .b32 v, a, b, e, o, h0, h1, h2, h3;\n    .reg .b16 l0, l1, l2, l3;"
          + _e2m1_word_f16x2_ptx("$1", _H) + "".join(f"\n    mul.rn.f16x2 h{i}, h{i}, $2;" for i in range(4)) + _FOLD)
# the cost of a decode with no conversions at its floor: each fp16 pair needs its 8 bits moved into place and
# masked, so at least 3 moves and 4 masks a word (one pair can be in place already). It times that count only:
# no layout makes these exact rotates a decode (fp16 puts the sign 6 bits above a code's magnitude, and those
# 8-bit patterns cannot tile a word by rotation), so its values are not E2M1's
NO_CVT = ("{\n    .reg .b32 a, b, c, h0, h1, h2, h3;"
          "\n    shf.l.wrap.b32 a, $1, $1, 5;\n    shf.l.wrap.b32 b, $1, $1, 11;\n    shf.l.wrap.b32 c, $1, $1, 19;"
          + "".join(f"\n    and.b32 h{i}, {r}, 0x8E008E00;" for i, r in enumerate(("$1", "a", "b", "c")))
          + "".join(f"\n    mul.rn.f16x2 h{i}, h{i}, $2;" for i in range(4)) + _FOLD)
SEQUENCES = {"decode a word (as shipped)": (DECODE, 16), "no-cvt floor (count only)": (NO_CVT, 13)}


def chain_kernel(asm: str):
    @triton.jit
    def kernel(out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = offs * 0x1E3779B1 + 0x3C003C00
        y = offs * 0x05EBCA6B + 0x3C013C01
        for _ in range(ITERS):
            x = tl.inline_asm_elementwise(ASM, "=r,r,r", [x, y], dtype=tl.int32, is_pure=True, pack=1)
            y = tl.inline_asm_elementwise(ASM, "=r,r,r", [y, x], dtype=tl.int32, is_pure=True, pack=1)
        tl.store(out_ptr + offs, x ^ y)
    return kernel


def sm_clock_hz() -> float:
    return 1e6 * float(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, check=True).stdout.split()[0])


def main() -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = WARPS * 32 * CHAINS
    grid = sms * 8
    out = torch.empty(grid * block, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; warp-instructions (steps for a sequence) a clock and an SM")
    for name, (asm, n) in {**OPS, **SEQUENCES}.items():
        kernel = chain_kernel(asm)
        run = lambda: kernel[(grid,)](out, ITERS=ITERS, BLOCK=block, ASM=asm, num_warps=WARPS)  # noqa: E731
        run()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(run, warmup=20, rep=200)
        clock = sm_clock_hz()
        steps = grid * WARPS * CHAINS * ITERS * 2 / (ms * 1e-3) / clock / sms      # warp-steps a clock an SM
        print(f"  {name:34s} {ms:7.3f} ms at {clock / 1e6:.0f} MHz: {steps * n:5.2f} instructions "
              f"({n} a step), {steps:5.3f} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
