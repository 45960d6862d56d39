"""Composing the config tree from override strings, and the rules that span fields."""

from __future__ import annotations

import importlib.resources
import os

from hydra import compose as _hydra_compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from mtpfactory.config import schema  # noqa: F401  (stores the schemas)
from mtpfactory.errors import ConfigError, UnknownNameError

CONFIG_MODULE = "mtpfactory.conf"
LEVERS = tuple(f.name for f in schema.LeversConfig.__dataclass_fields__.values())


def list_heads() -> list[str]:
    """The head options `+head=NAME` can select (conf/head/*.yaml)."""
    folder = importlib.resources.files(CONFIG_MODULE) / "head"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def head_from_overrides(overrides: list[str] | tuple[str, ...]) -> str | None:
    """The NAME of a `+head=NAME` (or `head=NAME`) override, or None."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") == "head":
            return value
    return None


def check_head_override(overrides: list[str] | tuple[str, ...]) -> None:
    """Refuse an unknown head before Hydra does (Hydra's own message lists files, not heads)."""
    name = head_from_overrides(overrides)
    if name is not None and name not in list_heads():
        raise UnknownNameError("head", name, list_heads())


def compose(*overrides: str) -> DictConfig:
    """Compose the config from the same override strings as the CLI, e.g. `compose("+head=dense")`.

    The result is resolved: a malformed MTPF_* environment value fails here, naming the variable."""
    overrides = list(overrides)
    check_head_override(overrides)
    if GlobalHydra.instance().is_initialized():
        cfg = _hydra_compose(config_name="config", overrides=overrides)
    else:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = _hydra_compose(config_name="config", overrides=overrides)
    resolve(cfg)
    return cfg


BOOL_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")


def resolve(cfg: DictConfig) -> None:
    """Resolve interpolations in place, naming the environment variable of a lever that fails."""
    for name in LEVERS:
        var = f"MTPF_{name.upper()}"
        kind = schema.LeversConfig.__dataclass_fields__[name].type
        value = os.environ.get(var)
        # OmegaConf reads any integer as a bool (2 -> true): a typo should fail, not switch a lever on
        if kind in (bool, "bool") and value is not None and value.strip().lower() not in BOOL_WORDS:
            raise ConfigError(var, value, f"levers.{name} is a switch: {', '.join(BOOL_WORDS)}",
                              f"set {var}=1 or {var}=0, or unset it")
        try:
            getattr(cfg.levers, name)
        except Exception as e:  # OmegaConf raises its own validation errors
            raise ConfigError(var, value, f"levers.{name} cannot read it ({type(e).__name__})",
                              f"unset {var} or give it a value of the lever's type ({kind})") from None
    OmegaConf.resolve(cfg)
