"""Static cost of the GEMV / small-M GEMM kernels on the H200, on a machine with no GPU: compiles a kernel
for sm_90 with Triton's own ptxas, disassembles it with the bundled nvdisasm, and prints the instructions
of its K loop per weight element and thread, with a histogram and the shared-memory store widths.

A kernel that is bound by its decode arithmetic (the fp32 NVFP4 GEMV was) runs at about
    elements * instructions per element / (132 SMs * 128 lanes * clock)
at best, the clock 1.98 GHz at most and 1.77 GHz as Nsight Compute saw it under that load; `BENCHMARKS.md`
quotes these counts. Pointer and size arguments are marked divisible by 16 and the unit strides of x and
out specialized to 1, as Triton's launcher does at the real shapes. `nvfp4-gemv` is the kernel M = 1 with
bf16 x runs on the LM heads (`_gemv_nvfp4_f16_kernel`), with its one-step look-ahead when --stages > 1 and
x's pairs from x's own pass with --x-pass (and, as on the H200, launched beside it: `x_pass_pdl`).

    python3 scripts/sass_stats.py nvfp4-gemm --tile 32,64,256 --swap --stages 2
    python3 scripts/sass_stats.py nvfp4-gemv --tile 1,64,256 --stages 2 --x-pass
    python3 scripts/sass_stats.py nvfp4-gemv --tile 8,64,256 --stages 2        (the GEMV of 8 rows)
    python3 scripts/sass_stats.py nvfp4-wgmma     (the Gluon kernel of M = 2-32 on the LM heads, its tile of 32 rows)
    python3 scripts/sass_stats.py nvfp4-wgmma --tile 8,64,256                     (its tile of 8 rows: `TILES`)
    python3 scripts/sass_stats.py nvfp4-wgmma --parts 2 --maxnreg 64 [--module diag/peer.py]   (another tile)
    python3 scripts/sass_stats.py {bf16,fp8}-{gemv,gemm} ...  [--warps 4] [--stages 3] [--sass out.sass]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

# the modules (the package exports the Ops under the same names)
linear = importlib.import_module("mtpfactory.kernels.linear")
linear_nvfp4 = importlib.import_module("mtpfactory.kernels.linear_nvfp4")
wgmma = importlib.import_module("mtpfactory.kernels.gemm_nvfp4_wgmma")

_PTRS = ("x_ptr", "x16_ptr", "pairs_ptr", "exp_ptr", "w_ptr", "scale_ptr", "s_ptr", "s2_ptr", "out_ptr", "part_ptr")
_DIVISIBLE = _PTRS + ("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_sn", "stride_om")
_UNIT = ("stride_xk", "stride_on")          # Triton's launcher specializes an integer argument equal to 1


def load_peer(path: str):
    """Another version of the wgmma kernel's module, from the file at `path` (a scratch peer), as module
    `peer_<the file's stem>`: registered under that name, as dataclasses and Gluon's jit look it up."""
    spec = importlib.util.spec_from_file_location(f"peer_{os.path.basename(path).removesuffix('.py')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _signature(fn, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Each argument of `fn`: its type from `types`, i32 for sizes and strides, constexpr for the rest."""
    return {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}


def kernel(name: str, bm: int, bn: int, bk: int, swap: bool, stages: int, x_pass: bool = False, parts: int = 1):
    """(jit function, argument types, constexprs) of a preset (the NVFP4 dot kernel loads `stages` - 1 K steps
    ahead itself and compiles with Triton's pipelining off, as its launcher does)."""
    fmt, kind = name.split("-")
    if kind == "wgmma":                                              # the Gluon kernel, at its own tile
        def desc(dtype, block, layout):                              # a TMA descriptor's argument type
            return mangle_type(TensorDescriptor.from_tensor(torch.zeros(64, 512, dtype=dtype), block, layout))
        return (wgmma._gemm_nvfp4_wgmma_kernel,
                {"x_desc": desc(torch.float16, [bm, bk], wgmma.X_SMEM), "exp_ptr": "*i32",
                 "w_desc": desc(torch.int32, [bn, bk // 8], wgmma.W_SMEM),
                 "s_desc": desc(torch.int32, [bn, bk // 64], wgmma.S_SMEM), "s2_ptr": "*fp32", "out_ptr": "*bf16"},
                dict(wgmma.layouts(bn, bk, bn // 16, bm), BN=bn, BK=bk, BM=bm, STAGES=stages, PARTS=parts,
                     PDL=True))
    dot = kind == "gemm"
    if fmt == "nvfp4":
        types = {"x_ptr": "*bf16", "pairs_ptr": "*i32", "exp_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8",
                 "s2_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32"}
        if dot and x_pass:                                           # 16-bit x on the LM heads (`uses_f16_dot`)
            return (linear_nvfp4._gemm_nvfp4_f16_kernel, {**types, "x16_ptr": "*fp16"},
                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, AHEAD=stages > 1, EVEN_K=True, LOWP_DOT=True,
                         SWAP_AB=swap, SPLIT=False, USE_ASM=True, PDL=True))
        if dot:
            return (linear_nvfp4._gemm_nvfp4_kernel, types,
                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, AHEAD=max(1, min(stages - 1, 2)), EVEN_K=True,
                         LOWP_DOT=True, SWAP_AB=swap, SPLIT=False, USE_ASM=True))
        if bm > 1:                                                   # 2 <= M <= 8 rows of bf16 x
            return (linear_nvfp4._gemv_nvfp4_rows_kernel, {**types, "pairs_ptr": "*i32"},
                    dict(ROWS=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, AHEAD=stages > 1, SPLIT=False, USE_ASM=True,
                         PDL=True))
        return (linear_nvfp4._gemv_nvfp4_f16_kernel, types,             # what M = 1 with bf16 x runs
                dict(BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, AHEAD=stages > 1, X_PAIRS=x_pass, XBLOCK=2048,
                     SPLIT=False, USE_ASM=True, PDL=x_pass, X_CONTIG=True))           # x contiguous, as the heads'
    types = {"x_ptr": "*fp16" if x_pass else "*bf16", "exp_ptr": "*i32",
             "w_ptr": "*bf16" if fmt == "bf16" else "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16",
             "part_ptr": "*fp32"}
    return (linear._linear_kernel, types,
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot, LOWP_DOT=True, SWAP_AB=swap, SPLIT=False,
                 ROW_SCALE=fmt == "fp8", X_EXP=x_pass, PDL=x_pass))


def compile_sass(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int,
                 maxnreg: int | None = None) -> tuple[str, int, int]:
    """`disassemble` of `fn` compiled for sm_90, at most `maxnreg` registers a thread where given (as the
    launch's option)."""
    constexprs = {**{a: 1 for a in _UNIT if a in fn.arg_names}, **constexprs}
    sig = _signature(fn, types, constexprs)
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in _DIVISIBLE if a in sig}
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    compiled = triton.compile(source(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           **({"maxnreg": maxnreg} if maxnreg else {})))
    return disassemble(compiled.asm["cubin"])


def disassemble(cubin: bytes) -> tuple[str, int, int]:
    """(the disassembly, registers a thread at launch, bytes of local memory a thread: spills) of a cubin, by
    the nvdisasm and cuobjdump bundled with Triton. The local bytes count the stack frame too: ptxas puts a
    warp-specialized kernel's spills there (STACK), with LOCAL 0."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", "-g", path], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1)), sum(int(re.search(rf"{kind}:(\d+)", usage).group(1))
                                                                  for kind in ("LOCAL", "STACK"))


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)")


def loop_body(sass: str) -> list[tuple[str, str]]:
    """(opcode, modifiers) of the instructions of the largest loop (the span of the longest conditional
    backward branch): the K loop of these kernels."""
    labels, pending, instrs = {}, [], []
    for line in sass.splitlines():
        m = re.match(r"^\s*\.(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            # a loop's back edge is conditional: the unconditional branch from an out-of-line mbarrier retry
            # back into the loop is not one
            target = re.search(r"@!?U?P\w+\s+BRA\s+`?\(?\.(L_x_\d+)", line)
            instrs.append((addr, m.group(2), m.group(3), target.group(1) if target else None))
    best = (0, -1)
    for addr, _, _, target in instrs:
        if target in labels and labels[target] < addr and addr - labels[target] > best[1] - best[0]:
            best = (labels[target], addr)
    return [(op, mods) for addr, op, mods, _ in instrs if best[0] <= addr <= best[1]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=[f"{f}-{k}" for f in ("bf16", "fp8", "nvfp4") for k in ("gemv", "gemm")]
                    + ["nvfp4-wgmma"])
    ap.add_argument("--tile", default=None, help="BLOCK_M,BLOCK_N,BLOCK_K (default: 1,32,256 or 32,128,64)")
    ap.add_argument("--swap", action="store_true", help="the weight tile as the dot's first operand")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=None, help="default 3 (nvfp4-wgmma: the module's tile's)")
    ap.add_argument("--x-pass", action="store_true",
                    help="nvfp4-gemv: x paired by its own pass (`uses_x_pass`: the LM heads), not in the K loop; "
                         "fp8-gemm: x in fp16 from its own pass (`F16_DOT_MIN_ELEMENTS`), the dot in fp16; "
                         "nvfp4-gemm: the fp16 dot on x's pass's pairs (`uses_f16_dot`), not the bf16 one")
    ap.add_argument("--parts", type=int, default=None, help="nvfp4-wgmma: the K step in 2 or 4 parts (default: "
                    "the module's tile for --tile's rows, `TILES`)")
    ap.add_argument("--maxnreg", type=int, default=None, help="nvfp4-wgmma: registers a thread at launch "
                    "(default: the module's tile's)")
    ap.add_argument("--sass", default=None, help="also write the whole disassembly here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead (registers, local memory, "
                    "setmaxnreg counts, the K loop's instruction histogram): for tests, which run this in a process "
                    "of its own (Triton's interpreter, once run in a process, breaks later compiles there)")
    ap.add_argument("--module", default=None, help="nvfp4-wgmma: compile this version of the kernel's module "
                    "(a scratch peer, as `sweep_wgmma.py --peer` takes) instead of the package's")
    args = ap.parse_args()
    if args.module:
        global wgmma
        wgmma = load_peer(args.module)
    dot = args.kernel.endswith("gemm") or args.kernel.endswith("wgmma")
    bm, bn, bk = (int(v) for v in (args.tile or ("32,128,64" if dot else "1,32,256")).split(","))
    if args.kernel == "nvfp4-wgmma":            # the module's tile for the rows (32 unless --tile), or as given
        t = wgmma.TILES[wgmma.block_m(bm if args.tile else 32)]
        if not args.tile:
            bm, bn, bk = 32, t.bn, t.bk
        t = wgmma.WgmmaTile(bn=bn, bk=bk, warps=bn // 16, stages=args.stages or t.stages, parts=args.parts or t.parts,
                            maxnreg=args.maxnreg or t.maxnreg)
        args.warps, args.stages, args.parts, args.maxnreg = t.warps, t.stages, t.parts, t.maxnreg
    args.stages = args.stages or 3
    if (args.kernel != "nvfp4-wgmma" and dot != (bm >= 16)) or (bm > 1 and not dot and args.kernel != "nvfp4-gemv"):
        ap.error(f"--tile {bm},{bn},{bk}: a gemm tile has BLOCK_M 16 or 32, a gemv tile BLOCK_M 1 (nvfp4-gemv: "
                 "up to 8, the GEMV of several rows)")
    fn, types, constexprs = kernel(args.kernel, bm, bn, bk, args.swap, args.stages, args.x_pass, args.parts or 1)
    stages = 1 if "AHEAD" in constexprs or "STAGES" in constexprs else args.stages
    sass, regs, spills = compile_sass(fn, types, constexprs, args.warps, stages, args.maxnreg)
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    body = loop_body(sass)
    per_thread = bn * bk / (32 * args.warps)                         # weight elements per thread per iteration
    hist = collections.Counter(op for op, _ in body)
    setmaxnreg = sorted({int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP\d, )?(0x[0-9a-f]+)", sass)})
    if args.json:
        print(json.dumps(dict(registers=regs, local_bytes=spills, setmaxnreg=setmaxnreg, loop=dict(hist))))
        return 0
    stores = collections.Counter(op + mods for op, mods in body if op in ("STS", "STSM"))
    print(f"{args.kernel} tile {bm}x{bn}x{bk} warps {args.warps} stages {args.stages}{' swap' if args.swap else ''}"
          f"{f' parts {args.parts}' if args.parts else ''}: "
          f"{len(body)} instructions a K step, {len(body) / per_thread:.2f} per weight element and thread; "
          f"{regs} registers, {spills} bytes of local memory")
    if args.kernel == "nvfp4-wgmma":            # setmaxnreg: the producer's warpgroup gives back, the consumers take
        print(f"  consumers at {t.consumer_regs} registers (setmaxnreg counts in the code: {setmaxnreg})")
    print("  " + ", ".join(f"{op} {n}" for op, n in hist.most_common(14)))
    if stores:
        print("  shared stores: " + ", ".join(f"{op} {n}" for op, n in stores.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
