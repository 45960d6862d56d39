"""Host time of an op call through its Triton provider: the dispatch, the contract and refusal checks, the launcher's
planning and its allocations, with the kernels themselves not launched. Runs on the CPU (the kernels' launch is
stubbed on Triton's interpreter), at small decode-step shapes; the figure is a median over rounds of many calls.

    python3 scripts/host_cost.py [--calls 2000] [--rounds 5] [--profile OP] [--steps]

`--steps` also times a head's whole decode step (`head.step` of 4 sequences, one row each, at 20 tokens: its
checks, cache commit and every op call) at the tiny presets, where the kernels' paths can differ from the real
sizes' (the LM head's x pass starts at a size) but the calls are the same ones.

On a GPU the same Python runs before each launch (plus the CUDA allocator's and the launch's own cost), so an
op whose figure here passes its kernel's time on the GPU is bound by the host when it is not in a CUDA graph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: the kernels become interpreter objects

import importlib  # noqa: E402

import torch  # noqa: E402

from mtpfactory import kernels as K  # noqa: E402
from mtpfactory import ops  # noqa: E402


def stub_launches() -> None:
    """Every `kernel[grid](...)` returns at once (the class of the interpreter's kernels, which all share)."""
    kernel = importlib.import_module("mtpfactory.kernels.rms_norm")._rms_norm_kernel
    type(kernel).__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)


def cases() -> dict[str, object]:
    """Op name -> a call at Qwen3-Next-like decode shapes (4 rows, hidden 2048, 16 / 2 heads x 256, 8 experts)."""
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    rnd = lambda *shape, dtype=bf: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    x, w, wl = rnd(4, 2048), rnd(2048), rnd(512, 2048)
    ids, table = torch.tensor([1, 2, 3, 4]), rnd(1000, 2048)
    kc, vc = rnd(64, 16, 2, 256), rnd(64, 16, 2, 256)
    q, gate = rnd(4, 16, 256), rnd(4, 16, 256)
    tables, lens = torch.arange(64, dtype=torch.int32).view(4, 16), torch.full((4,), 200, dtype=torch.int32)
    inv_freq, pos = torch.rand(32, generator=gen), torch.arange(4)
    logits = rnd(4, 8, dtype=torch.float32)
    w_gate_up, w_down = rnd(8, 128, 2048), rnd(8, 2048, 64)
    topk_w, topk_ids = K.moe_route_softmax.reference(logits, 2, True)
    vocab = rnd(4, 1000, dtype=torch.float32)
    return {
        "rms_norm": lambda: K.rms_norm(x, w, 1e-6, True),
        "linear": lambda: K.linear(x, wl),
        "embedding": lambda: K.embedding(ids, table),
        "embed_norm_cat": lambda: K.embed_norm_cat(ids, table, w, x, w, 1e-6, True),
        "rope_neox": lambda: K.rope_neox(q, pos, inv_freq),
        "rms_norm_rope": lambda: K.rms_norm_rope(q, w[:256], 1e-6, True, pos, inv_freq),
        "silu_mul": lambda: K.silu_mul(x, x),
        "paged_decode_attention": lambda: K.paged_decode_attention(q, kc, vc, tables, lens, 0.0625, gate),
        "moe_route_softmax": lambda: K.moe_route_softmax(logits, 2, True),
        "fused_moe": lambda: K.fused_moe(x, w_gate_up, w_down, topk_w, topk_ids),
        "argmax": lambda: K.argmax(vocab),
    }


STEP_SEQS, STEP_CONTEXT = 4, 20


def step_cases() -> dict[str, object]:
    """'step HEAD' -> one decode step of the head at its tiny preset under runtime.backend=triton, its sequences
    truncated back after it (so every call steps the same positions; the truncation is timed apart, `truncate`)."""
    import mtpfactory
    found = {}
    for name in ("dense", "bf16_moe"):
        head = mtpfactory.build_head(mtpfactory.compose(f"+head={name}", "runtime.device=cpu",
                                                        "runtime.backend=triton", "runtime.prefill_chunk=32"))
        rows = torch.zeros(STEP_CONTEXT, head.hidden_size, dtype=head.dtype)
        for seq in range(STEP_SEQS):
            head.prefill(seq, torch.zeros(STEP_CONTEXT, dtype=torch.long), rows, torch.arange(STEP_CONTEXT))
        ids, tokens = torch.arange(STEP_SEQS), torch.zeros(STEP_SEQS, dtype=torch.long)
        hidden, positions = rows[:STEP_SEQS], torch.full((STEP_SEQS,), STEP_CONTEXT)

        def truncate(head=head):
            for seq in range(STEP_SEQS):
                head.truncate(seq, STEP_CONTEXT)

        def step(head=head, args=(ids, tokens, hidden, positions), truncate=truncate):
            head.step(*args)
            truncate()
        found[f"step {name}"] = step
        found.setdefault("truncate", truncate)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", default="", help="an op's name: cProfile its calls after the timing")
    ap.add_argument("--steps", action="store_true", help="also a head's whole decode step at the tiny presets "
                    f"({STEP_SEQS} sequences; 'step HEAD' includes their truncation, timed apart as 'truncate')")
    args = ap.parse_args()
    stub_launches()
    calls = cases()
    if args.steps:
        calls.update(step_cases())
    if args.profile and args.profile not in calls:
        ap.error(f"--profile {args.profile}: not an op timed here; the ops are {', '.join(calls)}")
    print(f"host time an op call, its kernels not launched (torch {torch.__version__}, CPU); us, median of "
          f"{args.rounds} rounds of {args.calls} calls (range)")
    with ops.use_backend("triton"):
        for name, call in calls.items():
            for _ in range(50):
                call()
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times.append((time.perf_counter() - start) / args.calls * 1e6)
            print(f"{name:24s} {statistics.median(times):7.1f} us ({min(times):.1f}-{max(times):.1f})")
        if args.profile:
            import cProfile
            import pstats
            profile = cProfile.Profile()
            profile.runcall(lambda: [calls[args.profile]() for _ in range(args.calls)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
