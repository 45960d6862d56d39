"""Op dispatch: each op is defined by its PyTorch reference (provider `native`) and may have fast providers.

`runtime.backend` picks the providers (DESIGN 4):
- `native`: the reference only;
- `auto`: the first fast provider whose predicate accepts the call (device, dtype, shape), else the
  reference, logging the fallback at debug level.

A head runs its forward inside `use_backend(...)`, so components call ops plainly (`ops.rms_norm(x, w)`)
and never thread a backend argument through.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mtpfactory.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "native")
_FAST_PRIORITY = ("triton",)
_backend: contextvars.ContextVar[str] = contextvars.ContextVar("mtpfactory_backend", default="auto")


@dataclass(frozen=True)
class Provider:
    name: str
    fn: Callable
    supports: Callable[..., bool]


class Op:
    """One op: `Op(name, reference)`; fast providers attach with `op.register_provider(...)`."""

    def __init__(self, name: str, reference: Callable) -> None:
        self.name = name
        self.reference = reference
        self.providers: dict[str, Provider] = {}
        _OPS[name] = self

    def register_provider(self, name: str, fn: Callable, supports: Callable[..., bool]) -> None:
        """Attach a fast provider. Re-registering the same function (a module re-import) replaces it."""
        old = self.providers.get(name)
        if old is not None and _qualname(old.fn) != _qualname(fn):
            raise ConfigError(f"op {self.name} provider", name, "already registered by " + _qualname(old.fn),
                              "give the provider another name")
        self.providers[name] = Provider(name, fn, supports)

    def __call__(self, *args, **kwargs):
        backend = _backend.get()
        if backend != "native":
            for pname in _FAST_PRIORITY:
                p = self.providers.get(pname)
                if p is not None and p.supports(*args, **kwargs):
                    return p.fn(*args, **kwargs)
            log.debug("op %s: no fast provider serves this call; using native", self.name)
        return self.reference(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Op({self.name}, providers={['native', *self.providers]})"


_OPS: dict[str, Op] = {}


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


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
