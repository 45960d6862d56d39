"""Compile check of the Triton kernels for the H200 (sm_90), on a machine with no GPU: runs a pytest selection
under Triton's interpreter, records every launch of a @triton.jit kernel as Triton's launcher would specialize
it, then compiles each distinct specialization for sm_90 down to a cubin (Triton's bundled ptxas), in fresh
processes, and prints one line per specialization: ok, or FAIL with the first lines of the error.

Why: the interpreter runs a kernel's Python body and neither type-checks nor compiles it, so a kernel edit
that passes the CPU tests can still fail to compile on the GPU (a mask of the wrong shape, an int64 stride
meeting an int32, a constexpr used as a value...). This finds those without a GPU.

What a launch records (`JITFunction`'s own binder, so as the launcher does on the GPU): a tensor becomes a
pointer of its dtype (*bf16, *fp8e4nv, ...), an int i32 / i64 by its range, 1 a constexpr, a pointer or int
divisible by 16 gets the divisibility attribute (`:16` below), a float fp32, None a constexpr; the constexprs
and the launch options (num_warps, num_stages, launch_pdl, ...). A specialization is compiled once however
often the tests launch it.

The GPU path: launchers set some constexprs from `x.is_cuda`, so the interpreter never takes their branch:
USE_ASM (the inline PTX, `tl.inline_asm_elementwise`), LIBDEVICE_TRIG (rope's libdevice cos/sin), LOWP_DOT
(16-bit tensor-core dots) and PDL (`gdc_wait`, with the launch option launch_pdl); the MoE kernels' INTERP
(True in the interpreter: its own fp8 and dot workarounds) the other way. Every specialization with one of
these as the interpreter sets it is compiled a second time with all of them as the GPU sets them (marked `gpu
path`: more than the GPU runs, which takes PDL only beside x's pass and LOWP_DOT only for 16-bit x, but each
compiles). Not flipped: paged attention's `fast_dot` on a BF16 cache (DOT_DTYPE bf16 instead of fp32, GPU
only: the interpreter's bf16 dots are wrong); its fp16 dots on an FP8 cache the CPU tests run.

Not covered: Gluon kernels (`@gluon.jit`, gemm_nvfp4_wgmma.py) cannot run in the interpreter, so no launch is
recorded (scripts/sass_stats.py nvfp4-wgmma compiles them); kernels no selected test launches; specializations
only GPU shapes reach (other tiles, num_warps, dtypes). A compile that passes says nothing of numerics or
speed: those need the GPU tests (`pytest -m gpu`) and the benchmarks.

    TRITON_INTERPRET=1 python3 scripts/compile_sm90.py            (tests/kernels, -m 'not gpu' from pyproject)
    TRITON_INTERPRET=1 python3 scripts/compile_sm90.py -- tests/kernels/test_rope.py -k strided
    python3 scripts/compile_sm90.py --jobs 4 --lines 20 -- ...    (TRITON_INTERPRET=1 is set if absent)
    python3 scripts/compile_sm90.py --stats -- tests/kernels/test_paged_attention.py -k split_context
        (also each kernel's shared memory, registers and spilled bytes a thread, the programs an SM holds, and
        the instructions of its largest loop, from the cubin: `cubin_stats`)

Exit status 1 if any specialization fails to compile (or nothing was launched), else pytest's. On this
project's 2-core machine the whole tests/kernels selection takes about 8 minutes: 4 for the tests, 4 for
the ~1350 specializations (about 840 launched, 510 more on the GPU path); a rerun compiles in seconds what
compiled before (Triton's cache, ~/.triton/cache).
"""

from __future__ import annotations

# Nothing here imports triton at the top: the compiling processes import this file too (multiprocessing's
# spawn), and must import triton without the interpreter, which once used in a process breaks later compiles.
import argparse
import concurrent.futures
import importlib
import importlib.util
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_FLAGS = ("USE_ASM", "LIBDEVICE_TRIG", "LOWP_DOT", "PDL")    # constexprs the launchers set from x.is_cuda
INTERP_FLAGS = ("INTERP",)                                      # ... and from not x.is_cuda (the MoE kernels)
TARGET = ("cuda", 90, 32)                                       # the H200; CUDA's warp is 32 threads


class Recorder:
    """A pytest plugin that wraps `InterpretedFunction.run` (every grid launch of a @triton.jit kernel under
    the interpreter; device-function calls go through `__call__`) and keeps each distinct specialization."""

    def __init__(self):
        self.specs: dict[tuple, dict] = {}          # key -> the spec, in order of first launch
        self.errors: list[str] = []                 # launches the GPU's launcher would refuse (or we could not read)
        self.test = None                            # the test running, named in a FAIL line
        self._binders: dict = {}

    def pytest_runtest_protocol(self, item, nextitem):
        self.test = item.nodeid

    def install(self):
        from triton.runtime.interpreter import InterpretedFunction
        run = InterpretedFunction.run

        def recording_run(fn, *args, grid, warmup, **kwargs):
            if not warmup:
                try:
                    self.record(fn, args, kwargs)
                except Exception as e:  # noqa: BLE001 - reported with the compile results, never breaks the test
                    self.errors.append(f"{fn.fn.__module__}.{fn.fn.__qualname__} in {self.test}: {e!r}")
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run

    def record(self, ifn, args, kwargs):
        """The launch as `JITFunction.run` binds it on the GPU: its binder, then `_pack_args`."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature
        fn = ifn.fn
        if fn not in self._binders:
            jit = JITFunction(fn, **ifn.kwargs)      # a second, compilable view of the same Python function
            backend = make_backend(GPUTarget(*TARGET))
            self._binders[fn] = jit, backend, create_function_from_signature(jit.signature, jit.params, backend)
        jit, backend, binder = self._binders[fn]
        bound, specialization, _ = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, dict(kwargs), bound, specialization, {})
        names = jit.arg_names
        spec = dict(module=fn.__module__, qualname=fn.__qualname__, path=fn.__code__.co_filename,
                    signature=signature,
                    constexprs={names[p[0]] if len(p) == 1 else p: v for p, v in constexprs.items()},
                    attrs=attrs, options={k: v for k, v in kwargs.items() if k in options.__dict__},
                    gpu_path=(), test=self.test)
        self.specs.setdefault(key(spec), spec)


def key(spec: dict) -> tuple:
    constexprs = sorted(spec["constexprs"].items(), key=str)
    return (spec["module"], spec["qualname"], repr(spec["signature"]), repr(constexprs), repr(spec["attrs"]),
            repr(sorted(spec["options"].items())))


def gpu_path(spec: dict) -> dict | None:
    """The spec as the GPU launches it (GPU_FLAGS True, INTERP_FLAGS False), or None where it already is."""
    off = tuple(f for f in GPU_FLAGS if spec["constexprs"].get(f) is False)
    interp = tuple(f for f in INTERP_FLAGS if spec["constexprs"].get(f) is True)
    if not off and not interp:
        return None
    options = {**spec["options"], "launch_pdl": True} if "PDL" in off else spec["options"]
    return {**spec, "constexprs": {**spec["constexprs"], **dict.fromkeys(off, True), **dict.fromkeys(interp, False)},
            "options": options, "gpu_path": off + interp}


def describe(spec: dict) -> str:
    """kernel(type[:16], ..., CONST=value, ...) options [gpu path: flags]"""
    parts = []
    for i, (name, ty) in enumerate(spec["signature"].items()):
        if ty == "constexpr":
            parts.append(f"{name}={spec['constexprs'].get(name)}")
        else:                                       # runtime arguments by type only: the lines stay readable
            parts.append(f"{ty}{':16' if (i,) in spec['attrs'] else ''}")
    opts = " ".join(f"{k}={v}" for k, v in sorted(spec["options"].items()))
    flip = f" [gpu path: {','.join(spec['gpu_path'])}]" if spec["gpu_path"] else ""
    return f"{spec['module'].rsplit('.', 1)[-1]}.{spec['qualname']}({', '.join(parts)}) {opts}".rstrip() + flip


def _init_worker():
    os.environ.pop("TRITON_INTERPRET", None)        # compile for real in this process
    # Triton prints a failing PTX whole to stderr ("please share the reproducer"); the exception says enough
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def _kernel(module: str, qualname: str, path: str):
    """The compilable JITFunction: the module by name, else (a module pytest imported by path) from its file."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        spec = importlib.util.spec_from_file_location(module, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "arg_names") and hasattr(obj, "fn"):    # under @triton.autotune / heuristics
        obj = obj.fn
    return obj


def compile_one(spec: dict, stats: bool = False) -> tuple[str | None, float, str]:
    """(None or the error's text, seconds, with `stats` the cubin's `cubin_stats` or "") of compiling `spec`
    for sm_90 to a cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    start = time.time()
    try:
        fn = _kernel(spec["module"], spec["qualname"], spec["path"])
        compiled = triton.compile(ASTSource(fn, spec["signature"], spec["constexprs"], spec["attrs"]),
                                  target=GPUTarget(*TARGET), options=spec["options"])
        if not compiled.asm.get("cubin"):
            return "no cubin came out", time.time() - start, ""
        text = (cubin_stats(compiled.asm["cubin"], compiled.metadata.shared, compiled.metadata.num_warps)
                if stats else "")
    except Exception as e:  # noqa: BLE001 - every failure is a result to print
        return "\n".join(_error_lines(e)), time.time() - start, ""
    return None, time.time() - start, text


# An sm_90 SM (H100, H200): what its programs share (the CUDA occupancy calculator's figures for compute 9.0)
SM90_REGISTERS = 65536          # 32-bit registers, allocated a warp at a time in units of 256
SM90_SHARED = 233472            # bytes (228 KiB), of which each program holds 1 KiB more than it asks
SM90_WARPS = 64
SM90_PROGRAMS = 32


def programs_an_sm(regs: int, shared: int, num_warps: int) -> tuple[int, str]:
    """(programs an SM holds at once, what bounds it: registers, shared memory, warps or programs) for a kernel
    of `regs` registers a thread, `shared` bytes and `num_warps` warps a program, on sm_90."""
    warp_regs = -(-regs * 32 // 256) * 256
    bounds = {"registers": SM90_REGISTERS // (warp_regs * num_warps) if regs else SM90_PROGRAMS,
              "shared memory": SM90_SHARED // (-(-shared // 128) * 128 + 1024),
              "warps": SM90_WARPS // num_warps, "programs": SM90_PROGRAMS}
    bound = min(bounds, key=bounds.get)
    return bounds[bound], bound


def cubin_stats(cubin: bytes, shared: int, num_warps: int) -> str:
    """What a compiled kernel costs the SM, statically: shared memory, registers and local (spilled) bytes a
    thread, the programs an SM holds at once (`programs_an_sm`), and the instructions of its largest loop (a
    K or context loop: one iteration's, each thread's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:                        # once a compiling process, not once a kernel
        sys.path.insert(0, here)
    from sass_stats import disassemble, loop_body
    sass, regs, local = disassemble(cubin)
    loop = len(loop_body(sass))
    held, bound = programs_an_sm(regs, shared, num_warps)
    return (f"smem {shared} B, {regs} regs, {local} B local, {held} programs an SM ({bound}), "
            + (f"loop {loop} instrs" if loop else "no loop (none, or unrolled)"))


def _error_lines(e: Exception) -> list[str]:
    """The error's text; a CompilationError as `file:line: code` for each @triton.jit function of the chain
    of calls down to the failing line (its own text quotes up to 12 lines of the kernel before the call),
    then the message."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.jit import JITCallable
    if not isinstance(e, CompilationError):
        return f"{type(e).__name__}: {e}".splitlines()
    where = {}                                      # a function's source -> (its file, the line of its `def`)
    for module in list(sys.modules.values()):
        for obj in list(getattr(module, "__dict__", {}).values()):
            if isinstance(obj, JITCallable):
                first = next(i for i, line in enumerate(obj.raw_src) if line.lstrip().startswith("def "))
                where[obj.src] = (obj.fn.__code__.co_filename, obj.starting_line_number + first)
    lines, last = ["CompilationError:"], e
    while isinstance(e, CompilationError):
        path, first = where.get(e.src, ("<unknown file>", 1))
        row = getattr(e.node, "lineno", 1)
        code = e.src.split("\n")[row - 1].strip() if e.src else ""
        lines.append(f"  {os.path.relpath(path)}:{first + row - 1}: {code}")
        last, e = e, e.__cause__
    return lines + (last.error_message or repr(e)).splitlines()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pytest_args", nargs="*", help="after --: the pytest selection (default: tests/kernels)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="compiling processes (default: the CPUs)")
    ap.add_argument("--lines", type=int, default=12, help="lines of each error to print (default 12)")
    ap.add_argument("--no-gpu-path", action="store_true", help="skip the second compile with USE_ASM etc. True")
    ap.add_argument("--stats", action="store_true",
                    help="print each compiled kernel's shared memory, registers, spills, programs an SM and "
                         "largest loop's length")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        ap.error("needs Triton's interpreter: TRITON_INTERPRET=1 (the launches are recorded from it)")
    import pytest

    start = time.time()
    recorder = Recorder()
    recorder.install()
    status = pytest.main(["-q", *(args.pytest_args or [os.path.join(ROOT, "tests", "kernels")])], plugins=[recorder])
    tested = time.time() - start

    specs = list(recorder.specs.values())
    if not args.no_gpu_path:
        seen = set(recorder.specs)
        for flipped in filter(None, map(gpu_path, list(specs))):
            if key(flipped) not in seen:
                seen.add(key(flipped))
                specs.append(flipped)
    print(f"\n{len(recorder.specs)} specializations launched by the tests ({tested:.0f} s), "
          f"{len(specs) - len(recorder.specs)} more on the GPU path; compiling for sm_90 in {args.jobs} processes")
    failures = [f"record {e}" for e in recorder.errors]
    compile_start = time.time()
    os.environ.pop("TRITON_INTERPRET")              # the spawned processes inherit the environment
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_init_worker) as pool:
        futures = {pool.submit(compile_one, spec, args.stats): spec for spec in specs}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            spec = futures[future]
            try:
                error, seconds, stats = future.result()
            except Exception as e:  # noqa: BLE001 - a crashed compiler (the pool then fails the rest too)
                error, seconds, stats = f"{type(e).__name__}: {e} (a compiling process died)", 0.0, ""
            print(f"[{done}/{len(specs)}] {'ok  ' if error is None else 'FAIL'} {describe(spec)}  {seconds:.1f}s"
                  + (f"\n      {stats}" if stats else ""))
            if error is not None:
                text = "\n".join(line for line in error.splitlines() if line.strip())
                lines = text.splitlines()[:args.lines] + [f"(launched by {spec['test']})"]
                print("      " + "\n      ".join(lines))
                failures.append(f"{describe(spec)}\n      " + "\n      ".join(lines))
    print(f"\n{len(specs)} kernel specializations compiled for sm_90, {len(failures)} FAIL; "
          f"tests {tested:.0f} s, compiles {time.time() - compile_start:.0f} s, total {time.time() - start:.0f} s")
    for failure in failures:
        print("FAIL " + failure)
    if not specs:
        print("no @triton.jit launch was recorded: is the selection right, and TRITON_INTERPRET=1?")
    if status != 0:
        print(f"pytest exit status {int(status)}: launches after a failure inside a test were not recorded")
    return 1 if failures or not specs else int(status)


if __name__ == "__main__":
    sys.exit(main())
