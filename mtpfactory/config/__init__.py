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
GROUPS = ("head", "model", "quant", "kv", "levers", "runtime", "weights")


def options(group: str) -> list[str]:
    """The options of a config group (conf/GROUP/*.yaml)."""
    folder = importlib.resources.files(CONFIG_MODULE) / group
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def list_heads() -> list[str]:
    """The head options `+head=NAME` can select (conf/head/*.yaml)."""
    return options("head")


def check_group_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """Refuse an unknown option of a group (`+head=NAME`, `kv=NAME`, ...) before Hydra does: Hydra's own
    message lists files and search paths, not the options and a "did you mean"."""
    for o in overrides:
        key, eq, value = o.partition("=")
        group = key.lstrip("+~")
        if eq and group in GROUPS and value not in options(group):
            raise UnknownNameError(group, value, options(group))


def compose(*overrides: str) -> DictConfig:
    """Compose the config from the same override strings as the CLI, e.g. `compose("+head=dense")`.

    The result is resolved: a malformed MTPF_* environment value fails here, naming the variable."""
    overrides = list(overrides)
    check_group_overrides(overrides)
    # A caller that is itself a Hydra app has initialized Hydra with its own config: compose from ours, then
    # give the caller its Hydra back.
    gh = GlobalHydra.instance()
    callers = gh.hydra
    gh.clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = _hydra_compose(config_name="config", overrides=overrides)
    finally:
        GlobalHydra.instance().hydra = callers
    resolve(cfg)
    return cfg


BOOL_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")


def resolve(cfg: DictConfig) -> None:
    """Resolve interpolations in place, naming the environment variable of a lever that fails to read it.
    A lever set on the command line no longer reads its variable (the command line wins, DESIGN 6), so a
    malformed value there is not its concern."""
    raw = OmegaConf.to_container(cfg.levers, resolve=False)
    for name in LEVERS:
        var = f"MTPF_{name.upper()}"
        kind = schema.LeversConfig.__dataclass_fields__[name].type
        value = os.environ.get(var)
        from_env = value is not None and f"oc.env:{var}" in str(raw[name])
        # OmegaConf reads any integer as a bool (2 -> true): a typo should fail, not switch a lever on
        if from_env and kind in (bool, "bool") and value.strip().lower() not in BOOL_WORDS:
            raise ConfigError(var, value, f"levers.{name} is a switch: {', '.join(BOOL_WORDS)}",
                              f"set {var}=1 or {var}=0, or unset it")
        try:
            getattr(cfg.levers, name)
        except Exception as e:  # OmegaConf raises its own validation errors
            if from_env:
                raise ConfigError(var, value, f"levers.{name} cannot read it ({type(e).__name__})",
                                  f"unset {var} or give it a value of the lever's type ({kind})") from None
            raise ConfigError(f"levers.{name}", raw[name], f"cannot be read ({str(e).splitlines()[0]})",
                              f"give levers.{name} a value of the lever's type ({kind})") from None
    OmegaConf.resolve(cfg)
