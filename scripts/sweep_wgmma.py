"""Sweep the W4A16 wgmma kernel's tiles (`WgmmaTile`) on the LM heads at several M, beside what the planner
runs there now (the heads' call: x's pass made by the final norm beforehand, `planned_x_pairs`), what it ran
with the wgmma kernel switched off ("Triton", `linear_nvfp4.WGMMA = False`) and M = 1.

Each tile is first checked on the first weight copy against the reference (fp32 out: |out - ref| <= 1e-5 *
sum|x||w| + 1e-6 |ref|; a fragment on the wrong K position misses by O(sum|x||w|)); a tile that fails, or
that does not compile, fit or launch, is reported and not timed. Then rounds: every (tile, M) and the
planner's calls timed in a CUDA graph of MIN_CALLS calls over weight copies past the L2, the order reversed
every other round (the power cap slows whichever runs after a heavy launch), each time beside its floor (the
packed weights and scales over the copy bandwidth measured in the same run). The kernel runs on x's pairs made
beforehand (as the heads' final norm makes them), so only the GEMM is timed. Every wgmma row, the tiles', the
peers' and the planner's, is a programmatic dependent launch where `x_pass_pdl` allows, as the planner launches
it after x's pass: in the graph each call may start while the one before it ends. The Triton rows launch as
their plan does (the same where it reads x's pairs; a plan without them waits for the call before).

    python3 scripts/sweep_wgmma.py [--shapes lm_head_qwen,lm_head_glm] [--ms 2,4,8,16,32] [--rounds 2]
        [--tiles 128x8w-3,64x4w-4,...] [--peer old.py [--peer new.py ...] [--peer-tiles 128x8w-2,64x4w-3,...]]

--peer times another version of the kernel's module beside this one, with its own `TILES` (the planner's
tile at each M), checked first like the tiles: e.g. the last commit's, made by
`git show HEAD:kernels/gemm_nvfp4_wgmma.py > diag/old_wgmma.py` (the device takes untracked files along).
Each --peer adds one, named by its file's stem. --peer-tiles times each peer at these tiles too (names from
`TILES`), beside its own.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import statistics
import sys

import torch
import triton

from mtpfactory.kernels.gemm_nvfp4_wgmma import ORDER, WgmmaTile, gemm_nvfp4_wgmma
from mtpfactory.kernels.linear_nvfp4 import XPairs, linear_nvfp4_triton, planned_x_pairs
from mtpfactory.kernels.rms_norm import rms_norm_triton
from mtpfactory.quant import dequantize_nvfp4, quantize_nvfp4

linear_nvfp4 = importlib.import_module("mtpfactory.kernels.linear_nvfp4")
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import MIN_CALLS, ROTATE_BYTES, SHAPES, alternating, copy_bandwidth, weight_bytes  # noqa: E402
from sass_stats import load_peer  # noqa: E402
from tune_gemv import time_us  # noqa: E402

TILES = {  # name: rows a program, consumer warps, ring stages (K steps of 256: `ORDER`), -pN: the steps in N parts,
    #          -rN: N registers a thread at launch (the consumers': `WgmmaTile.consumer_regs`)
    "128x8w-2-p4-r56": WgmmaTile(stages=2, parts=4, maxnreg=56),
    "128x8w-3-p4-r56": WgmmaTile(stages=3, parts=4, maxnreg=56),
    "128x8w-2-p2-r64": WgmmaTile(stages=2, parts=2, maxnreg=64),
    "128x8w-3-p2-r64": WgmmaTile(stages=3, parts=2, maxnreg=64),
    "128x8w-3-p4-r80": WgmmaTile(stages=3, parts=4, maxnreg=80),
    "64x4w-2-p2-r48": WgmmaTile(bn=64, warps=4, stages=2, parts=2, maxnreg=48),
    "64x4w-3-p2-r48": WgmmaTile(bn=64, warps=4, stages=3, parts=2, maxnreg=48),
    "64x4w-4-p2-r48": WgmmaTile(bn=64, warps=4, stages=4, parts=2, maxnreg=48),
    "64x4w-3-p4-r48": WgmmaTile(bn=64, warps=4, stages=3, parts=4, maxnreg=48),
    "256x16w-2-p4-r64": WgmmaTile(bn=256, warps=16, stages=2, parts=4, maxnreg=64),
}


def x_pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's pass of x [M, K] in one K slice and the kernel's order: (fp16 [M, K], exps [M, 1])."""
    made = XPairs.empty(x.shape[0], x.shape[1], x.shape[1], x.device, ORDER).fill(x)
    return made.pairs.view(torch.float16), made.exps


def wgmma_call(x: torch.Tensor, t: tuple, tile: WgmmaTile, out: torch.Tensor, launch=gemm_nvfp4_wgmma):
    """One launch of the kernel at `tile` on x's pairs made beforehand, launched as the planner launches it
    (`_run_planned`: a programmatic dependent launch where `x_pass_pdl` allows), so that in a graph each
    call may start while the one before it ends, as the planner's rows do."""
    x16, exps = x_pairs(x)
    weight, scale, scale_2 = t
    words, bits, s2 = weight.view(torch.int32), scale.view(torch.uint8), scale_2.reshape(1)
    pdl = linear_nvfp4.x_pass_pdl(x)
    return lambda: launch(x16, exps, words, bits, s2, out, pdl, tile)


def planner_call(x: torch.Tensor, t: tuple, wgmma: bool = True):
    """The heads' call: the LM head on pairs its final norm made (where the plan reads pairs); wgmma=False
    plans it with the wgmma kernel switched off (`linear_nvfp4.WGMMA`), its peer at the same M."""
    n, k = t[0].shape[0], x.shape[1]

    def planned(fn):
        linear_nvfp4.WGMMA = wgmma
        try:
            return fn()
        finally:
            linear_nvfp4.WGMMA = True

    made = planned(lambda: planned_x_pairs(x, n, k, True))
    y = x if made is None else rms_norm_triton(x, torch.ones(k, device=x.device, dtype=x.dtype), 1e-6, False,
                                               x_pairs=made)
    return lambda: planned(lambda: linear_nvfp4_triton(y, *t, split_k=True, x_pairs=made))


def check(x: torch.Tensor, t: tuple, tile: WgmmaTile, launch=gemm_nvfp4_wgmma) -> str:
    out = torch.full((x.shape[0], t[0].shape[0]), float("nan"), device=x.device)
    try:
        wgmma_call(x, t, tile, out, launch)()
        torch.cuda.synchronize()
    except (triton.CompilationError, triton.OutOfResources, ValueError, TypeError, AttributeError) as e:
        # a scratch peer that does not compile, fit or launch is reported like a wrong one, and the rest still run
        return f"RAISES {type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"
    w = dequantize_nvfp4(*t)
    ref, bound = x.float() @ w.T, x.float().abs() @ w.abs().T
    excess = ((out - ref).abs() - (1e-5 * bound + 1e-6 * ref.abs())).max().item()
    return "ok" if excess <= 0 else f"FAILS by {excess:.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="lm_head_qwen,lm_head_glm")
    ap.add_argument("--ms", default="2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiles", default=",".join(TILES))
    ap.add_argument("--peer", action="append", default=[],
                    help="another version of the kernel's module, timed beside this one (repeatable)")
    ap.add_argument("--peer-tiles", default="", help="tiles (names from TILES) to time each peer at, beside its own")
    args = ap.parse_args()
    peers = {peer.__name__.removeprefix("peer_"): peer for peer in map(load_peer, args.peer)}
    ms = [int(v) for v in args.ms.split(",")]
    tiles = [t for t in args.tiles.split(",") if t]         # --tiles "" times the planner (and the peer) alone
    # (peer's name, its module, the tile or None for its own planner's)
    peer_tiles = [(name, peer, None) for name, peer in peers.items()]
    peer_tiles += [(f"{name} {t}", peer, TILES[t]) for name, peer in peers.items()
                   for t in args.peer_tiles.split(",") if t]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}")
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        torch.manual_seed(0)
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        first = quantize_nvfp4(w0)
        del w0
        copies = [first] + [tuple(v.clone() for v in first)
                            for _ in range(max(1, -(-ROTATE_BYTES // weight_bytes(first))) - 1)]
        floor = weight_bytes(first) / bw * 1e6
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in sorted(set(ms) | {1})}
        failed = set()
        for name in tiles:
            for m in ms:
                verdict = check(xs[m], first, TILES[name])
                print(f"{shape} {name:16s} M = {m:2d}: {verdict}")
                if verdict != "ok":
                    failed.add((name, m))
        for (name, peer, tile), m in itertools.product(peer_tiles, ms):
            verdict = check(xs[m], first, tile or peer.TILES[peer.block_m(m)], peer.gemm_nvfp4_wgmma)
            print(f"{shape} {name:16s} M = {m:2d}: {verdict}")
            if verdict != "ok":
                failed.add((name, m))
        outs = {m: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for m in xs}
        variants = {f"planner M={m}": [planner_call(xs[m], t) for t in copies] for m in [1] + ms}
        variants |= {f"Triton M={m}": [planner_call(xs[m], t, wgmma=False) for t in copies] for m in ms}
        for (name, peer, tile), m in itertools.product(peer_tiles, ms):
            if (name, m) not in failed:
                variants[f"{name} M={m}"] = [wgmma_call(xs[m], t, tile or peer.TILES[peer.block_m(m)], outs[m],
                                                        peer.gemm_nvfp4_wgmma) for t in copies]
        for name, m in itertools.product(tiles, ms):
            if (name, m) not in failed:
                variants[f"{name} M={m}"] = [wgmma_call(xs[m], t, TILES[name], outs[m]) for t in copies]
        times = {v: [] for v in variants}
        for _, order in alternating(variants, args.rounds):
            for v in order:
                calls = list(itertools.islice(itertools.cycle(variants[v]), MIN_CALLS))
                times[v].append(time_us(calls, 100))
        print(f"\n{shape} ({n} x {k}), floor {floor:.2f} us, {len(copies)} weight copies, {args.rounds} rounds")
        for v, ts in times.items():
            med = statistics.median(ts)
            print(f"  {v:28s} {med:8.2f} us ({floor / med:5.1%} of copy bandwidth; "
                  f"{min(ts):.2f}-{max(ts):.2f})")
        del copies
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
