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
    registering the same function again (a module re-import) is allowed.
    """
    if builder is None:
        return lambda fn: register(kind, name, fn, override=override)
    _check_kind(kind)
    taken = _registered[kind].get(name)
    if taken is None and name in _BUILTIN[kind]:
        taken = _BUILTIN[kind][name]
    if taken is not None and not override and _qualname(taken) != _qualname(builder):
        raise ConfigError(f"{kind} '{name}'", _qualname(builder), f"the name is taken by {_qualname(taken)}",
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
        module, attr = _BUILTIN[kind][name].split(":")
        return getattr(importlib.import_module(module), attr)
    raise UnknownNameError(_FIELD[kind], name, names(kind))


def names(kind: str) -> list[str]:
    """Every name registered for `kind`, built-in or user's, sorted."""
    _check_kind(kind)
    load_entry_points()
    return sorted(set(_BUILTIN[kind]) | set(_registered[kind]))


def load_entry_points() -> None:
    """Load the `mtpfactory.components` entry points of installed packages (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        if callable(obj) and not isinstance(obj, type(importlib)):
            obj()
        log.debug("loaded components from entry point %s = %s", ep.name, ep.value)


_FIELD = {"head": "head", "ffn": "head.ffn", "attention": "head.attention", "lm_head": "head.lm_head",
          "norm": "head.norm"}


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UnknownNameError("component kind", kind, KINDS)


def _qualname(obj: Callable | str) -> str:
    if isinstance(obj, str):
        return obj.replace(":", ".")
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
