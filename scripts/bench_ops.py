"""The ops other than the linears on the GPU: fused MoE (BF16 and NVFP4 experts) and its routing, paged decode
attention (BF16 and FP8 KV), and the small ops (RMSNorm with its residual, NeoX RoPE, argmax, the embedding
gather, both cache writes), each Triton provider beside its reference measured in the same run (the peer),
each figure beside its floor: the bytes the op must move over the copy bandwidth measured at the start.

Timing as `bench_kernels.py` does it: the median of `do_bench` over CUDA-graph replays of C calls, in
alternating rounds. The MoE and attention calls each read their own experts or KV blocks (C routings, C block
ranges), so the L2 holds none of a call's bytes when its turn comes; the small ops reuse one input, as a
decode step does (what they read was just written). A reference that cannot be captured in a graph (MoE's,
whose expert loop reads the routing back to the host) is timed launch by launch and marked so.

    python3 scripts/bench_ops.py [--ops moe,attention,small] [--ms 1,8,32] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import alternating, copy_bandwidth, graph_time_us  # noqa: E402

from mtpfactory.kernels.argmax import argmax  # noqa: E402
from mtpfactory.kernels.embedding import embedding  # noqa: E402
from mtpfactory.kernels.moe import fused_moe, fused_moe_nvfp4, moe_route_softmax  # noqa: E402
from mtpfactory.kernels.paged_attention import paged_decode_attention  # noqa: E402
from mtpfactory.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from mtpfactory.kernels.reshape_and_cache_fp8 import reshape_and_cache_fp8  # noqa: E402
from mtpfactory.kernels.rms_norm import rms_norm  # noqa: E402
from mtpfactory.kernels.rope import rope_inv_freq, rope_neox  # noqa: E402

CALLS = 16                                   # calls a replay, each on its own routing / block range
QWEN3_NEXT_MOE = dict(e=512, k=10, h=2048, i=512)
QWEN3_NEXT_ATTN = dict(hq=16, hkv=2, d=256, ctx=4096, bs=16)
BF16 = torch.bfloat16


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _routings(n: int, e: int, k: int, gen) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CALLS (weights fp32 [n, k], ids int64 [n, k]) of distinct uniform random experts a row."""
    out = []
    for _ in range(CALLS):
        ids = torch.rand(n, e, device="cuda", generator=gen).argsort(dim=1)[:, :k]
        w = torch.rand(n, k, device="cuda", generator=gen)
        out.append((w / w.sum(1, keepdim=True), ids))
    return out


def moe_cases(ms: list[int]) -> list[tuple]:
    """(name, m, floor bytes, {provider: calls}) for fused MoE in BF16 and NVFP4 and the router. The floor
    counts the distinct selected experts' weights (and NVFP4's scales), x and out, averaged over the calls."""
    e, k, h, i = QWEN3_NEXT_MOE.values()
    gen = torch.Generator("cuda").manual_seed(0)
    w_gu = torch.randn(e, 2 * i, h, device="cuda", dtype=BF16, generator=gen) * h ** -0.5
    w_dn = torch.randn(e, h, i, device="cuda", dtype=BF16, generator=gen) * i ** -0.5
    # NVFP4 experts from random codes and scales (the kernels' work does not depend on the values): scales
    # 2^-3 .. 2^1 as E4M3 bytes (exponent fields 4 .. 8), globals that keep the outputs O(1)
    scale = lambda *s: ((torch.randint(4, 9, s, device="cuda", generator=gen) << 3)          # noqa: E731
                        | torch.randint(0, 8, s, device="cuda", generator=gen)).to(torch.uint8).view(torch.float8_e4m3fn)
    q = dict(gu_weight=torch.randint(0, 256, (e, 2 * i, h // 2), device="cuda", dtype=torch.uint8, generator=gen),
             gu_scale=scale(e, 2 * i, h // 16),
             gu_global=torch.full((e, 2), 1 / (3 * h ** 0.5), device="cuda"),
             dn_weight=torch.randint(0, 256, (e, h, i // 2), device="cuda", dtype=torch.uint8, generator=gen),
             dn_scale=scale(e, h, i // 16), dn_global=torch.full((e,), 1 / (3 * i ** 0.5), device="cuda"))
    per_expert = {"bf16": nbytes(w_gu[0], w_dn[0]),
                  "nvfp4": nbytes(q["gu_weight"][0], q["gu_scale"][0], q["dn_weight"][0], q["dn_scale"][0])}
    cases = []
    for m in ms:
        x = torch.randn(m, h, device="cuda", dtype=BF16, generator=gen)
        routes = _routings(m, e, k, gen)
        distinct = statistics.mean(len(ids.unique()) for _, ids in routes)
        io = nbytes(x) * 2 + nbytes(*routes[0])
        for fmt, op, args in (("bf16", fused_moe, dict(w_gate_up=w_gu, w_down=w_dn)),
                              ("nvfp4", fused_moe_nvfp4, q)):
            ws = torch.empty(m * k, i, device="cuda", dtype=BF16)
            outs = [torch.empty_like(x) for _ in routes]
            fast = [lambda w=w, d=d, o=o: fused_moe_triton_call(op, x, args, w, d, o, ws)
                    for (w, d), o in zip(routes, outs)]
            ref = [lambda w=w, d=d: op.reference(x, **args, topk_weights=w, topk_ids=d) for w, d in routes]
            cases.append((f"fused_moe {fmt} E={e} k={k} H={h} I={i}", m, distinct * per_expert[fmt] + io,
                          {"triton": fast, "reference": ref}))
        logits = [torch.randn(m, e, device="cuda", dtype=BF16, generator=gen) for _ in range(CALLS)]
        cases.append((f"moe_route_softmax E={e} k={k}", m, nbytes(logits[0]) + m * k * 12,
                      {"triton": [lambda lg=lg: _with("triton", moe_route_softmax, lg, k, True) for lg in logits],
                       "reference": [lambda lg=lg: moe_route_softmax.reference(lg, k, True) for lg in logits]}))
    return cases


def _with(backend: str, op, *args, **kwargs):
    from mtpfactory import ops
    with ops.use_backend(backend):
        return op(*args, **kwargs)


def fused_moe_triton_call(op, x, args, w, ids, out, ws):
    return _with("triton", op, x, **args, topk_weights=w, topk_ids=ids, out=out, workspace=ws)


def attention_cases(ms: list[int]) -> list[tuple]:
    """(name, batch, floor bytes, {provider: calls}) for paged decode attention with the output gate, BF16 and
    FP8 KV (per-token scales), every sequence at the same context; each call its own blocks. The floor counts
    K and V of the contexts (and FP8's scales), q, the gate and out."""
    hq, hkv, d, ctx, bs = QWEN3_NEXT_ATTN.values()
    gen = torch.Generator("cuda").manual_seed(1)
    cases = []
    per_seq = ctx // bs
    for b in ms:
        blocks = CALLS * b * per_seq
        q = torch.randn(b, hq, d, device="cuda", dtype=BF16, generator=gen)
        gate = torch.randn(b, hq, d, device="cuda", dtype=BF16, generator=gen)
        lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        tables = torch.randperm(blocks, device="cuda", generator=gen).view(CALLS, b, per_seq).int()
        for kv in ("bf16", "fp8"):
            shape = (blocks, bs, hkv, d)
            if kv == "bf16":
                kc = torch.randn(shape, device="cuda", dtype=BF16, generator=gen)
                vc = torch.randn(shape, device="cuda", dtype=BF16, generator=gen)
                ks = vs = None
            else:
                kc = torch.randn(shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
                vc = torch.randn(shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
                ks = torch.rand(shape[:3], device="cuda", generator=gen) + 0.5
                vs = torch.rand(shape[:3], device="cuda", generator=gen) + 0.5
            per_token = (nbytes(kc[0, 0]) + nbytes(vc[0, 0]) + (nbytes(ks[0, 0]) * 2 if ks is not None else 0))
            floor = b * ctx * per_token + 3 * nbytes(q)
            outs = [torch.empty_like(q) for _ in range(CALLS)]
            args = lambda c: (q, kc, vc, tables[c], lens, d ** -0.5, gate, ks, vs)         # noqa: E731
            cases.append((f"paged_decode_attention {kv} KV, {hq}/{hkv} heads x {d}, context {ctx}", b, floor,
                          {"triton": [lambda c=c: _with("triton", paged_decode_attention, *args(c), out=outs[c])
                                      for c in range(CALLS)],
                           "reference": [lambda c=c: paged_decode_attention.reference(*args(c))
                                         for c in range(CALLS)]}))
    return cases


def small_cases(ms: list[int]) -> list[tuple]:
    """(name, rows, floor bytes, {provider: calls}): the decode step's small ops at their Qwen3-Next shapes."""
    gen = torch.Generator("cuda").manual_seed(2)
    h, v, hq, hkv, d = 2048, 151936, 16, 2, 256
    table = torch.randn(v, h, device="cuda", dtype=BF16, generator=gen)
    blocks, bs = 4096, 16
    kc, vc = (torch.zeros(blocks, bs, hkv, d, device="cuda", dtype=BF16) for _ in range(2))
    k8, v8 = (torch.zeros(blocks, bs, hkv, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2))
    s8 = [torch.ones(blocks, bs, hkv, device="cuda") for _ in range(2)]
    inv_freq = rope_inv_freq(64, 1e7).cuda()
    cases = []
    for m in ms:
        x = torch.randn(m, h, device="cuda", dtype=BF16, generator=gen)
        res = torch.randn_like(x)
        w = torch.randn(h, device="cuda", dtype=BF16, generator=gen)
        qk = torch.randn(m, hq, d, device="cuda", dtype=BF16, generator=gen)
        pos = torch.randint(0, 4096, (m,), device="cuda", generator=gen)
        logits = torch.randn(m, v, device="cuda", generator=gen)
        ids = torch.randint(0, v, (m,), device="cuda", generator=gen)
        kv = torch.randn(m, hkv, d, device="cuda", dtype=BF16, generator=gen)
        slots = torch.randperm(blocks * bs, device="cuda", generator=gen)[:m]
        todo = {
            "rms_norm + residual H=2048": (4 * nbytes(x) + nbytes(w), rms_norm, (x, w, 1e-6, True, res), {}),
            "rope_neox 16 x 256, rotary 64": (2 * nbytes(qk) + nbytes(pos), rope_neox, (qk, pos, inv_freq), {}),
            "argmax V=151936 fp32": (nbytes(logits) + 8 * m, argmax, (logits,), {}),
            "embedding V=151936 H=2048": (2 * nbytes(x) + nbytes(ids), embedding, (ids, table), {}),
            "reshape_and_cache bf16 2 x 256": (4 * nbytes(kv), reshape_and_cache, (kv, kv, kc, vc, slots), {}),
            "reshape_and_cache_fp8 2 x 256, per-token scales": (2 * nbytes(kv) + nbytes(kv) + 8 * m * hkv,
                                                                reshape_and_cache_fp8,
                                                                (kv, kv, k8, v8, slots, *s8), {}),
        }
        for name, (floor, op, args, kw) in todo.items():
            cases.append((name, m, floor, {"triton": [lambda op=op, a=args: _with("triton", op, *a)] * CALLS,
                                           "reference": [lambda op=op, a=args: op.reference(*a)] * CALLS}))
    return cases


def run(cases: list[tuple], bw: float, rounds: int) -> list[dict]:
    times = {(c, p): [] for c in range(len(cases)) for p in cases[c][3]}
    graphed = {}
    for r, order in alternating(list(times), rounds):
        for key in order:
            c, p = key
            try:
                us, graphed[key], _ = graph_time_us(cases[c][3][p])
            except Exception as e:  # noqa: BLE001
                print(f"# {cases[c][0]} {cases[c][1]} {p}: failed ({type(e).__name__}: {str(e)[:160]!r})")
                continue
            times[key].append(us)
        print(f"# round {r + 1} of {rounds} timed", flush=True)
    rows = []
    for c, (name, m, floor_bytes, provs) in enumerate(cases):
        floor = floor_bytes / bw * 1e6
        peer = statistics.median(times[(c, "reference")]) if times[(c, "reference")] else float("nan")
        for p in provs:
            ts = times[(c, p)]
            if not ts:
                continue
            us = statistics.median(ts)
            row = dict(op=name, m=m, provider=p, us=us, us_rounds=ts, floor_us=floor, pct_copy_bw=100 * floor / us,
                       cuda_graph=graphed[(c, p)], peer_us=peer)
            rows.append(row)
            print(f"{name:58s} M={m:<3d} {p:9s} {us:9.2f} us ({min(ts):.2f}-{max(ts):.2f})  floor {floor:8.2f} us "
                  f"{row['pct_copy_bw']:5.1f}%  reference {peer:9.2f} us"
                  + ("" if row["cuda_graph"] else "  (launch by launch: not graphed)"), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="moe,attention,small")
    ap.add_argument("--ms", default="1,8,32", help="rows (MoE, small ops) or sequences (attention)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
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
    for g in groups:
        rows += run(known[g](ms), bw, args.rounds)
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_bw": bw, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
