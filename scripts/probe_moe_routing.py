"""Why the bf16 MoE head's native path lands 2.4e-2 from the float32 oracle on a GPU (H100, 2026-12-05; 4.7e-3 on
the CPU, and the Triton path 4.7e-3 on the GPU), when cuBLAS's reduced-precision reduction is not the cause: a
routing flip (the router's logits rounded to bf16 choose another expert than float32's, in some row) or the
arithmetic. Builds a case of tests/heads/test_heads_gpu.py (its weights, prefills and steps) in float32 and
through both bf16 paths, records the experts every MoE call chooses, and prints for each bf16 path the rows
whose chosen experts differ from float32's, then each step's logit error against float32. Correctness only,
nothing is timed. Its answer on an H100 (2026-12-05, BENCHMARKS.md's twenty-second run): one flip, one row of six at
5.9e-2, the others 4.5e-3 to 4.9e-3.

    python3 scripts/probe_moe_routing.py [--case moe_bf16] [--model qwen3_next_80b] [--device cuda]
        (--model qwen3_next_tiny --device cpu: a small run on the CPU, the Triton path in the interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "heads"))
import test_heads_gpu as cases  # noqa: E402

import mtpfactory  # noqa: E402
from mtpfactory.components import ffn  # noqa: E402

PATHS = {"fp32": ("runtime.backend=native", "runtime.dtype=float32"), "native": ("runtime.backend=native",),
         "triton": ("runtime.backend=triton",)}


def drive(case: str, model: str, device: str, path: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The case's logits through one path [steps * 2, vocab] (fp32), and the expert ids of each MoE call."""
    head, _, overrides = cases.CASES[case]
    routed = []
    route = ffn.K.moe_route_softmax

    def recording(logits, top_k, renormalize):
        weights, ids = route(logits, top_k, renormalize)
        routed.append(ids.sort(dim=-1).values.cpu())
        return weights, ids

    ffn.K.moe_route_softmax = recording
    try:
        built = mtpfactory.build_head(mtpfactory.compose(f"+head={head}", f"model={model}", *cases.GPU, *overrides,
                                                         f"runtime.device={device}", *PATHS[path]),
                                      cases._weights(head, model))
        logits = cases._drive(built)
    finally:
        ffn.K.moe_route_softmax = route
    return logits.cpu(), routed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="moe_bf16", choices=[c for c, v in cases.CASES.items() if v[0] != "dense"])
    ap.add_argument("--model", default=None, help="a preset in place of the case's (qwen3_next_tiny for the CPU)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    model = args.model or cases.CASES[args.case][1]
    runs = {path: drive(args.case, model, args.device, path) for path in PATHS}
    ref_logits, ref_routed = runs["fp32"]
    print(f"case {args.case}, model {model}, device {args.device}: {sum(len(r) for r in ref_routed)} rows routed in "
          f"{len(ref_routed)} MoE calls (the prefills' chunks, then the steps)")
    for path in ("native", "triton"):
        logits, routed = runs[path]
        flips = [(call, row, int((~torch.isin(ids[row], ref[row])).sum()))
                 for call, (ids, ref) in enumerate(zip(routed, ref_routed)) for row in range(ids.shape[0])
                 if not torch.equal(ids[row], ref[row])]
        rel = (logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)
        whole = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        where = "; ".join(f"call {c} row {r}: {n} of the top-k" for c, r, n in flips[:8])
        print(f"{path} bf16: {len(flips)} rows chose other experts than fp32{f' ({where})' if flips else ''}; "
              f"logits vs fp32 {whole:.3e} overall, by step row {' '.join(f'{v:.2e}' for v in rel.tolist())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
