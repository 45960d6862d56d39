"""Op dispatch: each op is defined by its PyTorch reference (provider `native`) and may have fast providers.

`runtime.backend` picks the providers (DESIGN 4):
- `native`: the reference only;
- `auto`: the first fast provider whose predicate accepts the call (device, dtype, shape), else the
  reference, logging the fallback at debug level; also the reference where this GPU cannot launch the
  provider's kernel at all (Triton's OutOfResources: shared memory), warned once a kind of call;
- `triton`: the Triton provider, and an error naming the op when it cannot serve the call (never a
  silent fallback), with the reason where the provider registered its rule (`refusal`); a call the reference
  refuses too (the op's `contract`: shapes and dtypes) raises the reference's error under every backend.

The ops themselves are defined in `mtpfactory.kernels` (one file each). A head runs its forward inside
`use_backend(...)`, so components call them plainly (`K.rms_norm(x, w, eps, zero_centred)`, with
`from mtpfactory import kernels as K`) and never thread a backend argument through.

An op that takes `out=` takes it in its reference too (`write_out`), so a call means the same whichever
provider serves it; every provider checks `out` (`check_out`) before writing anything. The reference computes
its result before it writes `out`, so an `out` sharing memory with an input is right there; a provider whose
kernels could then read what they have already written refuses it by name (`overlap_refusal`), so `auto` runs
the reference for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mtpfactory.errors import ConfigError, InputError, MtpfError
from mtpfactory.registry import _qualname, same_definition

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "native")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)   # the activation dtypes the ops take
_FAST_PRIORITY = ("triton",)
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_backend: contextvars.ContextVar[str] = contextvars.ContextVar("mtpfactory_backend", default="auto")


@dataclass(frozen=True)
class Provider:
    """A fast provider of an op: `fn` takes the op's arguments. It serves a call (`supports`) when `can_run`
    accepts every tensor of the call (tuples and lists of tensors included) and `refusal` finds nothing."""
    name: str
    fn: Callable
    #: why the provider cannot take a call's operands (an MtpfError naming the argument), or None; it takes
    #: the op's arguments, and words the error of an explicit backend that cannot serve the call
    refusal: Callable[..., Exception | None]
    #: whether the provider can launch on these tensors (their devices)
    can_run: Callable[..., bool]

    def supports(self, *args, **kwargs) -> bool:
        if not self.can_run(*_tensors(args, kwargs)):
            return False
        why = self.refusal(*args, **kwargs)
        if isinstance(why, bool):       # a predicate registered where the refusal goes: it would never serve
            raise TypeError(f"provider {self.name} ({_qualname(self.fn)}): its refusal returned {why}; "
                            "register_provider(name, fn, refusal) takes a refusal that returns an error naming "
                            "the argument it cannot take, or None, not a predicate")
        return why is None


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments, and inside its tuple and list arguments (an `out=` triple)."""
    found = []
    for group in (args, kwargs.values()):      # a walk on every op call: no tuple built an argument
        for a in group:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (tuple, list)):
                found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


class Op:
    """One op: `Op(name, reference, contract)`; fast providers attach with `op.register_provider(...)`.

    `contract` takes the op's arguments and returns why the reference itself refuses them (an MtpfError naming
    the argument: shapes and dtypes, never values, which would wait on the GPU), or None; the reference raises
    it first. Under an explicit backend a call that no provider serves raises the contract's error where there is
    one, as the reference would: the call is wrong under every backend, and `auto` would not mend it."""

    def __init__(self, name: str, reference: Callable, contract: Callable[..., MtpfError | None]) -> None:
        self.name = name
        self.reference = reference
        self.contract = contract
        self.__wrapped__ = reference        # inspect.signature(op) gives the reference's: the op's arguments
        self.providers: dict[str, Provider] = {}
        _OPS[name] = self

    def register_provider(self, name: str, fn: Callable, refusal: Callable[..., Exception | None],
                          can_run: Callable[..., bool] | None = None) -> None:
        """Attach a fast provider: `fn` and `refusal` take the op's arguments; `can_run` (default
        `triton_can_run`) takes the call's tensors. Registering the same function again (the same object, or the
        same `def` run again by a module re-import) replaces it; any other function under a taken name is
        refused."""
        old = self.providers.get(name)
        if old is not None and not same_definition(old.fn, fn):
            raise ConfigError(f"op {self.name} provider", name,
                              f"already registered by {_qualname(old.fn)} ({_where(old.fn)}), not {_where(fn)}",
                              "give the provider another name")
        self.providers[name] = Provider(name, fn, refusal, can_run or triton_can_run)

    def __call__(self, *args, **kwargs):
        backend = _backend.get()
        if backend == "native":
            return self.reference(*args, **kwargs)
        for pname in (backend,) if backend != "auto" else _FAST_PRIORITY:
            p = self.providers.get(pname)
            if p is not None and p.supports(*args, **kwargs):
                try:
                    return p.fn(*args, **kwargs)
                except _launch_limit_errors() as e:
                    if backend != "auto":
                        raise ConfigError("runtime.backend", backend, f"op {self.name}'s {pname} provider cannot "
                                          f"launch this call on this GPU ({_describe(args, kwargs)}): {e}",
                                          "use runtime.backend=auto to run the reference for it") from e
                    _warn_once(f"op {self.name}: the {pname} provider cannot launch this call on this GPU "
                               f"({_describe(args, kwargs)}): {e}; running the reference", (self.name, pname, str(e)))
                    return self.reference(*args, **kwargs)
        if backend != "auto":
            if err := self.contract(*args, **kwargs):
                raise err
            p = self.providers.get(backend)
            why = None if p is None else p.refusal(*args, **kwargs)
            devices = sorted({str(t.device) for t in _tensors(args, kwargs)})
            because = ("" if p is None
                       else f"; it refuses {why.what}" if isinstance(why, MtpfError)
                       else f"; it refuses: {why}" if why is not None
                       else f"; {_qualname(p.can_run)} refuses tensors on {', '.join(devices)}")
            raise ConfigError("runtime.backend", backend, f"op {self.name} has no {backend} provider for this call "
                              f"({_describe(args, kwargs)}; providers: {['native', *self.providers]}{because})",
                              "use runtime.backend=auto to fall back to the reference per op")
        if log.isEnabledFor(logging.DEBUG):     # _describe costs microseconds on every op of a CPU run
            log.debug("op %s: no fast provider serves this call (%s); using native", self.name,
                      _describe(args, kwargs))
        return self.reference(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Op({self.name}, providers={['native', *self.providers]})"


_OPS: dict[str, Op] = {}
_warned: set[tuple] = set()


def _launch_limit_errors() -> tuple[type[BaseException], ...]:
    """What a fast provider raises when this GPU cannot launch its kernel for a call at all: Triton's
    OutOfResources (shared memory, threads), raised while loading the kernel, before its launch. The predicates
    model the kernels' shapes and Triton's limits, not each GPU's resources, so `auto` gives such a call to the
    reference and `triton` refuses it. (A provider's launches before the one that fails write only scratch, a
    `workspace=` included, never an input or an `out=`: its heavy kernel comes first, or writes the output.)"""
    if not _HAS_TRITON:
        return ()
    from triton.runtime.errors import OutOfResources
    return (OutOfResources,)


def _warn_once(message: str, key: tuple) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def all_ops() -> dict[str, Op]:
    """Every op defined so far, by name (importing `mtpfactory.kernels` defines them all)."""
    return dict(_OPS)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError("runtime.backend", backend, f"allowed: {', '.join(BACKENDS)}",
                          "set runtime.backend=auto (fast providers where they apply) or native")
    return backend


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Run the enclosed ops under `backend`."""
    token = _backend.set(check_backend(backend))
    try:
        yield
    finally:
        _backend.reset(token)


@contextlib.contextmanager
def running(backend: str, device: torch.device | str) -> Iterator[None]:
    """Run the enclosed ops under `backend`, with Triton launching on `device` (not the current GPU)."""
    with use_backend(backend), contextlib.ExitStack() as stack:
        if torch.device(device).type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield


def triton_can_run(*tensors: torch.Tensor) -> bool:
    """Triton can launch on these tensors: all on one CUDA device; or, when `runtime.backend=triton` asks
    for it explicitly, all on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
    imported: a testing tool, never a fast path, so `auto` does not pick it)."""
    if not _HAS_TRITON:
        return False
    if all(t.is_cuda for t in tensors):
        return len({t.device for t in tensors}) == 1
    return (_backend.get() == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
            and all(t.device.type == "cpu" for t in tensors))


_LAYOUTS = {"any": "", "contiguous": "contiguous ", "rows": "row-strided (last dim contiguous) "}


def number_refusal(field: str, value: object) -> InputError | None:
    """Why a kernel cannot take `value` as its scalar argument `field`, or None: a Python int or float (a tensor
    would reach the kernel as a pointer; a bool is no number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return InputError(field, f"{type(value).__name__} {value!r}"[:120], "a Python float (the kernel takes it as "
                          "a number, not a tensor)", f"pass float({field})")
    return None


def out_refusal(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                field: str = "out", layout: str = "any") -> InputError | None:
    """Why an `out=` (or scratch) tensor cannot hold the op's result, or None (also for no `out`): another shape,
    dtype or device, a layout the provider cannot write (`layout`: "any", "contiguous", or "rows": rows at any
    stride), or elements that share memory (stride 0 along a dim of several, as `expand` makes: torch's copy_
    refuses it, and a kernel writing by strides would race its rows into one)."""
    if out is None:
        return None
    laid = (layout == "any" or (layout == "contiguous" and out.is_contiguous())
            or (layout == "rows" and out.stride(-1) == 1))
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not laid:
        return InputError(field, f"{_dtype(out.dtype)} {list(out.shape)} on {out.device}, strides {out.stride()}",
                          f"must be a {_LAYOUTS[layout]}{_dtype(dtype)} tensor of shape {list(shape)} on {device}",
                          f"allocate it as the op returns its result, or leave {field}=None")
    if any(s == 0 and n > 1 for n, s in zip(out.shape, out.stride())):
        return InputError(field, f"{_dtype(out.dtype)} {list(out.shape)}, strides {out.stride()}",
                          "a tensor whose elements have memory of their own (a stride 0 shares one element "
                          "along that dim)", f"allocate it as the op returns its result (not .expand()), or "
                          f"leave {field}=None")
    return None


def check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              field: str = "out", layout: str = "any") -> None:
    """Refuse an `out=` (or scratch) tensor that cannot hold the op's result (`out_refusal`)."""
    if err := out_refusal(out, shape, dtype, device, field, layout):
        raise err


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share memory: the same storage, and their spans (first to last element, in bytes)
    intersect. Conservative for interleaved strided views, which no caller here builds on purpose."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


_OVERLAP_FIX = "pass an out of its own, or call the op under runtime.backend=auto: it runs the reference for it"


def overlap_refusal(field: str, out: torch.Tensor | None, /, *, in_place: tuple[str, ...] = (),
                    fix: str = _OVERLAP_FIX, why: str | None = None, **inputs: torch.Tensor | None
                    ) -> InputError | None:
    """Why a provider cannot write `out` (its argument `field`) while its kernels read `inputs` (by name; None for
    one not given), or None (also for no `out`): memory shared with one of them (`overlaps`), which a program
    would overwrite while another still reads it (`why` words another reason). An input named in `in_place` may
    be `out` itself, the same elements (`_same_elements`): the caller's kernels read all they need of an element
    before writing it, and no other program reads it; any other overlap with it is refused."""
    if out is None:
        return None
    for name, t in inputs.items():
        if t is None or not overlaps(out, t) or (name in in_place and _same_elements(out, t)):
            continue
        itself = f", or {name} itself (in place)" if name in in_place else ""
        reason = why or f"the provider's kernels write {field} while they still use {name}"
        return InputError(field, f"memory shared with {name}", f"memory apart from {name}{itself} ({reason})", fix)
    return None


def outs_overlap_refusal(out: tuple[torch.Tensor, ...] | None, names: tuple[str, ...], /, *,
                         in_place: tuple[str, ...] = (), **inputs: torch.Tensor | None) -> InputError | None:
    """`overlap_refusal` for an op of several results: each `out[i]` checked as `out[i] (names[i])`; None also for
    no `out`, or one that is not a tuple of as many tensors (`outs_refusal` refuses it, before anything is
    written)."""
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        return None
    for i, o in enumerate(out):
        if isinstance(o, torch.Tensor) and (err := overlap_refusal(f"out[{i}] ({names[i]})", o, in_place=in_place,
                                                                   **inputs)):
            return err
    return None


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements: one start, dtype and shape, and the same stride along every dim
    of more than one element (a dim of one has no step to take)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and all(n == 1 or s == t for n, s, t in zip(a.shape, a.stride(), b.stride())))


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for the launchers' host integers (ceil(a / b) for b > 0). Triton 3.6 makes it a constexpr
    function whose wrapper costs 2.8-3.4 us a call from Python (against 0.1 here, on a CPU of this project's
    machines), and the launchers call it on every op call."""
    return (a + b - 1) // b


@functools.cache
def sm_count(device: torch.device) -> int:
    """A CUDA device's streaming multiprocessors, which launchers weigh their grids against; 0 off a GPU (Triton's
    interpreter, which runs the programs one by one)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host integers (0 for n <= 0, as Triton's), without its 2.3-2.5 us wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` broadcasts to exactly `target` (PyTorch's rule: from the last dim back, each
    dim equal or 1, and no more dims than target's). `torch.broadcast_shapes(shape, target) == target` says the
    same in about 28 us a call on the CPU of this project's machines (its checks run through torch._refs), 0.6 here."""
    return len(shape) <= len(target) and all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target)))


def out_or_empty(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 layout: str = "any") -> torch.Tensor:
    """A fast provider's output: `out` when given (checked: `check_out`), else a fresh tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_out(out, shape, dtype, device, layout=layout)
    return out


def write_out(out: torch.Tensor | None, result: torch.Tensor, field: str = "out") -> torch.Tensor:
    """A reference's `out=`: `result` copied into `out` (checked as the fast providers check it) and `out`
    returned; `result` itself when `out` is None."""
    if out is None:
        return result
    check_out(out, result.shape, result.dtype, result.device, field)
    return out.copy_(result)


def check_indices(field: str, idx: torch.Tensor, low: int, high: int, means: str, fix: str) -> None:
    """Refuse (InputError) an index tensor with a value outside [low, high). For references, which may sync
    (one `.tolist()`); the Triton providers cannot raise without one, so they skip such an index instead
    (write zeros, or nothing) and never read or write out of bounds."""
    if idx.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(idx)).tolist()
    if lo < low or hi >= high:
        raise InputError(field, lo if lo < low else hi, f"{means} lie in [{low}, {high})", fix)


def outs_refusal(out: tuple[torch.Tensor, ...] | None, like: tuple[tuple[tuple[int, ...], torch.dtype], ...],
                 names: tuple[str, ...], device: torch.device, layout: str = "any") -> InputError | None:
    """`out_refusal` for an op of several results: `out` holds one tensor for each (shape, dtype) of `like`, each
    checked as `out[i] (names[i])`; None also for no `out`."""
    if out is None:
        return None
    if not isinstance(out, (tuple, list)) or len(out) != len(like):
        return InputError("out", f"{len(out)} tensors" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}",
                          f"a tuple ({', '.join(names)}) of {len(like)} tensors",
                          "allocate them as the op returns its results, or leave out=None")
    for i, (o, (shape, dtype)) in enumerate(zip(out, like)):
        if err := out_refusal(o, shape, dtype, device, f"out[{i}] ({names[i]})", layout):
            return err
    for j in range(1, len(out)):
        if err := outs_apart_refusal(f"out[{j}] ({names[j]})", out[j], **{f"out[{i}] ({names[i]})": out[i]
                                                                          for i in range(j)}):
            return err
    return None


def outs_apart_refusal(field: str, out: torch.Tensor | None, /, **others: torch.Tensor | None) -> InputError | None:
    """`overlap_refusal` of an op's output `out` (its argument `field`) against its other outputs (`others`, by
    name): one result would overwrite another under every backend."""
    return overlap_refusal(field, out, why="the op returns each result in its own output",
                           fix="allocate each output on its own", **others)


def check_outs(out: tuple[torch.Tensor, ...], like: tuple[tuple[tuple[int, ...], torch.dtype], ...],
               names: tuple[str, ...], device: torch.device, layout: str = "any") -> None:
    """Refuse outputs that cannot hold an op's results (`outs_refusal`)."""
    if err := outs_refusal(out, like, names, device, layout):
        raise err


def write_outs(out: tuple[torch.Tensor, ...] | None, results: tuple[torch.Tensor, ...], names: tuple[str, ...],
               layout: str = "any") -> tuple[torch.Tensor, ...]:
    """`write_out` for a reference of several results: every `out[i]` checked (`check_outs`) before any is
    written, then copied into; `results` themselves when `out` is None."""
    if out is None:
        return results
    check_outs(out, tuple((r.shape, r.dtype) for r in results), names, results[0].device, layout)
    return tuple(o.copy_(r) for o, r in zip(out, results))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(args: tuple, kwargs: dict) -> str:
    """The call's tensors, positional then by keyword (`out=` as well): shape, dtype, device."""
    show = lambda a: f"{tuple(a.shape)} {str(a.dtype).removeprefix('torch.')} {a.device}"  # noqa: E731
    named = [(f"{k}=", v) for k, v in kwargs.items()]
    return ", ".join(name + show(a) for name, a in [("", a) for a in args] + named if isinstance(a, torch.Tensor))



def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)
