"""Composing the config tree from override strings, and the rules that span fields."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import typing

from hydra import compose as _hydra_compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import MISSING, DictConfig, OmegaConf, ValidationError

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


BOOL_WORDS = ("1", "0", "true", "false", "yes", "no", "on", "off")
# DESIGN 2.2's heads that are not built yet: `+head=` names them as such, not as unknown (a sweep copied from the
# docs, `-m +head=bf16_moe,per_expert_moe,nvfp4_moe`, says what it lacks); a head leaves this list when it is built
PLANNED_HEADS = ("nvfp4_moe", "native_fp8_moe", "per_expert_moe", "glm5next", "glm5", "deepseek_v3")
SECTIONS = typing.get_type_hints(schema.Config)  # the config's sections: name -> schema dataclass
# every bool field, `section.field` -> whether it may be null (OmegaConf reads any integer as a bool: 2 -> true)
SWITCHES = {f"{section}.{name}": t is not bool for section, kind in SECTIONS.items()
            for name, t in typing.get_type_hints(kind).items() if t in (bool, typing.Optional[bool])}


def check_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """Refuse, before Hydra composes: an unknown option of a group (`+head=NAME`, `kv=NAME`, ...), whose Hydra
    message lists files and search paths, not the options and a "did you mean"; a switch (any bool field, a lever
    or a model flag) set to a word outside BOOL_WORDS, which OmegaConf would read as a bool (`levers.kv_exact=2`,
    `model.tie_word_embeddings=2` switch it on); a field set to a value its type cannot hold
    (`runtime.max_seqs=abc`), which Hydra reports with a traceback; and a
    key the schema lacks set without `+` (`levers.kv_exct=true`, `model._target_=...`), which Hydra refuses
    with its own message and no "did you mean" (with `+` Hydra adds it, and `check_keys` refuses it). A section
    set whole (`demo={k:5}`) is checked key by key, as `demo.k=5`."""
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and value.startswith("{") and (entries := _dict_entries(o)) is not None:
            if (group := key.lstrip("+~")) in GROUPS:
                raise ConfigError(key, value, f"a config group: its value names one of its options "
                                  f"({', '.join(options(group))})",
                                  f"set its fields one by one, e.g. {group}.FIELD=VALUE")
            check_overrides([f"{key}.{k}={v}" for k, v in entries])
            continue
        if eq and key == "head":  # the defaults list names no head, so Hydra has none to override
            raise ConfigError(key, value, "a head is added to the config, written +head=NAME",
                              f"write +head={value}")
        if eq and not o.startswith(("+", "~")) and (err := _plain_key_refusal(key, value)):
            raise err
        key = key.lstrip("+~")
        if eq and key in GROUPS and value not in (known := options(key)):
            if key == "head" and value in PLANNED_HEADS:
                raise ConfigError(key, value, f"not built yet (DESIGN 2.2 plans it); built: {', '.join(known)}",
                                  f"choose one of {', '.join(known)}")
            raise UnknownNameError(key, value, known)
        if eq and key in SWITCHES and value.strip().lower() not in (words := BOOL_WORDS + ("null",) * SWITCHES[key]):
            raise ConfigError(key, value, f"a switch: {', '.join(words)}", f"set {key}=true or {key}=false")
        if eq and (err := _type_refusal(key, value)):
            raise err


def _dict_entries(override: str) -> list[tuple[str, str]] | None:
    """The (key, value as written) pairs of an override whose value is a dict (`demo={k:5,x:{y:1}}`), or None."""
    value = OverridesParser.create().parse_override(override).value()
    if not isinstance(value, dict):
        return None
    return [(k, value_text(v)) for k, v in value.items()]


def value_text(value: object) -> str:
    """A parsed override value as `check_overrides` reads it: a string as the field will hold it (Hydra's string
    form escapes it, `${a.b}` becoming `$\\{a.b\\}`, which no int field holds), anything else as Hydra writes it."""
    return value if isinstance(value, str) else Override._get_value_element_as_str(value)


def _plain_key_refusal(key: str, value: str) -> ConfigError | None:
    """Why the schema has no `key` to set, or None: a section, a group or a section's field (hydra.* passes)."""
    section, dot, field = key.partition(".")
    if section == "hydra" or (not dot and section in GROUPS):
        return None
    return _schema_key_refusal(section, field.partition(".")[0] if dot else None, value, key[len(section):])


def _schema_key_refusal(section: str, field: str | None, value: object, rest: str = "") -> ConfigError | None:
    """Why the schema has no section `section` or no `section.field`, or None (the one rule of `check_keys`, on
    the composed config, and of `_plain_key_refusal`, on an override, whose key goes on with `rest`)."""
    if section not in SECTIONS:
        return _unknown_key(section, value, list(SECTIONS), rest)
    fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if field is not None and field not in fields:
        return _unknown_key(f"{section}.{field}", value, fields)
    return None


def _type_refusal(key: str, value: str) -> ConfigError | None:
    """Why `section.field=value` cannot be held by the field's schema type, or None (also for keys the schema
    lacks, which `check_keys` refuses, and for interpolations and quoted strings, which Hydra reads itself)."""
    section, _, name = key.partition(".")
    kind = SECTIONS.get(section)
    types = typing.get_type_hints(kind) if kind is not None else {}
    if name not in types or "${" in value or value[:1] in ("'", '"'):
        return None
    try:
        setattr(OmegaConf.structured(kind), name, None if value == "null" else value)
    except ValidationError:
        t = types[name]
        shown = t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")
        default = {f.name: f.default for f in dataclasses.fields(kind)}[name]
        example = f", e.g. its default {default!r}" if default not in (MISSING, dataclasses.MISSING, None) else ""
        return ConfigError(key, value, f"not a value of the field's type, {shown}",
                           f"give {key} a value of type {shown}{example}")
    return None


def check_keys(cfg: DictConfig) -> None:
    """Refuse a key the schema lacks. Hydra appends any `+key=value` as written, so a typo (`+quantt=fp8`,
    `+levers.kv_exct=true`) would run as if absent; and a `_target_` would sit unread, since components are
    chosen by registry name, never by a target (DESIGN 5)."""
    for section, node in OmegaConf.to_container(cfg, resolve=False).items():
        if err := _schema_key_refusal(section, None, node):
            raise err
        for field, value in node.items():
            if err := _schema_key_refusal(section, field, value):
                raise err


def _unknown_key(key: str, value: object, known, rest: str = "") -> ConfigError:
    """`key`'s last part is not one of `known`; the key as written goes on with `rest` (`runtim` + `.max_seqs`),
    named whole, and the suggestion keeps it (`runtime.max_seqs`)."""
    name = key.rpartition(".")[2]
    close = difflib.get_close_matches(name, known, n=1)
    fix = (f"remove it: components are chosen by registry name (head.ffn=NAME, ...), never by {name}"
           if name == "_target_" else f"did you mean {key[: -len(name)]}{close[0]}{rest}?" if close
           else "remove it (a +key is added as written, and nothing reads it)")
    return ConfigError(key + rest, value, f"not a config key; known here: {', '.join(known)}", fix)


def compose(*overrides: str) -> DictConfig:
    """Compose the config from the same override strings as the CLI, e.g. `compose("+head=dense")`.

    The result is resolved: a malformed MTPF_* environment value fails here, naming the variable."""
    overrides = list(overrides)
    check_overrides(overrides)
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
    check_keys(cfg)
    resolve(cfg)
    return cfg


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
        if from_env and kind in (bool, "bool") and value.lower() not in BOOL_WORDS:
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
