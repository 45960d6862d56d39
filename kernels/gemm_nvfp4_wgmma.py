"""W4A16 NVFP4 times 2 to 32 rows of 16-bit x on Hopper's wgmma, the decoded weight tile the MMA's A
operand in registers: no shared-memory round trip for the decoded weight (Gluon; sm_90 only). `linear_nvfp4_triton`
runs it where the plan says (`GemvPlan.wgmma`); elsewhere the Triton GEMV or dots run.

Why Gluon: Triton's `tl.dot` takes the decoded tile through shared memory (STS, then LDSM into the MMA's
registers). On 151936 x 2048 at M = 32 that kernel was bound by L1/shared memory (Nsight Compute: L1/TEX
94% busy, DRAM 28%, 7.5-way bank conflicts on the stores). Here each thread decodes exactly the A fragment it
holds: wgmma's register A layout (k_width 2) gives the thread in lane 4r + c of warp w the rows 16w + r and
16w + r + 8 and, in each 16-wide K block, the pairs at 2c and 2c + 8. A permutation of K within each K tile
of BK makes one word of 8 codes fill such a thread's fragment over two K blocks, so each thread reads its own
words (32 bytes a row at BK = 256, from a ring in shared memory that TMA keeps the next K steps in, swizzled so
that a warp's reads are free of bank conflicts: the packed words are a quarter of the decoded tile's bytes) and
its blocks' scales (an int32 of 4, made fp16 pairs by one asm), and `convert_layout(..., assert_trivial=True)`
proves no data moves after.
The program is warp-specialized: one producer warp (in a warpgroup of its own, its registers given back) issues
every TMA copy and waits for each stage's release; the consumer warps wait only on the copies, so they hold no
copy logic and no CTA-wide barrier (Triton's barrier analysis put six a K step in the single-role kernel, and its
threads could not go below 74 registers).
x is permuted the same way by x's pass (`_x_f16_pairs_kernel(ORDER=BK)`), so the products are those of the
reference, in another order of K.

The permutation, within each tile of BK (per = BK / 32 words a thread a row): word w = per * c + b (c in
0..3, b in 0..per-1) holds elements 8w .. 8w + 7; the decode (`_E2M1X8_F16_SCALED_PTX`) outputs them in
x's pass's order, output j = 4 j2 + 2 j1 + j0 being element (0, 2, 4, 6, 1, 3, 5, 7)[j], and output j goes
to dot position 32 b + 16 j2 + 8 j1 + 2 c + j0 (`dot_order`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_wait

from mtpfactory.kernels.linear import tma_layout_refusal
from mtpfactory.kernels.linear_nvfp4 import _E2M1X8_F16_SCALED_PTX, wgmma_operand_refusal
from mtpfactory.ops import cdiv


def block_m(m: int) -> int:
    """Rows of x a program for M rows (the wgmma N: 8, 16 or 32; rows past M are zero-filled)."""
    return 8 if m <= 8 else 16 if m <= 16 else 32


@dataclasses.dataclass(frozen=True)
class WgmmaTile:
    """One launch's tile: `bn` weight rows a program for `warps` consumer warps (16 rows a warp, 64 a
    warpgroup), K steps of `bk` (the K tile of `dot_order`) through a ring of `stages` steps in shared memory;
    each step's words read from the ring and multiplied in `parts` (2 or 4) parts of bk / parts, each part's A
    operand alone in registers. `maxnreg`: registers a thread at launch; the producer's warpgroup
    gives back all but PRODUCER_REGS of its own, so the consumers run at `consumer_regs` (72 at the planner's
    tiles: 3 programs of 8 consumer warps, or 5 of 4, fit an SM's 64K registers, and ptxas keeps each part's
    wgmmas in one batch; at 72 registers two parts of 128 did not fit without spilling)."""
    bn: int = 128
    bk: int = 256
    warps: int = 8
    stages: int = 2
    parts: int = 4
    maxnreg: int = 56

    def __post_init__(self):
        if not (self.bn == 16 * self.warps and self.warps % 4 == 0 and self.bk % 256 == 0
                and MIN_K_MULTIPLE % self.bk == 0 and self.stages >= 2 and self.parts in (2, 4)
                and self.maxnreg % 8 == 0 and PRODUCER_REGS <= self.maxnreg and self.consumer_regs <= 256):
            raise ValueError(f"WgmmaTile: {self}; it takes whole warpgroups of 16 rows a warp (bn = 16 * warps, "
                             f"warps a multiple of 4), bk a multiple of 256 dividing {MIN_K_MULTIPLE} (each "
                             "thread's words a row span whole 4-byte words of scales), 2 stages or more, 2 or 4 "
                             f"parts, and maxnreg a multiple of 8 from {PRODUCER_REGS} up that leaves the consumers "
                             "256 registers or fewer")

    @property
    def consumer_regs(self) -> int:
        """The consumer warps' registers: the launch's pool (maxnreg for each of warps + 4 warps: the producer's
        warp is padded to a warpgroup) less the producer warpgroup's PRODUCER_REGS, a multiple of 8."""
        return (self.maxnreg * (self.warps + 4) - PRODUCER_REGS * 4) // self.warps // 8 * 8


# Registers a thread of the producer warp(group) keeps (setmaxnreg's least)
PRODUCER_REGS = 24
_PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
# K a multiple of this: whole K steps of every tile (bk 256 or 512), and rows of scales that are whole int32
# words of 4 blocks (K / 64 of them)
MIN_K_MULTIPLE = 512
# The tile by rows of x a program (`block_m`). H200, against the single-role kernel of the fourteenth run (its
# tiles: 8 rows one part in a ring of 3, 16 and 32 rows two parts in a ring of 2), in one process, the median of
# alternating rounds (microseconds, 151936 x 2048 / 154880 x 4096; BENCHMARKS.md, fifteenth run):
# - 32 rows: 128 weight rows a program (two consumer warpgroups sharing x), a ring of 2 steps (68 KB), four parts
#   at 72 registers: 65.0 / 131.7 against 65.7 / 146.2 (AW), 66.9 / 132.4 against 68.0 / 137.2 (AU). In two parts
#   at 80 registers (2 programs an SM): 70.7 / 137.5 against 69.3 / 141.5 (AS); a ring of 3 (2 programs an SM,
#   by shared memory): 69.5 / 134.0 against 65.5 / 130.5 for these tiles (AV).
# - 8 and 16 rows: 64 weight rows (one consumer warpgroup), rings of 3 and 2 steps, two parts: 51.9 / 99.2 and
#   55.4 / 108.5 against 51.0 / 101.6 and 54.6 / 112.7 (AW). Rings of 4 and 3: 54.3 / 99.6 and 58.1 / 112.3
#   against 51.9 / 98.8 and 56.4 / 109.7 for these tiles (AV).
# The eleventh to fourteenth runs' single-role tiles lost with deeper rings too: more warps an SM beat more steps
# in flight. Programs that stay resident (persistent, tiles pid, pid + G, ...) ran 3-7% slower at every M, and one
# program an SM of 6 consumer partitions (a ring of 3) lost to the instruction cache (seventeenth run).
TILES = {8: WgmmaTile(bn=64, warps=4, stages=3, parts=2, maxnreg=48),
         16: WgmmaTile(bn=64, warps=4, stages=2, parts=2, maxnreg=48),
         32: WgmmaTile(bn=128, warps=8, stages=2, parts=4, maxnreg=56)}
ORDER = 256                # the `XPairs.order` (the K tile of `dot_order`) the kernel reads x in: every tile's bk
assert all(t.bk == ORDER for t in TILES.values())


def dot_order(k: int, bk: int) -> torch.Tensor:
    """perm [k] (int64): the kernel's dot position p takes element perm[p] of x's row and of each weight row."""
    per = bk // 32
    w = torch.arange(bk // 8).view(4, per, 1)                       # [c, b, j]
    j = torch.arange(8)
    elem = (0, 2, 4, 6, 1, 3, 5, 7)
    src = (8 * w + torch.tensor(elem)[j]).expand(4, per, 8)          # element of output j of word per * c + b
    c = torch.arange(4).view(4, 1, 1)
    b = torch.arange(per).view(1, per, 1)
    pos = 32 * b + 16 * (j >> 2) + 8 * ((j >> 1) & 1) + 2 * c + (j & 1)
    perm = torch.empty(bk, dtype=torch.int64)
    perm[pos.reshape(-1)] = src.reshape(-1)
    return (torch.arange(0, k, bk).view(-1, 1) + perm).reshape(-1)


@functools.lru_cache(maxsize=None)
def layouts(bn: int, bk: int, warps: int, bm: int) -> dict:
    """The kernel's layouts for tiles of bn weight rows (64 a warpgroup), bk of K (a multiple of 256) and bm
    rows of x: the registers' (the words of a step, a half and a quarter, the scale words, the accumulator and
    the A operand)."""
    wg = warps // 4
    assert bn == 64 * wg and bk % 256 == 0 and bm in (8, 16, 32), (bn, bk, warps, bm)
    per = bk // 32                                                   # words a row a thread
    lg = lambda v: v.bit_length() - 1                                # noqa: E731
    rows_w = [[16 << i, 0] for i in range(2 + lg(wg))]

    def words_of(per):
        # the words [bn, 4 per]: lane 4r + c of warp w holds rows 16w + r and + 8, words per*c .. per*c + per - 1
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1 << i] for i in range(lg(per))] + [[8, 0]],
            lane_bases=[[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]], warp_bases=rows_w, block_bases=[],
            shape=[bn, 4 * per])
    words = words_of(per)
    # the scales as int32 words of 4 blocks [bn, bk/64]: the same thread holds its words' blocks
    scales = gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(lg(per // 8))] + [[8, 0]],
        lane_bases=[[0, per // 8], [0, per // 4], [1, 0], [2, 0], [4, 0]], warp_bases=rows_w, block_bases=[],
        shape=[bn, bk // 64])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bm, 16])
    return dict(WORDS=words, HALF_WORDS=words_of(per // 2), QUARTER_WORDS=words_of(per // 4), SCALES=scales, ACC=acc,
                A_OP=gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2))


# The ring's layouts (the TMA descriptors'). Words: 128-byte rows at BK = 256, swizzled in 16-byte chunks, so
# that the 8 threads of a read phase (rows r and r + 1, each thread 16 bytes of its row) meet 8 distinct chunks of
# the banks: one wavefront, where unswizzled rows r and r + 1 share their banks and took two (H200, sixteenth
# run BH, nine alternating rounds: 67.5 / 137.2 us at M = 32 against 70.1 / 137.6, 151936 x 2048 / 154880 x
# 4096). x: the wgmma's B operand.
W_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
S_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
X_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


# E4M3 scales -> fp16 pairs for `_E2M1X8_F16_SCALED_PTX`: $4 a word of 4 block scales (block 0 in the low
# byte) -> $0..$3 each block's scale in both fp16 halves (exact: E4M3 values lie inside fp16's range). Two
# hardware conversions of two bytes and four byte permutes, for 64 elements.
_E4M3X4_F16X2_PAIRS_PTX = gl.constexpr("""{
    .reg .b16 lo, hi;
    .reg .b32 p, q;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 p, lo;
    cvt.rn.f16x2.e4m3x2 q, hi;
    prmt.b32 $0, p, 0, 0x1010;
    prmt.b32 $1, p, 0, 0x3232;
    prmt.b32 $2, q, 0, 0x1010;
    prmt.b32 $3, q, 0, 0x3232;
}""")


@gluon.jit
def _word_scales(s32, BN: gl.constexpr, BK: gl.constexpr, WORDS: gl.constexpr):
    """Scale words [BN, BK/64] (SCALES) -> each word's block scale as an fp16 pair [BN, BK/8] (WORDS)."""
    s0, s1, s2, s3 = gl.inline_asm_elementwise(
        asm=_E4M3X4_F16X2_PAIRS_PTX, constraints="=r,=r,=r,=r,r", args=[s32], dtype=(gl.int32,) * 4,
        is_pure=True, pack=1)
    sw = gl.join(gl.join(s0, s2), gl.join(s1, s3))                    # [BN, BK/64, 2, 2]: block 2 i + j
    sw = gl.reshape(gl.join(sw, sw), [BN, BK // 8])                   # word 8 q + 2 block + dup: its block
    return gl.convert_layout(sw, WORDS, assert_trivial=True)


@gluon.jit
def _halves(v, BN: gl.constexpr, BK: gl.constexpr, PART_WORDS: gl.constexpr):
    """[BN, BK/8] per word of a K tile of BK (WORDS) -> the words of each half of its dot positions, [BN, BK/16]
    each (PART_WORDS): thread c's words per * c + b, b under per / 2 and then the rest (registers only). A half
    step's words (BK/2) split so give its quarters."""
    h = gl.permute(gl.reshape(v, [BN, 4, 2, BK // 64]), (0, 1, 3, 2))    # [n, c, b', half]
    h0, h1 = gl.split(h)
    return (gl.convert_layout(gl.reshape(h0, [BN, BK // 16]), PART_WORDS, assert_trivial=True),
            gl.convert_layout(gl.reshape(h1, [BN, BK // 16]), PART_WORDS, assert_trivial=True))


@gluon.jit
def _decode(wv, sw, BN: gl.constexpr, BK: gl.constexpr, WORDS: gl.constexpr, A_OP: gl.constexpr):
    """words [BN, BK/8] and their block scales as fp16 pairs (both WORDS) -> the A operand [BN, BK] fp16: E2M1 *
    2^-6 * scale, exact, in `dot_order` of a K tile of BK."""
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
        asm=_E2M1X8_F16_SCALED_PTX, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[wv, sw],
        dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    t = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))
    t = gl.reshape(t, [BN, 4, BK // 32, 2, 2, 2])                     # [n, c, b, j0, j1, j2]
    t = gl.permute(t, (0, 2, 5, 4, 1, 3))                             # [n, b, j2, j1, c, j0]: dot position
    return gl.convert_layout(gl.reshape(t, [BN, BK]), A_OP, assert_trivial=True)


@gluon.jit
def _ring_issue(w_desc, s_desc, x_desc, bar, w_sm, s_sm, x_sm, row, kk, pred, X: gl.constexpr = True,
                W: gl.constexpr = True):
    """The TMA copies of the K step at kk into one stage of the ring (words and scales where W, x where X;
    the barrier expects all three), completing on its barrier `bar`; none where not `pred`."""
    if W:
        mbarrier.expect(bar, w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes,
                        pred=pred)
        tma.async_copy_global_to_shared(w_desc, [row, kk // 8], bar, w_sm, pred=pred)
        tma.async_copy_global_to_shared(s_desc, [row, kk // 64], bar, s_sm, pred=pred)
    if X:
        tma.async_copy_global_to_shared(x_desc, [0, kk], bar, x_sm, pred=pred)


@gluon.jit
def _producer(w_desc, s_desc, x_desc, full, empty, w_sm, s_sm, x_sm, row, nk, BK: gl.constexpr,
              STAGES: gl.constexpr, PDL: gl.constexpr):
    """The producer warp: fills stage i % STAGES with step i's copies (completing on full[stage]) once the
    consumers released it (empty[stage]); the weights' first copies go out before the PDL wait on x's pass."""
    for j in gl.static_range(STAGES):
        _ring_issue(w_desc, s_desc, x_desc, full.index(j), w_sm.index(j), s_sm.index(j), x_sm.index(j), row,
                    j * BK, j < nk, X=False)
    if PDL:
        gdc_wait()
    for j in gl.static_range(STAGES):
        _ring_issue(w_desc, s_desc, x_desc, full.index(j), w_sm.index(j), s_sm.index(j), x_sm.index(j), row,
                    j * BK, j < nk, W=False)
    for i in range(STAGES, nk):
        cur = i % STAGES
        mbarrier.wait(empty.index(cur), ((i // STAGES) & 1) ^ 1)    # released for the (i // STAGES)-th time
        _ring_issue(w_desc, s_desc, x_desc, full.index(cur), w_sm.index(cur), s_sm.index(cur), x_sm.index(cur),
                    row, i * BK, True)


@gluon.jit
def _consumer(full, empty, w_sm, s_sm, x_sm, nk, BN: gl.constexpr, BK: gl.constexpr, BM: gl.constexpr,
              WORDS: gl.constexpr, HALF_WORDS: gl.constexpr, QUARTER_WORDS: gl.constexpr, SCALES: gl.constexpr,
              ACC: gl.constexpr, A_OP: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr):
    """The consumer warps: each step's scales and words read from the ring, each half of the words decoded in
    `PARTS` // 2 parts into the A operand, times x from the ring; the stage released after. Returns the
    accumulator [BN, BM]. (ptxas reads the second half's words only after the first part's decode, so the
    words held at once stay few: the register test checks that nothing spills.)"""
    acc = gl.zeros([BN, BM], gl.float32, layout=ACC)
    for i in range(nk):
        cur = i % STAGES
        mbarrier.wait(full.index(cur), (i // STAGES) & 1)            # this step's copies landed
        sh = _halves(_word_scales(s_sm.index(cur).load(SCALES), BN, BK, WORDS), BN, BK, HALF_WORDS)
        whs = _halves(w_sm.index(cur).load(WORDS), BN, BK, HALF_WORDS)
        xs = x_sm.index(cur)
        for h in gl.static_range(2):
            wh = whs[h]
            if PARTS == 2:
                acc = hopper.warpgroup_mma(_decode(wh, sh[h], BN, BK // 2, HALF_WORDS, A_OP),
                                           xs.slice(h * BK // 2, BK // 2, dim=1).permute((1, 0)), acc)
            else:
                wq = _halves(wh, BN, BK // 2, QUARTER_WORDS)
                sq = _halves(sh[h], BN, BK // 2, QUARTER_WORDS)
                for q in gl.static_range(2):
                    acc = hopper.warpgroup_mma(_decode(wq[q], sq[q], BN, BK // 4, QUARTER_WORDS, A_OP),
                                               xs.slice((2 * h + q) * BK // 4, BK // 4, dim=1).permute((1, 0)), acc)
        mbarrier.arrive(empty.index(cur))                            # after every consumer warp's wgmma
    return (acc,)


@gluon.jit
def _gemm_nvfp4_wgmma_kernel(x_desc, exp_ptr, w_desc, s_desc, s2_ptr, out_ptr, M, N, K, stride_om, stride_on,
                             BN: gl.constexpr, BK: gl.constexpr, BM: gl.constexpr, WORDS: gl.constexpr,
                             HALF_WORDS: gl.constexpr, QUARTER_WORDS: gl.constexpr, SCALES: gl.constexpr,
                             ACC: gl.constexpr, A_OP: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr,
                             PDL: gl.constexpr):
    """out [M, N] = x @ w^T for M <= BM, read through TMA descriptors: x_desc of x's pass's fp16 [M, K] in
    `dot_order` (times 2^exp[m], one K slice; blocks [BM, BK]), w_desc of the words [N, K/8] (int32; blocks
    [BN, BK/8]), s_desc of the scale bytes as int32 words of 4 blocks [N, K/64] (blocks [BN, BK/64]); K a
    multiple of MIN_K_MULTIPLE (`gemm_nvfp4_wgmma` checks).
    One program a tile of BN rows: a ring of STAGES K steps in shared memory, filled by the producer warp
    (`_producer`) and read by the consumer warps (`_consumer`, num_warps of them), each stage's copies
    completing on its `full` barrier and its release on its `empty` one. Rows past N and rows of x past M are
    read as zeros (TMA's bounds) and stored nowhere. PDL: launched beside x's pass, whose pairs (and exps) it
    reads after it ends."""
    pid = gl.program_id(0)
    w_sm = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 8], w_desc.layout)
    s_sm = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BK // 64], s_desc.layout)
    x_sm = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], x_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(full.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    nk = K // BK
    acc = gl.warp_specialize([
        (_consumer, (full, empty, w_sm, s_sm, x_sm, nk, BN, BK, BM, WORDS, HALF_WORDS, QUARTER_WORDS, SCALES, ACC,
                     A_OP, STAGES, PARTS)),
        (_producer, (w_desc, s_desc, x_desc, full, empty, w_sm, s_sm, x_sm, pid * BN, nk, BK, STAGES, PDL))],
        [1], [_PRODUCER_REGS])[0]
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(j))
        mbarrier.invalidate(empty.index(j))
    if PDL:
        gdc_wait()                   # the exps are x's pass's too (returns at once: the producer waited already)
    on = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
    om = gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
    p = 6 - gl.load(exp_ptr + om, mask=om < M, other=0)               # the decode's 2^-6 and x's 2^e undone
    half = p >> 1
    f = ((half + 127) << 23).to(gl.float32, bitcast=True) * ((p - half + 127) << 23).to(gl.float32, bitcast=True)
    acc = acc * f[None, :] * gl.load(s2_ptr)
    gl.store(out_ptr + om[None, :] * stride_om + on[:, None] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=(om < M)[None, :] & (on < N)[:, None])


def gemm_nvfp4_wgmma(x16: torch.Tensor, exps: torch.Tensor, words: torch.Tensor, scale_bits: torch.Tensor,
                     scale_2: torch.Tensor, out: torch.Tensor, pdl: bool, tile: WgmmaTile | None = None) -> None:
    """Launch: x16 [M, K] fp16 in `dot_order(K, tile.bk)`, M <= 32; exps [M, 1]; words [N, K/8] int32;
    scale_bits [N, K/16] uint8; scale_2 [1] fp32; out [M, N]; K a multiple of MIN_K_MULTIPLE; x, words and
    scales as TMA reads them (`tma_layout_refusal`). `tile`: `TILES[block_m(M)]` unless given (sweeps)."""
    m, k = x16.shape
    n = words.shape[0]
    why = (f"M = {m}, K = {k}: it takes M <= {max(TILES)} and K a multiple of {MIN_K_MULTIPLE}"
           if k % MIN_K_MULTIPLE or m > max(TILES)
           else tma_layout_refusal("x", x16) or wgmma_operand_refusal(words, scale_bits))
    if why:
        raise ValueError(f"gemm_nvfp4_wgmma: {why}; run it where `GemvPlan.wgmma` is planned")
    bm = block_m(m)
    tile = tile or TILES[bm]
    s32 = scale_bits.view(torch.int32)
    _gemm_nvfp4_wgmma_kernel[(cdiv(n, tile.bn),)](
        TensorDescriptor.from_tensor(x16, [bm, tile.bk], X_SMEM), exps,
        TensorDescriptor.from_tensor(words, [tile.bn, tile.bk // 8], W_SMEM),
        TensorDescriptor.from_tensor(s32, [tile.bn, tile.bk // 64], S_SMEM), scale_2, out, m, n, k,
        out.stride(0), out.stride(1), BN=tile.bn, BK=tile.bk, BM=bm, STAGES=tile.stages, PARTS=tile.parts, PDL=pdl,
        num_warps=tile.warps, maxnreg=tile.maxnreg, launch_pdl=pdl, **layouts(tile.bn, tile.bk, tile.warps, bm))
