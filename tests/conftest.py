"""Test-wide setup. With no GPU, Triton kernels run under Triton's interpreter: the variable must be set
before triton is first imported (DESIGN 4).

`python -m pytest` puts the working directory first on sys.path, and from the checkout's root that makes its
`kernels/` folder (installed as `mtpfactory.kernels`) shadow the `kernels` distribution, which transformers
(from 5.25, the heads' oracle) imports: `from kernels import CUDAProperties` then fails. The checkout's root
comes off sys.path here; the tests import the installed package.

On a GPU, the tests share one card, under pytest-xdist's workers too (`-n 8`): a test gives PyTorch's cached GPU
memory back when it ends, and tests marked `gpu_memory` (each holds a large share of the card: tens of GB at the
real sizes and past int32's offsets) take a lock first, one at a time on the machine (`_gpu_memory`)."""

import contextlib
import fcntl
import gc
import os
import shutil
import sys
import tempfile

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]


def _patch_interpreter_once_a_launch() -> None:
    """Triton 3.6's interpreter patches triton.language for the interpreter (`_patch_lang`: every builtin of
    tl, tl.tensor, tl.math and tl.core wrapped, found by `inspect.getmembers`) at each kernel launch, and again
    at each call of a @triton.jit helper inside it, where the patch is the launch's own over again (it depends on
    the function only through which of tl and tl.core its module imports) and is never undone. That repeat was
    a fifth of an NVFP4 head's interpreted run (cProfile, 2026-12-06: 158k `_patch_builtin` calls, 29 of
    143 s). Here a helper's call whose modules the running launch (or a helper's call before it in the launch)
    already patched patches nothing; a launch, or the first helper that imports a module not yet patched (the
    language's own helpers, `tl.max`'s combine or `tl.sigmoid`, import tl.core), patches as before. Skipped
    (Triton's own behaviour) where the interpreter lacks the private function this wraps."""
    try:
        import inspect
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    if patch_lang is None or grid_call is None or getattr(patch_lang, "once_a_launch", False):
        return
    patched: list[frozenset[int] | None] = []  # the modules the running launch patched (None: not yet)

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    class _Nothing:
        def restore(self) -> None:
            pass

    def once(fn):
        if not patched:
            return patch_lang(fn)
        if patched[-1] is None:                # the launch's own patch
            patched[-1] = langs(fn)
            return patch_lang(fn)
        if (mine := langs(fn)) <= patched[-1]:
            return _Nothing()
        patched[-1] = patched[-1] | mine       # a helper's patch lasts the launch too: Triton never undoes it
        return patch_lang(fn)
    once.once_a_launch = True

    def launch(self, *args, **kwargs):
        patched.append(None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()
    interpreter._patch_lang = once
    interpreter.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_once_a_launch()


GPU_MEMORY_LOCK = os.path.join(tempfile.gettempdir(), f"mtpfactory-gpu-memory-{os.getuid()}.lock")


@contextlib.contextmanager
def _one_at_a_time(path: str):
    """An exclusive lock on the file at `path`, across processes (pytest-xdist's workers); the kernel drops it
    when its process ends, so a worker that dies leaves it free."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """Eight workers on one 80 GB H100 ran 10 of the GPU tests out of memory (BENCHMARKS, thirty-seventh run):
    a worker kept the cache of its last large test (60 GB), and two large tests ran at once. So a test marked
    `gpu_memory` waits for any other one on this machine to end, and every test that used the GPU gives the
    cached memory back as it ends. Nothing happens where CUDA was never initialized (every CPU test)."""
    heavy = request.node.get_closest_marker("gpu_memory") is not None
    with _one_at_a_time(GPU_MEMORY_LOCK) if heavy else contextlib.nullcontext():
        yield
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            if heavy:
                gc.collect()
            torch.cuda.empty_cache()


@pytest.fixture
def gpu_memory_lock() -> str:
    """The path of the file `_gpu_memory` locks (for its test)."""
    return GPU_MEMORY_LOCK
