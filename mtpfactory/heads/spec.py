"""What the registry holds for a head: how to build it and how large its KV pool is (without building)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from mtpfactory.components.cache import PoolSpec


@dataclass(frozen=True)
class HeadBuilder:
    ffn_form: str  #: "dense" or "moe": the FFN form its weights must carry (also what synthetic weights make)
    check: Callable[[DictConfig], None]  #: refuses a config that breaks a rule, before any weight is made or read
    build: Callable  #: (BuildContext) -> DraftHead, on a checked config
    pool_spec: Callable[[DictConfig], PoolSpec]
