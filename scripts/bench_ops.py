"""The ops other than the linears on the GPU: fused MoE (BF16 and NVFP4 experts) and its routing, paged decode
attention (BF16 KV, FP8 with unit and with per-token scales), and the small ops (RMSNorm with its residual, NeoX
RoPE, argmax, the embedding gather, both cache writes), each Triton provider beside its reference measured in
the same run (the peer), each figure beside its floor: the bytes the op must move over the copy bandwidth
measured at the start, and its error against the reference (max |difference| over max |reference|, one call).
The references are timed in the first round only. Where the NVFP4 experts run as GEMVs (N <=
`moe.GEMV_MAX_ROWS`), the dot kernels they replace are timed beside them (`triton-dot`).

Timing as `bench_kernels.py` does it: the median of `do_bench` over CUDA-graph replays of C calls, in
alternating rounds. The MoE and attention calls each read their own experts or KV blocks (C routings, C block
ranges), so the L2 holds none of a call's bytes when its turn comes; the small ops reuse one input, as a
decode step does (what they read was just written). A reference that cannot be captured in a graph (MoE's,
whose expert loop reads the routing back to the host) is timed launch by launch and marked so. nvidia-smi logs
the clocks while it times (`gpu_clocks.py`, into --clocks, else a temporary file), and each row is followed by
what it logged while that row's rounds ran, as in `bench_kernels.py`.

    python3 scripts/bench_ops.py [--ops moe,attention,small] [--ms 1,8,32] [--rounds 3] [--json PATH]
        [--no-reference] [--clocks CSV] [--kernels]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import (alternating, copy_bandwidth, graph_time_us, max_rel_err, weight_bytes,  # noqa: E402
                           write_rows)
from gpu_clocks import clock_log, logged, summary  # noqa: E402

from mtpfactory import ops  # noqa: E402
from mtpfactory.kernels import moe  # noqa: E402
from mtpfactory.kernels.argmax import argmax  # noqa: E402
from mtpfactory.kernels.embedding import embedding  # noqa: E402
from mtpfactory.kernels.moe import fused_moe, fused_moe_nvfp4, moe_route_softmax  # noqa: E402
from mtpfactory.kernels.paged_attention import paged_decode_attention  # noqa: E402
from mtpfactory.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from mtpfactory.kernels.reshape_and_cache_fp8 import reshape_and_cache_fp8  # noqa: E402
from mtpfactory.kernels.rms_norm import rms_norm  # noqa: E402
from mtpfactory.kernels.rope import rope_inv_freq, rope_neox  # noqa: E402

CALLS = 16                                   # calls a replay, each on its own routing / block range
DEVICE = "cuda"
QWEN3_NEXT_MOE = dict(e=512, k=10, h=2048, i=512)
QWEN3_NEXT_ATTN = dict(hq=16, hkv=2, d=256, ctx=4096, bs=16)
QWEN3_NEXT_SMALL = dict(h=2048, v=151936, hq=16, hkv=2, d=256, blocks=4096, bs=16)
BF16 = torch.bfloat16


def nbytes(*ts) -> int:
    return weight_bytes(tuple(t for t in ts if t is not None))


def _dot_path(call):
    """`call` with the NVFP4 experts on the dot kernels whatever its rows (`moe.GEMV_MAX_ROWS` 0 while it
    launches; a graph captures the launches, so its replays keep the path)."""
    def run():
        rows, moe.GEMV_MAX_ROWS = moe.GEMV_MAX_ROWS, 0
        try:
            return call()
        finally:
            moe.GEMV_MAX_ROWS = rows
    return run


def _routings(n: int, e: int, k: int, gen) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CALLS (weights fp32 [n, k], ids int64 [n, k]) of distinct uniform random experts a row."""
    out = []
    for _ in range(CALLS):
        # contiguous, as the router writes them (a strided slice would add the launcher's copy to the time)
        ids = torch.rand(n, e, device=DEVICE, generator=gen).argsort(dim=1)[:, :k].contiguous()
        w = torch.rand(n, k, device=DEVICE, generator=gen)
        out.append((w / w.sum(1, keepdim=True), ids))
    return out


def moe_cases(ms: list[int]) -> list[tuple]:
    """(name, m, floor bytes, {provider: calls}) for fused MoE in BF16 and NVFP4 and the router. The floor
    counts the distinct selected experts' weights (and NVFP4's scales), x and out, averaged over the calls."""
    e, k, h, i = QWEN3_NEXT_MOE.values()
    gen = torch.Generator(DEVICE).manual_seed(0)
    w_gu = torch.randn(e, 2 * i, h, device=DEVICE, dtype=BF16, generator=gen) * h ** -0.5
    w_dn = torch.randn(e, h, i, device=DEVICE, dtype=BF16, generator=gen) * i ** -0.5
    # NVFP4 experts from random codes and scales (the kernels' work does not depend on the values): scales
    # 2^-3 .. 2^1 as E4M3 bytes (exponent fields 4 .. 8), globals that keep the outputs O(1)
    def scale(*s):
        bits = (torch.randint(4, 9, s, device=DEVICE, generator=gen) << 3) | torch.randint(0, 8, s, device=DEVICE,
                                                                                          generator=gen)
        return bits.to(torch.uint8).view(torch.float8_e4m3fn)
    q = dict(gu_weight=torch.randint(0, 256, (e, 2 * i, h // 2), device=DEVICE, dtype=torch.uint8, generator=gen),
             gu_scale=scale(e, 2 * i, h // 16),
             gu_global=torch.full((e, 2), 1 / (3 * h ** 0.5), device=DEVICE),
             dn_weight=torch.randint(0, 256, (e, h, i // 2), device=DEVICE, dtype=torch.uint8, generator=gen),
             dn_scale=scale(e, h, i // 16), dn_global=torch.full((e,), 1 / (3 * i ** 0.5), device=DEVICE))
    per_expert = {"bf16": nbytes(w_gu[0], w_dn[0]),
                  "nvfp4": nbytes(q["gu_weight"][0], q["gu_scale"][0], q["dn_weight"][0], q["dn_scale"][0])}
    cases = []
    for m in ms:
        x = torch.randn(m, h, device=DEVICE, dtype=BF16, generator=gen)
        routes = _routings(m, e, k, gen)
        distinct = statistics.mean(len(ids.unique()) for _, ids in routes)
        io = nbytes(x) * 2 + nbytes(*routes[0])
        for fmt, op, args in (("bf16", fused_moe, dict(w_gate_up=w_gu, w_down=w_dn)),
                              ("nvfp4", fused_moe_nvfp4, q)):
            ws = torch.empty(m * k, i, device=DEVICE, dtype=BF16)
            outs = [torch.empty_like(x) for _ in routes]
            # every name a call uses bound now (default arguments): the loops rebind op, args, x and ws
            fast = [lambda op=op, x=x, args=args, w=w, d=d, o=o, ws=ws: _with("triton", op, x, **args, topk_weights=w,
                                                                           topk_ids=d, out=o, workspace=ws)
                    for (w, d), o in zip(routes, outs)]
            ref = [lambda op=op, x=x, args=args, w=w, d=d: op.reference(x, **args, topk_weights=w, topk_ids=d)
                   for w, d in routes]
            provs = {"triton": fast, "reference": ref}
            if fmt == "nvfp4" and m <= moe.GEMV_MAX_ROWS:   # the provider's GEMVs here: the dot kernels beside them
                provs["triton-dot"] = [_dot_path(c) for c in fast]
            cases.append((f"fused_moe {fmt} E={e} k={k} H={h} I={i}", m, distinct * per_expert[fmt] + io, provs))
        logits = [torch.randn(m, e, device=DEVICE, dtype=BF16, generator=gen) for _ in range(CALLS)]
        cases.append((f"moe_route_softmax E={e} k={k}", m, nbytes(logits[0]) + m * k * 12,
                      {"triton": [lambda lg=lg, k=k: _with("triton", moe_route_softmax, lg, k, True) for lg in logits],
                       "reference": [lambda lg=lg, k=k: moe_route_softmax.reference(lg, k, True) for lg in logits]}))
    return cases


def _with(backend: str, op, *args, **kwargs):
    with ops.use_backend(backend):
        return op(*args, **kwargs)


# the KV formats timed, each with its rows' label: kv=bf16; kv=fp8 (unit scales, its default); kv=fp8 with kv_exact
KV_FORMATS = {"bf16": "bf16", "fp8": "fp8 (unit scales)", "fp8_scaled": "fp8 (scales)"}


def attention_setups(ms: list[int], kvs: tuple[str, ...] = tuple(KV_FORMATS), context: int | None = None):
    """(name, batch, floor bytes, [each call's operands]) for paged decode attention with the output gate, for
    each KV format of `kvs` (`KV_FORMATS`: BF16, FP8 with unit scales, FP8 with per-token scales), every
    sequence at the same context (`context` tokens, a multiple of the block; None: QWEN3_NEXT_ATTN's); each call
    its own blocks. The floor counts K and V of the contexts (and their scales), q, the gate and out."""
    hq, hkv, d, ctx, bs = QWEN3_NEXT_ATTN.values()
    ctx = context or ctx
    gen = torch.Generator(DEVICE).manual_seed(1)
    per_seq = ctx // bs
    for b in ms:
        blocks = CALLS * b * per_seq
        q = torch.randn(b, hq, d, device=DEVICE, dtype=BF16, generator=gen)
        gate = torch.randn(b, hq, d, device=DEVICE, dtype=BF16, generator=gen)
        lens = torch.full((b,), ctx, device=DEVICE, dtype=torch.int32)
        tables = torch.randperm(blocks, device=DEVICE, generator=gen).view(CALLS, b, per_seq).int()
        for kv in kvs:
            shape = (blocks, bs, hkv, d)
            ks = vs = None
            if kv == "bf16":
                kc = torch.randn(shape, device=DEVICE, dtype=BF16, generator=gen)
                vc = torch.randn(shape, device=DEVICE, dtype=BF16, generator=gen)
            else:
                kc = torch.randn(shape, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
                vc = torch.randn(shape, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
                if kv == "fp8_scaled":
                    ks = torch.rand(shape[:3], device=DEVICE, generator=gen) + 0.5
                    vs = torch.rand(shape[:3], device=DEVICE, generator=gen) + 0.5
            per_token = (nbytes(kc[0, 0]) + nbytes(vc[0, 0]) + (nbytes(ks[0, 0]) * 2 if ks is not None else 0))
            yield (f"paged_decode_attention {KV_FORMATS[kv]} KV, {hq}/{hkv} heads x {d}, context {ctx}", b,
                   b * ctx * per_token + 3 * nbytes(q),
                   [(q, kc, vc, tables[c], lens, d ** -0.5, gate, ks, vs) for c in range(CALLS)])
            del kc, vc, ks, vs   # the next caches are built with these freed, where the caller let go of them too


def attention_cases(ms: list[int]) -> list[tuple]:
    """(name, batch, floor bytes, {provider: calls}): `attention_setups` through the op and its reference."""
    cases = []
    for name, b, floor, calls in attention_setups(ms):
        outs = [torch.empty_like(a[0]) for a in calls]
        cases.append((name, b, floor, {"triton": [lambda a=a, o=o: _with("triton", paged_decode_attention, *a, out=o)
                                                  for a, o in zip(calls, outs)],
                                       "reference": [lambda a=a: paged_decode_attention.reference(*a) for a in calls]}))
    return cases


def small_cases(ms: list[int]) -> list[tuple]:
    """(name, rows, floor bytes, {provider: calls}): the decode step's small ops at their Qwen3-Next shapes."""
    gen = torch.Generator(DEVICE).manual_seed(2)
    h, v, hq, hkv, d, blocks, bs = QWEN3_NEXT_SMALL.values()
    table = torch.randn(v, h, device=DEVICE, dtype=BF16, generator=gen)
    kc, vc = (torch.zeros(blocks, bs, hkv, d, device=DEVICE, dtype=BF16) for _ in range(2))
    k8, v8 = (torch.zeros(blocks, bs, hkv, d, device=DEVICE, dtype=torch.float8_e4m3fn) for _ in range(2))
    s8 = [torch.ones(blocks, bs, hkv, device=DEVICE) for _ in range(2)]
    inv_freq = rope_inv_freq(d // 4, 1e7).to(DEVICE)      # Qwen3-Next: a quarter of the head rotated
    cases = []
    for m in ms:
        x = torch.randn(m, h, device=DEVICE, dtype=BF16, generator=gen)
        res = torch.randn_like(x)
        w = torch.randn(h, device=DEVICE, dtype=BF16, generator=gen)
        qk = torch.randn(m, hq, d, device=DEVICE, dtype=BF16, generator=gen)
        pos = torch.randint(0, 4096, (m,), device=DEVICE, generator=gen)
        logits = torch.randn(m, v, device=DEVICE, generator=gen)
        ids = torch.randint(0, v, (m,), device=DEVICE, generator=gen)
        kv = torch.randn(m, hkv, d, device=DEVICE, dtype=BF16, generator=gen)
        slots = torch.randperm(blocks * bs, device=DEVICE, generator=gen)[:m]
        todo = {                                          # name: (floor bytes, op, arguments)
            f"rms_norm + residual H={h}": (4 * nbytes(x) + nbytes(w), rms_norm, (x, w, 1e-6, True, res)),
            f"rope_neox {hq} x {d}, rotary {d // 4}": (2 * nbytes(qk) + nbytes(pos), rope_neox, (qk, pos, inv_freq)),
            f"argmax V={v} fp32": (nbytes(logits) + 8 * m, argmax, (logits,)),
            f"embedding V={v} H={h}": (2 * nbytes(x) + nbytes(ids), embedding, (ids, table)),
            f"reshape_and_cache bf16 {hkv} x {d}": (4 * nbytes(kv), reshape_and_cache, (kv, kv, kc, vc, slots)),
            f"reshape_and_cache_fp8 {hkv} x {d}, per-token scales": (3 * nbytes(kv) + 8 * m * hkv,
                                                                reshape_and_cache_fp8, (kv, kv, k8, v8, slots, *s8)),
        }
        for name, (floor, op, args) in todo.items():
            cases.append((name, m, floor, {"triton": [lambda op=op, a=args: _with("triton", op, *a)] * CALLS,
                                           "reference": [lambda op=op, a=args: op.reference(*a)] * CALLS}))
    return cases


def _error(provs: dict, p: str) -> float:
    """max |p - reference| / max |reference| of one call of each (the first element of a tuple result); nan
    for ops that return nothing (the cache writes, checked by the tests)."""
    got, want = provs[p][0](), provs["reference"][0]()
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    return float("nan") if got is None else max_rel_err(got, want)


def kernel_times(calls: list) -> dict[str, float]:
    """Each GPU kernel the calls launch and its time a call in us, from torch.profiler over one eager pass of
    the calls after a warm one: where a provider's time goes (the twenty-ninth run found attention's reduce this
    way). A programmatic dependent launch (`launch_pdl`) starts before the kernel it follows ends, so its time
    counts its wait too (MoE's blend at N = 8 under `moe.moe_pdl`: 56 us for 2.5 us of work); the kernels' times
    then add up to more than the call's. Empty without a GPU (the calls not run)."""
    if not torch.cuda.is_available():
        return {}
    for c in calls:
        c()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for c in calls:
            c()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = short_kernel_name(ev.name)
            times[name] = times.get(name, 0.0) + ev.device_time / len(calls)
    return times


def short_kernel_name(name: str) -> str:
    """A kernel's name without its template arguments and parameters: torch's copy kernel demangles to a
    thousand characters of lambdas ("void at::native::elementwise_kernel<128, 2, ...>(int, ...)")."""
    name = name.removeprefix("void ")
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    return name[:cut]


def run(cases: list[tuple], bw: float, rounds: int, reference: bool, clocks: str | None = None,
        kernels: bool = False) -> list[dict]:
    """Time every case's providers in `rounds` alternating rounds; the references (the peers: MoE's takes up
    to about 0.1 s a call, launch by launch) in the first round only, or not at all without `reference`. With
    `clocks` (nvidia-smi's log, `gpu_clocks.clock_log`), each row also says what it logged while its rounds ran;
    with `kernels`, each provider's kernels and their time a call (`kernel_times`, eager: not the graph's)."""
    times = {(c, p): [] for c in range(len(cases)) for p in cases[c][3] if reference or p != "reference"}
    windows = {key: [] for key in times}
    graphed = {}
    errs = {(c, p): _error(provs, p) for c, (_, _, _, provs) in enumerate(cases) for p in provs if p != "reference"}
    for r, order in alternating(list(times), rounds):
        for key in order:
            c, p = key
            if p == "reference" and r > 0:
                continue
            t0 = time.time()
            try:
                us, graphed[key], _ = graph_time_us(cases[c][3][p])
            except Exception as e:  # noqa: BLE001
                print(f"# {cases[c][0]} {cases[c][1]} {p}: failed ({type(e).__name__}: {str(e)[:160]!r})")
                continue
            windows[key].append((t0, time.time()))
            times[key].append(us)
        print(f"# round {r + 1} of {rounds} timed", flush=True)
    rows = []
    for c, (name, m, floor_bytes, provs) in enumerate(cases):
        floor = floor_bytes / bw * 1e6
        peer = statistics.median(times.get((c, "reference")) or [float("nan")])
        for p in provs:
            ts = times.get((c, p))
            if not ts:
                continue
            us = statistics.median(ts)
            row = dict(op=name, m=m, provider=p, us=us, us_rounds=ts, floor_us=floor, pct_copy_bw=100 * floor / us,
                       cuda_graph=graphed[(c, p)], peer_us=peer, rel_err=errs.get((c, p), float("nan")),
                       clocks=summary(logged(clocks, windows[(c, p)])) if clocks else None,
                       kernels=kernel_times(provs[p]) if kernels and p != "reference" else None)
            rows.append(row)
            print(f"{name:58s} M={m:<3d} {p:10s} {us:9.2f} us ({min(ts):.2f}-{max(ts):.2f})  floor {floor:8.2f} us "
                  f"{row['pct_copy_bw']:5.1f}%  reference {peer:9.2f} us  err {row['rel_err']:.1e}"
                  + ("" if row["cuda_graph"] else "  (launch by launch: not graphed)"), flush=True)
            if row["kernels"] is not None:
                print("    kernels a call: " + ("; ".join(f"{k} {v:.2f} us" for k, v in row["kernels"].items())
                                               or "none on a GPU"), flush=True)
    for row in rows if clocks else ():
        print(f"{row['op']:58s} M={row['m']:<3d} {row['provider']:10s} while timed: {row['clocks']}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="moe,attention,small")
    ap.add_argument("--ms", default="1,8,32", help="rows (MoE, small ops) or sequences (attention)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="leave the references (the peers) out: for runs compared with one that timed them")
    ap.add_argument("--kernels", action="store_true", help="also each provider's GPU kernels and their time a "
                    "call (torch.profiler over eager calls)")
    ap.add_argument("--clocks", default=None, help="nvidia-smi's log of the clocks while timing (CSV; default: a "
                    "temporary file)")
    args = ap.parse_args()
    known = {"moe": moe_cases, "attention": attention_cases, "small": small_cases}
    groups = args.ops.split(",")
    if bad := [g for g in groups if g not in known]:
        ap.error(f"--ops {','.join(bad)}: choose from {','.join(known)}")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.3f} TB/s (read + write); "
          f"{args.rounds} rounds, {CALLS} calls a replay", flush=True)
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    with clock_log(args.clocks) as clocks:
        if clocks is None:
            print("# no nvidia-smi: the clocks are not logged")
        for g in groups:
            rows += run(known[g](ms), bw, args.rounds, args.reference, clocks, args.kernels)
            torch.cuda.empty_cache()
            write_rows(args.json, bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
