"""GEMV / small-M GEMM benchmark on the GPU: our Triton providers (BF16, W8A16 FP8 per row, W4A16 NVFP4)
beside their peers measured in the same run (cuBLAS BF16 through torch, torch._scaled_mm FP8 row-wise,
gemlite's A16W8_FP8 and A16W4_NVFP when they compile), at the real shapes and M = 1, 8, 32.

Each figure is the median of `triton.testing.do_bench` over CUDA-graph replays of one launch per buffer
across rotating copies of the weight (together larger than L2, and at least MIN_CALLS of them), printed
beside its floor: the bytes the op must move (weight with its scales, x, out) over the device copy
bandwidth measured at the start. On the LM heads, W4A16 is also timed after the head's final norm (with its
residual), as the heads run it: one op whose norm makes the GEMV's x pass (`rms_norm_linear_nvfp4`), beside
the norm and then the GEMV (which makes its own); their floor is the same op's bytes.

    python3 scripts/bench_kernels.py [--json PATH] [--shapes lm_head_qwen,fc] [--ms 1,8,32] [--no-gemlite]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from triton.testing import do_bench

from mtpfactory.kernels.linear import linear_triton
from mtpfactory.kernels.linear_fp8 import linear_fp8_triton
from mtpfactory.kernels.linear_nvfp4 import linear_nvfp4_triton
from mtpfactory.kernels.rms_norm import rms_norm, rms_norm_triton
from mtpfactory.kernels.rms_norm_linear_nvfp4 import rms_norm_linear_nvfp4_triton
from mtpfactory.quant import quantize_fp8, quantize_nvfp4

SHAPES = {  # name: (N, K)
    "lm_head_qwen": (151936, 2048), "lm_head_glm": (154880, 4096), "fc": (2048, 4096), "q_proj": (8192, 2048),
    "expert": (512, 2048),
}
ROTATE_BYTES = 512 * 2**20  # weights cycled per timing: several times the H200's 60 MB L2
# ...and at least this many calls per timed replay: do_bench clears the L2 before each replay by writing a
# 256 MB buffer, and the replay then pays for writing its dirty lines back, plus the graph's launch. The LM
# heads used to rotate 2 copies: on 2026-12-03 the W4A16 151936 x 2048 call timed 57.4 us that way, while
# torch.profiler saw its two kernels take 50.2 us back to back in the same kind of graph (BENCHMARKS.md,
# fourth run). 16 calls a replay spread that fixed cost thin (not yet re-timed on the H200).
MIN_CALLS = 16


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def graph_time_us(calls: list) -> tuple[float, bool]:
    """Median time of one call: a CUDA graph launches each call (one per weight copy) once per replay, so
    host launch cost stays out. A provider that cannot be captured is timed launch by launch (False)."""
    for c in calls:  # compile / warm outside the capture
        c()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        it = iter(range(1 << 62))
        ms = do_bench(lambda: calls[next(it) % len(calls)](), warmup=25, rep=200, return_mode="median")
        return ms * 1e3, False
    ms = do_bench(g.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3 / len(calls), True


def formats(n: int, k: int, copies: int) -> dict:
    """Each format's weight copies, made once from random BF16 weights of realistic scale."""
    out = {"bf16": [], "fp8": [], "nvfp4": []}
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        out["bf16"].append(w)
        out["fp8"].append(quantize_fp8(w))
        out["nvfp4"].append(quantize_nvfp4(w))
    return out


def weight_bytes(w) -> int:
    ts = w if isinstance(w, tuple) else (w,)
    return sum(t.numel() * t.element_size() for t in ts)


def gemlite_peers(w: dict, k: int) -> dict:
    """gemlite's A16W8_FP8 and A16W4_NVFP layers over the same BF16 weight copies, where they build."""
    try:
        from gemlite.helper import A16W4_NVFP, A16W8_FP8
    except ImportError:
        print("# gemlite not installed: its rows are skipped")
        return {}
    out = {}
    for name, proc, fmt in (("gemlite A16W8_FP8", A16W8_FP8, "fp8"), ("gemlite A16W4_NVFP", A16W4_NVFP, "nvfp4")):
        try:
            layers = []
            for wb in w["bf16"]:
                lin = torch.nn.Linear(k, wb.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
                lin.weight.data.copy_(wb)
                layers.append(proc(device="cuda", dtype=torch.bfloat16).from_linear(lin))
            layers[0](torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
            out[name] = (fmt, layers)
        except Exception as e:  # noqa: BLE001  (a peer that does not build is reported, not fatal)
            print(f"# {name}: unavailable ({type(e).__name__}: {str(e)[:120]!r})")
    return out


# the rows that norm x + residual first (their reference: the BF16 weight times the reference norm)
AFTER_NORM = ("ours w4a16 split-K after its norm", "norm, then ours w4a16 split-K")


def after_norm_providers(w: dict, x: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor) -> dict:
    """AFTER_NORM's rows: the zero-centred final norm of x + res and the W4A16 LM head (split lever on, as the
    heads' default), as one op and as the two providers in turn."""
    return {AFTER_NORM[0]: ("nvfp4", [lambda t=t: rms_norm_linear_nvfp4_triton(x, norm_w, 1e-6, True, *t,
                                                                               residual=res)[0]
                                      for t in w["nvfp4"]]),
            AFTER_NORM[1]: ("nvfp4", [lambda t=t: linear_nvfp4_triton(rms_norm_triton(x, norm_w, 1e-6, True, res)[0],
                                                                      *t, split_k=True) for t in w["nvfp4"]])}


def providers(w: dict, x: torch.Tensor, gemlite_layers: dict) -> dict:
    """name -> (format, [one call per weight copy])."""
    p = {
        "ours bf16": ("bf16", [lambda t=t: linear_triton(x, t) for t in w["bf16"]]),
        "ours bf16 split-K": ("bf16", [lambda t=t: linear_triton(x, t, split_k=True) for t in w["bf16"]]),
        "cuBLAS bf16": ("bf16", [lambda t=t: torch.nn.functional.linear(x, t) for t in w["bf16"]]),
        "ours w8a16": ("fp8", [lambda t=t: linear_fp8_triton(x, *t) for t in w["fp8"]]),
        "ours w8a16 split-K": ("fp8", [lambda t=t: linear_fp8_triton(x, *t, split_k=True) for t in w["fp8"]]),
        "ours w4a16": ("nvfp4", [lambda t=t: linear_nvfp4_triton(x, *t) for t in w["nvfp4"]]),
        "ours w4a16 split-K": ("nvfp4", [lambda t=t: linear_nvfp4_triton(x, *t, split_k=True) for t in w["nvfp4"]]),
    }
    # torch._scaled_mm, FP8 row-wise: x quantized per row once, outside the timing (a floor for it).
    xq, xs = quantize_fp8(x.float())
    p["torch._scaled_mm fp8 rowwise"] = ("fp8", [
        lambda t=t: torch._scaled_mm(xq, t[0].t(), scale_a=xs[:, None], scale_b=t[1][None, :],
                                     out_dtype=torch.bfloat16) for t in w["fp8"]])
    for pname, (fmt, layers) in gemlite_layers.items():
        p[pname] = (fmt, [lambda layer=layer: layer(x) for layer in layers])
    return p


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,8,32")
    ap.add_argument("--no-gemlite", dest="gemlite", action="store_false",
                    help="leave gemlite's peers out (building its layers over every weight copy takes a while)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(MIN_CALLS, math.ceil(ROTATE_BYTES / (n * k * 2)))
        w = formats(n, k, copies)
        peers = gemlite_peers(w, k) if args.gemlite else {}
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x.float(), w["bf16"][0].float())
            todo = providers(w, x, peers)
            if name.startswith("lm_head"):
                res = torch.randn_like(x)
                norm_w = 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
                todo.update(after_norm_providers(w, x, res, norm_w))
                x_normed = rms_norm.reference(x, norm_w, 1e-6, True, res)[0]
                ref_normed = torch.nn.functional.linear(x_normed.float(), w["bf16"][0].float())
            for pname, (fmt, calls) in todo.items():
                want = ref_normed if pname in AFTER_NORM else ref
                try:
                    out = calls[0]().float()
                    err = ((out - want).norm() / want.norm()).item()
                    us, graphed = graph_time_us(calls)
                except Exception as e:  # noqa: BLE001
                    print(f"# {name} M={m} {pname}: failed ({type(e).__name__}: {str(e)[:120]!r})")
                    continue
                nbytes = weight_bytes(w[fmt][0]) + x.numel() * 2 + m * n * 2
                floor = nbytes / bw * 1e6
                row = dict(shape=name, n=n, k=k, m=m, provider=pname, us=us, floor_us=floor,
                           pct_copy_bw=100 * floor / us, rel_err_vs_bf16=err, cuda_graph=graphed)
                rows.append(row)
                print(f"{name:13s} {n:6d}x{k:<5d} M={m:<2d} {pname:30s} {us:9.2f} us  floor {floor:8.2f} us "
                      f"{row['pct_copy_bw']:5.1f}% of copy BW  err {err:.1e}{'' if graphed else '  (no graph)'}", flush=True)
            del x
        del w, peers
        torch.cuda.empty_cache()
        if args.json:  # after every shape, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"copy_bw": bw, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
