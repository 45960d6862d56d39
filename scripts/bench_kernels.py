"""GEMV / small-M GEMM benchmark on the GPU: our Triton providers (BF16, W8A16 FP8 per row, W4A16 NVFP4)
beside their peers measured in the same run (cuBLAS BF16 through torch, torch._scaled_mm FP8 row-wise on x
quantized before the timing, gemlite's A16W8_FP8 and A16W4_NVFP when they compile), at the real shapes and
M = 1, 8, 32.

Each figure is the median of `triton.testing.do_bench` over CUDA-graph replays of one launch per weight copy
(each format's copies hold ROTATE_BYTES of its own bytes, far past the L2, and number at least MIN_CALLS),
printed beside its floor: the bytes the op must move (weight with its scales, x, out) over the device copy
bandwidth measured at the start. Every (M, provider) of a shape is timed once a round, the order reversed every
other round (the power cap slows whichever runs after a heavy launch); a row gives the median of its rounds and
their range, and each provider's largest-M over smallest-M ratio (M = 32 / M = 1 by default) comes from the same
rounds. On the LM heads, W4A16 is also timed after the head's final norm (with its residual), as the heads run
it: one op whose norm makes the GEMV's x pass (`rms_norm_linear_nvfp4`), beside the norm and then the GEMV
(which makes its own); their floor is the same op's bytes.

--net also prints each figure without do_bench's fixed cost a replay (see MIN_CALLS): graphs of the C calls
and of 2C, (T_2C - T_C) / C, beside the floor over the copy bandwidth measured the same way.

While it times, nvidia-smi logs the SM clock, power and the clock-event reasons (`gpu_clocks.py`; into --clocks,
else a temporary file); after a shape's rows, each row's line of what was logged while its rounds ran (in the
JSON too), so a board held at a lower clock shows beside its figures.

    python3 scripts/bench_kernels.py [--json PATH] [--shapes lm_head_qwen,fc] [--ms 1,8,32] [--rounds 3] [--net]
        [--no-gemlite] [--clocks CSV]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch
from triton.testing import do_bench

from mtpfactory.kernels.linear import linear_triton
from mtpfactory.kernels.linear_fp8 import linear_fp8_triton
from mtpfactory.kernels.linear_nvfp4 import linear_nvfp4_triton
from mtpfactory.kernels.rms_norm import rms_norm, rms_norm_triton
from mtpfactory.kernels.rms_norm_linear_nvfp4 import rms_norm_linear_nvfp4_triton
from mtpfactory.quant import quantize_fp8, quantize_nvfp4

sys.path.insert(0, __file__.rsplit("/", 1)[0])   # python3 -P leaves the script's folder off the path
from gpu_clocks import clock_log, logged, summary  # noqa: E402

SHAPES = {  # name: (N, K)
    "lm_head_qwen": (151936, 2048), "lm_head_glm": (154880, 4096), "fc": (2048, 4096), "q_proj": (8192, 2048),
    "expert": (512, 2048),
}
# Each format's weight copies together, per shape: 20 times the H200's 50 MB L2, so no copy is still in L2 when
# its turn comes round again.
ROTATE_BYTES = 2**30
# ...and at least this many calls per timed replay. do_bench clears the L2 before each replay by writing a 256 MB
# buffer; the replay then pays for writing its dirty lines back, plus the graph's launch: about 14 us a replay
# (BENCHMARKS.md, fourth run: at 2 calls a replay the W4A16 151936 x 2048 call timed 57.4 us where torch.profiler
# saw its kernels take 50.2 back to back). Copies sized by each format's own bytes make a replay move at least
# ROTATE_BYTES, so that cost is a few percent of a call at most; --net measures what is left of it.
MIN_CALLS = 16


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy (do_bench over single launches: the
    fixed cost of a sample is in it, as in every timing here; `copy_bandwidth_net` takes it out)."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def copy_bandwidth_net(pairs: int = MIN_CALLS, pair_bytes: int = 2**26) -> float:
    """`copy_bandwidth` without the fixed cost of a sample, timed as the kernels' rows are (`net_us`): a graph
    of `pairs` copies of pair_bytes each, every copy its own source and destination (together past the L2, as the
    kernels' weight copies are), against a graph of them twice. Prints T_C and the net time of a copy, so that a
    figure that cannot be (net below gross) can be read back to them. (The eighteenth run's version, one 2 GiB
    copy graphed once and twice, gave 2.72 TB/s net against 4.25 gross: a shape unlike any row it served as the
    floor of.)"""
    bufs = [(torch.randn(pair_bytes // 4, device="cuda"), torch.empty(pair_bytes // 4, device="cuda"))
            for _ in range(pairs)]
    calls = [lambda s=s, d=d: d.copy_(s) for s, d in bufs]
    one = replay_us(calls, 50, 300)
    net = net_us(calls, one, 50, 300)                                # one copy, us
    gross = 2 * pair_bytes * pairs / one / 1e6                        # TB/s
    print(f"# net copy: {pairs} copies of {pair_bytes >> 20} MiB, T_C {one:.1f} us ({gross:.3f} TB/s gross), "
          f"{net:.2f} us a copy net", flush=True)
    return 2 * pair_bytes / (net * 1e-6)                             # read + write


def replay_us(calls: list, warmup: int = 25, rep: int = 200) -> float:
    """Median time of one replay of a CUDA graph that launches each call once, in us (do_bench clears the L2
    before each replay). The calls run once before the capture: compiling and warming."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3


def net_us(calls: list, replay: float, warmup: int = 25, rep: int = 200) -> float:
    """One call's time without the fixed cost of a replay (MIN_CALLS): (T_2C - T_C) / C, from `replay` (T_C, a
    graph of the C calls, just timed) and a graph of each call twice. The calls' weight copies together are
    past the L2, so the second pass over them reads from memory as the first does."""
    return (replay_us(calls + calls, warmup, rep) - replay) / len(calls)


def write_rows(path: str | None, bw: float, rows: list[dict]) -> None:
    """The rows so far, with the copy bandwidth and the device, as JSON at `path` (none for None): rewritten after
    each group, so that a run cut at its time limit keeps what it timed."""
    if path:
        with open(path, "w") as f:
            json.dump({"copy_bw": bw, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|, in fp32: a row's error against its reference."""
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def alternating(keys, rounds: int):
    """(round, the keys in that round's order) for `rounds` rounds, the order reversed every other round: the
    power cap slows whichever variant runs after a heavy launch, so no variant always follows the same one.
    Each round lists `keys` as they are then (a variant dropped in one round is gone from the next)."""
    for r in range(rounds):
        yield r, (list(keys) if r % 2 == 0 else list(keys)[::-1])


def graph_time_us(calls: list, net: bool = False) -> tuple[float, bool, float]:
    """(one call's time, whether graphed, its `net_us` with net or nan): a CUDA graph launches each call (one
    per weight copy) once per replay, so host launch cost stays out. A provider that cannot be captured is timed
    launch by launch instead (False): the host's launch cost in, and the L2 cleared before every call, so its
    time does not compare with the graphed rows'."""
    try:
        t = replay_us(calls)
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        it = iter(range(1 << 62))
        ms = do_bench(lambda: calls[next(it) % len(calls)](), warmup=25, rep=200, return_mode="median")
        return ms * 1e3, False, math.nan
    return t / len(calls), True, net_us(calls, t) if net else math.nan


def formats(n: int, k: int, rotate_bytes: int = ROTATE_BYTES, min_copies: int = MIN_CALLS) -> dict:
    """Each format's weight copies, from random BF16 weights of realistic scale: at least min_copies, and enough
    that together they hold rotate_bytes of the format's own bytes. Copy 0 of every format comes from the same
    BF16 weight (the rows' errors are against it)."""
    quantize = {"bf16": lambda w: w, "fp8": quantize_fp8, "nvfp4": quantize_nvfp4}
    out = {f: [] for f in quantize}
    want = {}
    while True:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        for f, q in quantize.items():
            if len(out[f]) < want.get(f, 1):
                out[f].append(q(w))
        want = want or {f: max(min_copies, math.ceil(rotate_bytes / weight_bytes(c[0]))) for f, c in out.items()}
        if all(len(out[f]) >= want[f] for f in out):
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


def bench_shape(name: str, ms: list[int], args, bw: float, bw_net: float | None, clocks: str | None) -> list[dict]:
    """Time every provider at every M of one shape in args.rounds alternating rounds; print and return its rows,
    each with what `clocks` (nvidia-smi's log, or None) holds of the windows its rounds ran in. Everything it
    allocates (the weight copies, and the calls that hold them) is freed when it returns."""
    n, k = SHAPES[name]
    w = formats(n, k)
    peers = gemlite_peers(w, k) if args.gemlite else {}
    cases = {}   # (M, provider) -> (format, calls, error against its reference)
    for m in ms:
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
                cases[(m, pname)] = (fmt, calls, ((out - want).norm() / want.norm()).item())
            except Exception as e:  # noqa: BLE001
                print(f"# {name} M={m} {pname}: failed ({type(e).__name__}: {str(e)[:120]!r})")
    times = {c: [] for c in cases}
    nets = {c: [] for c in cases}
    windows = {c: [] for c in cases}
    graphed = {}
    for r, order in alternating(cases, args.rounds):
        for c in order:
            t0 = time.time()
            try:
                us, graphed[c], net = graph_time_us(cases[c][1], args.net)
            except Exception as e:  # noqa: BLE001
                print(f"# {name} M={c[0]} {c[1]}: failed ({type(e).__name__}: {str(e)[:120]!r})")
                del cases[c]
                continue
            windows[c].append((t0, time.time()))
            times[c].append(us)
            nets[c].append(net)
        print(f"# {name}: round {r + 1} of {args.rounds} timed", flush=True)
    rows = []
    for (m, pname), (fmt, _, err) in cases.items():
        ts = times[(m, pname)]
        us = statistics.median(ts)
        nbytes = weight_bytes(w[fmt][0]) + m * k * 2 + m * n * 2
        floor = nbytes / bw * 1e6
        row = dict(shape=name, n=n, k=k, m=m, provider=pname, us=us, us_min=min(ts), us_max=max(ts), us_rounds=ts,
                   floor_us=floor, pct_copy_bw=100 * floor / us, rel_err_vs_bf16=err, cuda_graph=graphed[(m, pname)])
        line = (f"{name:13s} {n:6d}x{k:<5d} M={m:<2d} {pname:33s} {us:9.2f} us ({min(ts):.2f}-{max(ts):.2f})  "
                f"floor {floor:8.2f} us {row['pct_copy_bw']:5.1f}% of copy BW  err {err:.1e}")
        if bw_net is not None:
            net, floor_net = statistics.median(nets[(m, pname)]), nbytes / bw_net * 1e6
            row.update(net_us=net, net_rounds=nets[(m, pname)], floor_net_us=floor_net)
            line += f"  net {net:9.2f} us, floor {floor_net:8.2f} us {100 * floor_net / net:5.1f}%"
        if not row["cuda_graph"]:
            line += "  NOT COMPARABLE: no graph (launch by launch: host launch cost in, L2 cleared before each call)"
        row["clocks"] = summary(logged(clocks, windows[(m, pname)])) if clocks else None
        rows.append(row)
        print(line)
    for row in rows if clocks else ():
        print(f"{name:13s} M={row['m']:<2d} {row['provider']:33s} while timed: {row['clocks']}")
    lo, hi = min(ms), max(ms)
    for pname in dict.fromkeys(p for _, p in cases):
        if lo < hi and (lo, pname) in cases and (hi, pname) in cases:
            t_lo, t_hi = times[(lo, pname)], times[(hi, pname)]
            per_round = [b / a for a, b in zip(t_lo, t_hi)]
            same = graphed[(lo, pname)] == graphed[(hi, pname)]
            print(f"{name:13s} {n:6d}x{k:<5d} M={hi}/M={lo} {pname:33s} "
                  f"{statistics.median(t_hi) / statistics.median(t_lo):5.2f}x (rounds {min(per_round):.2f}-"
                  f"{max(per_round):.2f}x){'' if same else '  NOT COMPARABLE: one M graphed, one not'}")
    sys.stdout.flush()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="timings of each row, the order reversed every other round")
    ap.add_argument("--net", action="store_true",
                    help="also time graphs of 2C calls and print (T_2C - T_C) / C, without do_bench's fixed cost")
    ap.add_argument("--no-gemlite", dest="gemlite", action="store_false",
                    help="leave gemlite's peers out (building its layers over every weight copy takes a while)")
    ap.add_argument("--clocks", default=None, help="nvidia-smi's log of the clocks while timing (CSV; default: a "
                    "temporary file)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    bw = copy_bandwidth()
    bw_net = copy_bandwidth_net() if args.net else None
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.3f} TB/s (read + write)"
          + ("" if bw_net is None else f", {bw_net / 1e12:.3f} TB/s net of do_bench's fixed cost a sample")
          + f"; {args.rounds} rounds", flush=True)
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    with clock_log(args.clocks) as clocks:
        if clocks is None:
            print("# no nvidia-smi: the clocks are not logged")
        for name in args.shapes.split(","):
            rows += bench_shape(name, ms, args, bw, bw_net, clocks)
            gc.collect()
            torch.cuda.empty_cache()
            if args.json:  # after every shape, so a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"copy_bw": bw, "copy_bw_net": bw_net, "rounds": args.rounds,
                               "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
