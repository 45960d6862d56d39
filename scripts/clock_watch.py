"""Why the W4A16 LM-head GEMV has slow windows: time the planner's plan at each M with the GEMV launched
beside x's pass (`x_pass_pdl`) and after it (--compare alone: the whole call and the GEMV alone, launched
plainly), alternately, round after round, with cuBLAS BF16 as the plain stream, while nvidia-smi logs the SM
clock, power and clock-event reasons every 200 ms; print each timing beside the clocks logged while it ran.
A slow timing under a lower SM clock points at the clock; one under the same clock does not. (2026-12-03:
the power cap, reason 0x4, at 680-700 W, takes the SM clock to 1.5 GHz.)
--compare dot times the NVFP4 LM head at M >= 5 on its fp16 dot (`uses_f16_dot`, after x's pass; the wgmma
kernel off) against the bf16 dot it replaced (TILES_NVFP4's plan).
--compare wgmma times it at M = 2-32 on the Gluon wgmma kernel (`GemvPlan.wgmma`) against the Triton kernels
(`WGMMA = False`: the GEMV of several rows, the bf16 dot, the fp16 dot).
--compare fused times the head's final norm (with its residual) and the NVFP4 LM head after it: as one op
(`rms_norm_linear_nvfp4`, the norm making x's pass) against the two providers in turn (the GEMV's own
pass), and the GEMV alone on pairs made beforehand (what the LM head costs when the norm makes its pass).
Launches are not all alike: the cuBLAS row, and every call that begins with x's pass or the norm, waits for the
call before it to end; the "gemv" rows of --compare fused launch the GEMV alone as a programmatic dependent
launch (`x_pass_pdl`, as the heads launch it after their norm), so in the graph each may start while the GEMV
before it ends: a head start of an estimated 0.5-1 us a call (not measured) that cuBLAS cannot be given.

    python3 scripts/clock_watch.py --csv out/clocks.csv [--rounds 12] [--shape lm_head_qwen] [--ms 1,2]
        [--formats nvfp4,fp8] [--compare pdl|alone|fused|dot|wgmma]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch

from mtpfactory.kernels.linear_fp8 import linear_fp8_triton
from mtpfactory.kernels.linear_nvfp4 import (
    XPairs,
    default_plan,
    linear_nvfp4_triton,
    planned_x_pairs,
)
from mtpfactory.kernels.rms_norm import rms_norm_triton
from mtpfactory.kernels.rms_norm_linear_nvfp4 import rms_norm_linear_nvfp4_triton

linear = importlib.import_module("mtpfactory.kernels.linear")   # the package exports the Ops
linear_nvfp4 = importlib.import_module("mtpfactory.kernels.linear_nvfp4")

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import MIN_CALLS, SHAPES, copy_bandwidth, formats, graph_time_us, weight_bytes  # noqa: E402
from gpu_clocks import clock_log, logged, summary  # noqa: E402
from tune_gemv import time_us  # noqa: E402

FORMATS = {"nvfp4": lambda x, t: linear_nvfp4_triton(x, *t),
           "fp8": lambda x, t: linear_fp8_triton(x, *t, split_k=True)}
class _NotLaunched:
    """Stands in for an x's pass kernel: its launches do nothing, so a call times the kernel after it alone
    (on whatever its buffers hold: the values do not change the time)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _pairs_swapped(items) -> list:
    """(a, b, c, d, ...) -> (b, a, d, c, ...)."""
    items = list(items)
    return [items[i ^ 1] for i in range(len(items))]


def fused_calls(label: str, x: torch.Tensor, weights: list) -> list:
    """--compare fused: one call a weight copy of the final norm of x + residual (zero-centred) and the NVFP4
    LM head (split lever on, as the heads' default), as `label` says: "fused" one op, "apart" the two
    providers in turn, "gemv" the LM head alone on pairs its norm made beforehand."""
    k = x.shape[1]
    res = torch.randn_like(x)
    norm_w = 0.1 * torch.randn(k, device=x.device, dtype=x.dtype)
    if label == "fused":
        return [lambda t=t: rms_norm_linear_nvfp4_triton(x, norm_w, 1e-6, True, *t, residual=res) for t in weights]
    if label == "apart":
        return [lambda t=t: linear_nvfp4_triton(rms_norm_triton(x, norm_w, 1e-6, True, res)[0], *t, split_k=True)
                for t in weights]
    n = weights[0][0].shape[0]
    x_pairs = planned_x_pairs(x, n, k, True)
    y, _ = rms_norm_triton(x, norm_w, 1e-6, True, res, x_pairs=x_pairs)
    return [lambda t=t: linear_nvfp4_triton(y, *t, split_k=True, x_pairs=x_pairs) for t in weights]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--shape", default="lm_head_qwen")
    ap.add_argument("--ms", default="1")
    ap.add_argument("--formats", default="nvfp4", help="nvfp4 and/or fp8 (W8A16 with the split lever, its default)")
    ap.add_argument("--compare", default="pdl", choices=["pdl", "alone", "fused", "dot", "wgmma"],
                    help="pdl: each call with and without PDL; alone: the whole call against the kernel after x's "
                         "pass alone (the pass not launched: what x's pairs written by the kernel before would cost); "
                         "fused: the final norm and the NVFP4 LM head as one op, as two, and the GEMV alone; "
                         "dot: NVFP4 at M >= 5 on the fp16 dot and on the bf16 dot; "
                         "wgmma: NVFP4 at M = 2-32 on the wgmma kernel and on the Triton kernels")
    args = ap.parse_args()
    n, k = SHAPES[args.shape]
    w = formats(n, k)   # bench_kernels.formats: ROTATE_BYTES of each format's own bytes, at least MIN_CALLS copies
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in map(int, args.ms.split(","))}
    labels = {"pdl": ("pdl", "no pdl"), "alone": ("whole", "alone"), "fused": ("fused", "apart", "gemv"),
              "dot": ("fp16 dot", "bf16 dot"), "wgmma": ("wgmma", "fp16 dot")}[args.compare]
    fmts = ["nvfp4"] if args.compare in ("fused", "dot", "wgmma") else args.formats.split(",")
    variants = {f"{fmt} M={m} {label}": (fmt, x, label) for fmt in fmts for m, x in xs.items() for label in labels}
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    shipped = default_plan(x, n, k, False)
    bw = copy_bandwidth()
    floor_us = {fmt: weight_bytes(w[fmt][0]) / bw * 1e6 for fmt in ("bf16", "fp8", "nvfp4")}
    print(f"{args.shape} {n}x{k}: copy bandwidth {bw / 1e12:.3f} TB/s, floors (us) {floor_us}; NVFP4 M = 1 {shipped}")
    if args.compare == "fused":
        print("# the gemv rows are programmatic dependent launches on the GEMV before them; the other rows and "
              "cuBLAS wait for the call before them to end (see the docstring)")
    # x's pass alone (the shipped plan's launch of it), to tell its share of the GEMV's time
    pairs = XPairs.empty(1, k, shipped.k_per_split, x.device)
    x_pass = [lambda: pairs.fill(x)] * MIN_CALLS
    print(f"x's pass alone: {time_us(x_pass, 200):.2f} us a launch (in a graph of {MIN_CALLS})")
    if args.compare == "fused":   # the norm alone, with and without making x's pass
        res = torch.randn_like(x)
        for made in (None, XPairs.empty(1, k, shipped.k_per_split, x.device)):
            norm = [lambda made=made: rms_norm_triton(x, x[0], 1e-6, True, res, x_pairs=made)] * MIN_CALLS
            print(f"the final norm alone, M = 1, {'making x pass' if made else 'plain'}: "
                  f"{time_us(norm, 200):.2f} us a launch")
    # one cuBLAS BF16 peer per round: a plain stream that the clock hypothesis says should not slow down
    xb = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    results = []
    x_passes = linear_nvfp4._x_f16_pairs_kernel, linear._x_f16_rows_kernel
    lm_head_min = linear_nvfp4.LM_HEAD_MIN_ELEMENTS
    wgmma = linear_nvfp4.WGMMA
    with clock_log(args.csv) as log:
        for r in range(args.rounds):
            # each pair in turn order A B, then B A (three: A B C, then C B A): the one after a heavier launch runs
            # under a lower clock (2026-12-03: up to 3% between identical launches)
            odd = list(variants.items())[::-1] if len(labels) > 2 else _pairs_swapped(variants.items())
            for name, (fmt, xv, label) in (variants.items() if r % 2 == 0 else odd):
                linear.X_PASS_PDL = label != "no pdl"     # read at launch: the graphs below capture it
                if label == "bf16 dot":   # the LM head planned and launched as a small weight: TILES_NVFP4's
                    linear_nvfp4.LM_HEAD_MIN_ELEMENTS = 1 << 62
                if label in ("fp16 dot", "bf16 dot"):   # the Triton dots, not the Gluon kernel
                    linear_nvfp4.WGMMA = False
                if label == "alone":
                    linear_nvfp4._x_f16_pairs_kernel = _NotLaunched()
                    linear._x_f16_rows_kernel = _NotLaunched()
                if args.compare == "fused":
                    calls = fused_calls(label, xv, w[fmt])
                else:
                    calls = [lambda t=t, xv=xv, f=FORMATS[fmt]: f(xv, t) for t in w[fmt]]
                t0 = time.time()
                us = time_us(calls, 200)
                g_us = graph_time_us(calls)[0]
                t1 = time.time()
                results.append((r, name, us, g_us, t0, t1))
                linear_nvfp4._x_f16_pairs_kernel, linear._x_f16_rows_kernel = x_passes
                linear_nvfp4.LM_HEAD_MIN_ELEMENTS = lm_head_min
                linear_nvfp4.WGMMA = wgmma
            linear.X_PASS_PDL = True
            t0 = time.time()
            b_us = time_us([lambda t=t: xb @ t.T for t in w["bf16"]], 200)
            results.append((r, "cublas bf16", b_us, float("nan"), t0, time.time()))
    for r, name, us, g_us, t0, t1 in results:
        floor = floor_us[name.split()[0].replace("cublas", "bf16")]
        print(f"round {r:2d} {name:16s} {us:7.2f} us ({floor / us:5.1%}) graph {g_us:7.2f} | "
              f"{summary(logged(log, [(t0, t1)]))}")
    for name in list(variants) + ["cublas bf16"]:
        v = [us for _, nm, us, *_ in results if nm == name]
        print(f"{name:16s} median {statistics.median(v):.2f} us, min {min(v):.2f}, max {max(v):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
