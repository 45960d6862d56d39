"""Does the W4A16 wgmma kernel's tensor work overlap its decode? Timed on the GPU with no memory traffic.

Each program is one warpgroup of 64 weight rows, as the kernel's consumers are, looping over parts of 64 of K
held in registers: "decode" decodes the part's 4 words a thread (`_decode`, the kernel's own: 8 E2M1 codes a
word times its block scale, into the wgmma's register A operand) and folds it into an fp16 sum; "wgmma" runs
the part's 4 wgmmas (64 x BM x 16, A from registers, B from shared memory, synchronous as in the kernel) on
one fixed A; "both" decodes each part and multiplies it, as the kernel does. PROGRAMS programs an SM (the
kernel at 32 rows runs 3 programs of 2 consumer warpgroups). Figures are SM clocks a part and warpgroup
(the clock nvidia-smi reports right after each timing), beside the tensor pipe's own need at the H100/H200
dense fp16 peak of 2048 FMA a clock and SM (4 x 64 x BM x 16 / 2048 a part: 64 at BM = 32). If "both" is near
"decode" + "wgmma", the tensor work does not overlap the decode; near the larger of the two, it does.

    python3 -P scripts/mma_overlap.py          (on the GPU machine, after the package's install)
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

from mtpfactory.kernels.gemm_nvfp4_wgmma import X_SMEM, _decode, layouts

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pipe_rates import sm_clock_hz  # noqa: E402

ITERS = 2048
PROGRAMS = (3, 6)             # warpgroups an SM
BMS = (8, 16, 32)
MODES = ("decode", "wgmma", "both")


@gluon.jit
def _overlap_kernel(out_ptr, iters, scale_bits, BM: gl.constexpr, DECODE: gl.constexpr, MMA: gl.constexpr,
                    WORDS: gl.constexpr, ACC: gl.constexpr, A_OP: gl.constexpr, B_FILL: gl.constexpr):
    """`iters` parts of one warpgroup: decoded (DECODE), multiplied (MMA), or both; one float a program."""
    pid = gl.program_id(0)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, WORDS))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS))
    w = (rows[:, None] * 8 + cols[None, :] + pid) * 0x1E3779B1
    s = gl.zeros([64, 8], gl.int32, layout=WORDS) + scale_bits        # a block scale as an fp16 pair
    b = gl.allocate_shared_memory(gl.float16, [BM, 64], X_SMEM, gl.full([BM, 64], 0.0078125, gl.float16, B_FILL))
    hopper.fence_async_shared()
    acc = gl.zeros([64, BM], gl.float32, layout=ACC)
    fold = gl.zeros([64, 64], gl.float16, layout=A_OP)
    a = _decode(w, s, 64, 64, WORDS, A_OP)
    for i in range(iters):
        if DECODE:
            w = w + 0x01010101
            a = _decode(w, s, 64, 64, WORDS, A_OP)
        if MMA:
            acc = hopper.warpgroup_mma(a, b.permute((1, 0)), acc)
        else:
            fold = fold + a
    total = gl.sum(gl.sum(acc, axis=1), axis=0) + gl.sum(gl.sum(fold.to(gl.float32), axis=1), axis=0)
    gl.store(out_ptr + pid, total)


def main() -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; SM clocks a part (64 of K) and warpgroup, {ITERS} parts")
    for programs in PROGRAMS:
        grid = sms * programs
        out = torch.empty(grid, dtype=torch.float32, device="cuda")
        for bm in BMS:
            lay = layouts(64, 256, 4, bm)
            fill = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            tensor = 4 * 64 * bm * 16 / 2048
            figures = {}
            for mode in MODES:
                def run():
                    _overlap_kernel[(grid,)](out, ITERS, 0x3C003C00, BM=bm, DECODE=mode != "wgmma",
                                             MMA=mode != "decode", WORDS=lay["QUARTER_WORDS"], ACC=lay["ACC"],
                                             A_OP=lay["A_OP"], B_FILL=fill, num_warps=4, maxnreg=80)
                run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(run, warmup=10, rep=100)
                clock = sm_clock_hz()
                figures[mode] = ms * 1e-3 * clock / (programs * ITERS)       # clocks a part and warpgroup, an SM
            d, m, both = figures["decode"], figures["wgmma"], figures["both"]
            print(f"  {programs} warpgroups an SM, BM = {bm:2d}: decode {d:6.1f}, wgmma {m:6.1f} (tensor peak "
                  f"{tensor:5.1f}), both {both:6.1f}; decode + wgmma {d + m:6.1f}, the larger {max(d, m):6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
