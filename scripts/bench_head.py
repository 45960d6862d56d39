"""A head's decode step at its real size on the GPU: what a serving engine's call of `head.step` costs, and how much
of it is the kernels. The op benchmarks time each op alone; this times them together, with the host's work
between them.

For each case (a head, its model preset and overrides: the quant table's forms, as the heads' GPU tests build
them) and each batch B, B sequences of --context tokens each (prefilled once, in chunks of 32 rows), stepped
one row a sequence at the next position, as a decoding engine steps them:
- `triton eager`: `head.step` under runtime.backend=triton, --steps calls between two synchronizes (after the
  same calls made once untimed: the kernel variants their positions need compiled), one call's wall time: the host's work (the input checks, the cache's commits and block table, each op's launcher) and
  the kernels, whichever the GPU waits on. Tokens and positions come from the host (their checks then read no
  device memory), hidden from the device;
- `triton graph`: the same step's forward (`_forward`, after the cache's commits) captured in a CUDA graph and
  replayed (`bench_kernels.graph_time_us`: do_bench's median, the L2 cleared before each replay): the kernels
  alone, no host. A forward that cannot be captured is timed launch by launch and marked so;
- `native eager` (the peer): `head.step` under runtime.backend=native on the same weights, each op's PyTorch
  reference (cuBLAS for the dense matmuls, the references' loops for attention and the experts), --native-steps
  calls. Its time is the first round's only, as bench_ops times its references.

Each figure stands beside the step's floor: the bytes the step must read over the copy bandwidth measured at the
start. They are every weight of the head but the embedding table and the routed experts, the embedding rows of
its B tokens, the experts the routing picked (the mean count of distinct experts over the timed eager steps,
times one expert's bytes), and the KV cache of its B sequences (context + 1 tokens each: the new row's too).
The rounds alternate their order (`bench_kernels.alternating`); a row gives the median of its rounds and their
range. --kernels also lists, under each batch, the kernels of one eager forward (torch.profiler): each one's
launches and their time together, the longest first: where the graph's time goes.

    python3 scripts/bench_head.py [--cases dense_bf16,moe_bf16] [--batches 1,8,32] [--context 4096] [--steps 20]
        [--native-steps 3] [--rounds 3] [--no-native] [--kernels] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import alternating, copy_bandwidth, graph_time_us, write_rows  # noqa: E402
from bench_ops import short_kernel_name  # noqa: E402

import mtpfactory  # noqa: E402
from mtpfactory import ops  # noqa: E402
from mtpfactory.components.cache import WritePlan  # noqa: E402
from mtpfactory.weights.synthetic import qwen_mtp_weights  # noqa: E402

DEVICE = "cuda"
DENSE, MOE = "qwen3_5_dense", "qwen3_next_80b"
# name: (head, model preset, overrides): the quant table's forms at a real size (DESIGN 2.2)
CASES = {
    "dense_bf16": ("dense", DENSE, ()),
    "dense_fp8_kv_fp8": ("dense", DENSE, ("quant=fp8", "kv=fp8")),
    "dense_nvfp4": ("dense", DENSE, ("quant=nvfp4",)),
    "moe_bf16": ("bf16_moe", MOE, ()),
    "moe_experts_nvfp4_lm_nvfp4_kv_fp8": ("bf16_moe", MOE, ("levers.experts_nvfp4=true", "quant.lm_head=nvfp4",
                                                            "kv=fp8")),
}
PREFILL_CHUNK = 32   # under runtime.backend=triton a prefill chunk is one call of each projection, up to 32 rows


@functools.cache
def _weights(head: str, model: str) -> dict[str, torch.Tensor]:
    cfg = mtpfactory.compose(f"+head={head}", f"model={model}")
    return qwen_mtp_weights(cfg.model, "dense" if head == "dense" else "moe", seed=0)


def build(case: str, backend: str, max_seqs: int, context: int, steps: int, dtype: str = "bfloat16"):
    """The case's head under `backend`, its pool holding `max_seqs` sequences of context + steps + 1 tokens."""
    head, model, overrides = CASES[case]
    cfg = mtpfactory.compose(f"+head={head}", f"model={model}", f"runtime.device={DEVICE}",
                             f"runtime.dtype={dtype}", f"runtime.backend={backend}",
                             f"runtime.max_seq_len={context + steps + 1}", f"runtime.max_seqs={max_seqs}",
                             f"runtime.prefill_chunk={PREFILL_CHUNK}", *overrides)
    return mtpfactory.build_head(cfg, _weights(head, model))


def prefill(head, seqs: int, context: int, gen: torch.Generator) -> None:
    """Sequences 0 .. seqs - 1, `context` rows each (the same rows: only their KV's bytes matter here)."""
    tokens = torch.randint(0, head.vocab_size, (context,), generator=gen)
    hidden = torch.randn(context, head.hidden_size, generator=gen).to(head.device, head.dtype)
    for s in range(seqs):
        head.prefill(s, tokens, hidden, torch.arange(context))


def floor_bytes(head, b: int, context: int, experts: float) -> int:
    """The bytes a step of `b` rows must read (the module docstring's list); `experts`: distinct experts picked."""
    routed = getattr(head.ffn, "experts", None)
    routed_ids = {id(t) for t in (*routed.parameters(), *routed.buffers())} if routed is not None else set()
    seen, weights = set(), 0
    for t in (*head.parameters(), *head.buffers()):
        if t is head.embed or id(t) in routed_ids or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        weights += t.numel() * t.element_size()
    per_expert = sum(t.numel() * t.element_size() for t in (*routed.parameters(), *routed.buffers())
                     ) / routed.num_experts if routed is not None else 0
    spec = head.cache.spec
    per_token = spec.nbytes / (spec.num_blocks * spec.block_size)         # K and V (and their scales) of a token
    embed_rows = b * head.embed.shape[1] * head.embed.element_size()
    return int(weights + embed_rows + experts * per_expert + b * (context + 1) * per_token)


def eager_step_us(head, b: int, context: int, steps: int, gen: torch.Generator) -> tuple[float, float]:
    """(one `head.step` call's wall time in us, the mean count of distinct routed experts a step; 0 without
    experts): `steps` calls of b rows at positions context, context + 1, ..., timed after the same calls made
    once untimed (each time the sequences are truncated back to `context`). The untimed pass compiles whatever
    kernel variants those positions need: as a context grows, paged attention's split count and block-table
    width change, and Triton compiles a variant for each new one (0.1-0.5 s; the thirty-first run's HF timed
    such compiles into its one round)."""
    ids = torch.arange(b)
    tokens = torch.randint(0, head.vocab_size, (steps, b), generator=gen)
    hidden = torch.randn(steps, b, head.hidden_size, generator=gen).to(head.device, head.dtype)
    picked = []
    routed = getattr(head.ffn, "experts", None)
    hook = routed.register_forward_pre_hook(lambda m, args: picked.append(args[2])) if routed is not None else None

    def run() -> float:
        try:
            if head.device.type == "cuda":
                torch.cuda.synchronize(head.device)
            t0 = time.perf_counter()
            for j in range(steps):
                head.step(ids, tokens[j], hidden[j], torch.full((b,), context + j))
            if head.device.type == "cuda":
                torch.cuda.synchronize(head.device)
            return (time.perf_counter() - t0) / steps * 1e6
        finally:
            for s in range(b):
                head.truncate(s, context)
    try:
        run()
        picked.clear()
        us = run()
    finally:
        if hook is not None:
            hook.remove()
    experts = statistics.mean(step_ids.unique().numel() for step_ids in picked) if picked else 0.0
    return us, experts


@contextlib.contextmanager
def committed_forward(head, b: int, context: int, gen: torch.Generator):
    """Yields a call of one step's forward (`_forward` under the head's backend) on b random rows at position
    `context`, the cache's commits for them made once (each call rewrites those rows); the sequences are
    truncated back to `context` after."""
    ids, plist = list(range(b)), [context] * b
    tokens = torch.randint(0, head.vocab_size, (b,), generator=gen).to(head.device)
    hidden = torch.randn(b, head.hidden_size, generator=gen).to(head.device, head.dtype)
    positions = torch.tensor(plist, device=head.device)
    try:
        with head.cache.writing([WritePlan(i, p, p) for i, p in zip(ids, plist)]):
            tables = head.cache.commit_step(ids, plist)

        def forward():
            with ops.running(head.backend, head.device):
                return head._forward(tokens, hidden, positions, *tables)
        yield forward
    finally:
        for s in ids:
            head.truncate(s, context)


def graph_step_us(head, b: int, context: int, gen: torch.Generator) -> tuple[float, bool]:
    """(one step's forward in us, whether graphed), as `graph_time_us` times it."""
    with committed_forward(head, b, context, gen) as forward:
        us, graphed, _ = graph_time_us([forward])
    return us, graphed


def step_kernels(head, b: int, context: int, gen: torch.Generator) -> dict[str, tuple[int, float]]:
    """Each GPU kernel one step's forward launches: its name -> (launches, their time together in us), from
    torch.profiler over one eager forward after a warm one, the longest first. Empty without a GPU. A
    programmatic dependent launch's time counts its wait (`bench_ops.kernel_times`)."""
    if not torch.cuda.is_available():
        return {}
    with committed_forward(head, b, context, gen) as forward:
        forward()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
    found: dict[str, tuple[int, float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            n, us = found.get(name := short_kernel_name(ev.name), (0, 0.0))
            found[name] = (n + 1, us + ev.device_time)
    return dict(sorted(found.items(), key=lambda kv: -kv[1][1]))


def run_case(case: str, batches: list[int], args, bw: float, gen: torch.Generator) -> list[dict]:
    """Every batch of one case, in args.rounds alternating rounds; prints and returns its rows."""
    t0 = time.time()
    heads = {"triton": build(case, "triton", max(batches), args.context, args.steps)}
    if args.native:
        heads["native"] = build(case, "native", max(batches), args.context, args.native_steps)
    for head in heads.values():
        prefill(head, max(batches), args.context, gen)
    print(f"# {case}: built and prefilled {max(batches)} x {args.context} tokens in {time.time() - t0:.0f} s",
          flush=True)
    # each timer: b -> (us, what else it found: the eager steps' distinct experts, the graph's whether graphed)
    timers = {"triton eager": lambda b: eager_step_us(heads["triton"], b, args.context, args.steps, gen)}
    if DEVICE == "cuda":    # (CUDA graphs: none on the CPU, where the tests run these cases at tiny presets)
        timers["triton graph"] = lambda b: graph_step_us(heads["triton"], b, args.context, gen)
    if args.native:
        timers["native eager"] = lambda b: eager_step_us(heads["native"], b, args.context, args.native_steps, gen)
    times = {(b, p): [] for b in batches for p in timers}
    extra = {}
    for r, order in alternating(list(times), args.rounds):
        for b, p in order:
            if p == "native eager" and r > 0:
                continue
            us, x = timers[p](b)
            times[(b, p)].append(us)
            extra.setdefault((b, p), []).append(x)
    rows = []
    for b in batches:
        experts = statistics.mean(extra[(b, "triton eager")])
        floor = floor_bytes(heads["triton"], b, args.context, experts) / bw * 1e6
        peer = statistics.median(times[(b, "native eager")]) if args.native else float("nan")
        kernels = step_kernels(heads["triton"], b, args.context, gen) if args.kernels else None
        for p in timers:
            ts = times[(b, p)]
            us = statistics.median(ts)
            row = dict(case=case, batch=b, provider=p, us=us, us_rounds=ts, floor_us=floor,
                       pct_floor=100 * floor / us, peer_us=peer, experts=experts, context=args.context)
            if p == "triton graph":
                row.update(graphed=all(extra[(b, p)]), kernels=kernels)
            rows.append(row)
            note = "" if row.get("graphed", True) else "  (launch by launch: not graphed)"
            print(f"{case:36s} B={b:<3d} {p:13s} {us:10.1f} us ({min(ts):.1f}-{max(ts):.1f})  floor {floor:8.1f} us "
                  f"{row['pct_floor']:5.1f}%  native {peer:10.1f} us" + (f"  experts {experts:.1f}" if experts
                                                                        else "") + note, flush=True)
        if kernels is not None:
            print(f"    one forward's kernels, B={b}: {sum(n for n, _ in kernels.values())} launches, "
                  f"{sum(us for _, us in kernels.values()):.1f} us together: "
                  + "; ".join(f"{k} x{n} {us:.1f}" for k, (n, us) in kernels.items()), flush=True)
    heads.clear()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--batches", default="1,8,32", help="sequences a step, one row each")
    ap.add_argument("--context", type=int, default=4096, help="tokens each sequence holds before the step")
    ap.add_argument("--steps", type=int, default=20, help="eager step calls timed together")
    ap.add_argument("--native-steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-native", dest="native", action="store_false", help="leave the native peer out")
    ap.add_argument("--kernels", action="store_true", help="also each kernel of one forward, its launches and time "
                    "(torch.profiler over an eager forward)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = args.cases.split(",")
    if bad := [c for c in cases if c not in CASES]:
        ap.error(f"--cases {','.join(bad)}: choose from {','.join(CASES)}")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.3f} TB/s (read + write); "
          f"{args.rounds} rounds, context {args.context}, {args.steps} eager steps a timing", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case in cases:
        rows += run_case(case, [int(v) for v in args.batches.split(",")], args, bw, gen)
        write_rows(args.json, bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
