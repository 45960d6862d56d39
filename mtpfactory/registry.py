"""The component registry: builders by kind (`head`, `ffn`, `attention`, `lm_head`, `norm`) and name.

Built-in components are listed here as `module:attribute` and imported only when first looked up.
A user's own component registers from Python with `mtpfactory.register(kind, name, builder)`, or from an
installed package through the entry-point group `mtpfactory.components` (each entry point names a module
or a callable; loading it runs its `register(...)` calls). Configs choose components by these names, never
by an import path.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable

from mtpfactory.errors import ConfigError, UnknownNameError

log = logging.getLogger(__name__)

KINDS = ("head", "ffn", "attention", "lm_head", "norm")
ENTRY_POINT_GROUP = "mtpfactory.components"

# Built-in components: kind -> name -> "module:attribute", imported lazily.
_BUILTIN: dict[str, dict[str, str]] = {
    "head": {
        "dense": "mtpfactory.heads.qwen_mtp:dense",
        "bf16_moe": "mtpfactory.heads.qwen_mtp:bf16_moe",
    },
    "ffn": {
        "swiglu": "mtpfactory.components.ffn:build_swiglu",
        "moe": "mtpfactory.components.ffn:build_moe",
    },
    "attention": {"gated_gqa": "mtpfactory.components.attention:build_gated_gqa"},
    "lm_head": {"lm_head": "mtpfactory.components.lm_head:build_lm_head"},
    "norm": {
        "zero_centred_rmsnorm": "mtpfactory.components.norms:build_zero_centred_rmsnorm",
        "rmsnorm": "mtpfactory.components.norms:build_rmsnorm",
    },
}

_registered: dict[str, dict[str, Callable]] = {k: {} for k in KINDS}
_entry_points_loaded = False


def register(kind: str, name: str, builder: Callable | None = None, *, override: bool = False):
    """Register `builder` as component `name` of `kind`; usable as `@register(kind, name)`.

    A name that is taken (by a built-in or another builder) is refused unless `override=True`;
    registering the same builder again is allowed: the same object, or the same definition re-created by a
    module re-import (`same_definition`).
    """
    if builder is None:
        return lambda fn: register(kind, name, fn, override=override)
    _check_kind(kind)
    taken, by = _registered[kind].get(name), None
    if taken is None and name in _BUILTIN[kind]:
        taken, by = _load(_BUILTIN[kind][name]), _BUILTIN[kind][name].replace(":", ".")
    if taken is not None and not override and not same_definition(taken, builder):
        raise ConfigError(f"{kind} '{name}'", _qualname(builder), f"the name is taken by {by or _qualname(taken)}",
                          "choose another name, or pass override=True to replace it")
    _registered[kind][name] = builder
    return builder


def get(kind: str, name: str) -> Callable:
    """The builder registered as `name` of `kind`; unknown names raise with a "did you mean"."""
    _check_kind(kind)
    if name not in _registered[kind] and name not in _BUILTIN[kind]:
        load_entry_points()
    if name in _registered[kind]:
        return _registered[kind][name]
    if name in _BUILTIN[kind]:
        return _load(_BUILTIN[kind][name])
    raise UnknownNameError(_FIELD[kind], name, names(kind))


def names(kind: str) -> list[str]:
    """Every name registered for `kind`, built-in or user's, sorted."""
    _check_kind(kind)
    load_entry_points()
    return sorted(set(_BUILTIN[kind]) | set(_registered[kind]))


def load_entry_points() -> None:
    """Load the `mtpfactory.components` entry points of installed packages (once). Each loads on its own: one
    that fails is logged with its name and error, and the others still register."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True  # before loading: a plugin that looks a name up must not load them all again
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type(importlib)):
                obj()
        except Exception as e:
            log.error("entry point %s = %s (group %s) failed to load, so its components are not registered: "
                      "%s: %s", ep.name, ep.value, ENTRY_POINT_GROUP, type(e).__name__, e)
            continue
        log.debug("loaded components from entry point %s = %s", ep.name, ep.value)


_FIELD = {"head": "head", "ffn": "head.ffn", "attention": "head.attention", "lm_head": "head.lm_head",
          "norm": "head.norm"}


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UnknownNameError("component kind", kind, KINDS)


def _load(target: str) -> Callable:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def same_definition(a: Callable, b: Callable) -> bool:
    """The same object, or the same definition run again by a module re-import: a function of equal code (its
    body, name, file, line and column) and defaults, with no captured state (two lambdas, even on one line,
    or two closures of one factory, are different functions), or a module-level class of the same module and
    name. Registries use it to tell a re-import from a second builder under a taken name."""
    if a is b:
        return True
    if isinstance(a, type) and isinstance(b, type):
        return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__) and "<locals>" not in a.__qualname__
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (ca is not None and cb is not None and ca == cb and ca.co_filename == cb.co_filename
            and not getattr(a, "__closure__", None) and not getattr(b, "__closure__", None)
            and (a.__defaults__, a.__kwdefaults__) == (b.__defaults__, b.__kwdefaults__))


def _qualname(obj: Callable) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
