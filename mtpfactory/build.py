"""What every builder receives: the composed config, the checked weights, and where tensors live."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from omegaconf import DictConfig

from mtpfactory.components.linear import Linear, make_linear
from mtpfactory.errors import ConfigError
from mtpfactory.weights.source import TensorSource

T = TypeVar("T")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class BuildContext:
    cfg: DictConfig
    weights: TensorSource
    dtype: torch.dtype
    device: torch.device
    #: how each projection role ("fc", "q", "k", "v", "o", "ffn", "experts", "lm_head", ...) is stored:
    #: "unq" (runtime dtype), "fp8" (W8A16 per row) or "nvfp4" (W4A16); roles not listed are "unq"
    formats: dict[str, str] = field(default_factory=dict)

    @property
    def model(self) -> DictConfig:
        return self.cfg.model

    def tensor(self, name: str, *shape: int) -> torch.Tensor:
        """A checked weight in the runtime dtype on the runtime device."""
        return self.weights.take(name, shape, self.dtype, self.device)

    def fmt(self, role: str) -> str:
        return self.formats.get(role, "unq")

    def linear(self, name: str, out_features: int, in_features: int, role: str) -> Linear:
        """The projection `name` ([out, in], checkpoint name without `.weight`), stored as its `role` says."""
        weight = self.tensor(name + ".weight", out_features, in_features)
        return make_linear(weight, self.fmt(role), self.dtype, name, self.cfg.levers.gemv_split_work)


def runtime_dtype(cfg: DictConfig) -> torch.dtype:
    if cfg.runtime.dtype not in DTYPES:
        raise ConfigError("runtime.dtype", cfg.runtime.dtype, f"allowed: {', '.join(DTYPES)}",
                          "set runtime.dtype=bfloat16 (the default) or float32 for a reference run")
    return DTYPES[cfg.runtime.dtype]


def runtime_device(cfg: DictConfig) -> torch.device:
    """`runtime.device` as the device its tensors report: `cuda` (and `auto` on a GPU) the current GPU by index,
    `cpu:0` plain `cpu`, so that a caller's tensor compares equal to it exactly when it lies there."""
    spelled = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.runtime.device == "auto" else cfg.runtime.device
    try:
        device = torch.device(spelled)
    except RuntimeError:
        raise ConfigError("runtime.device", cfg.runtime.device, "not a torch device",
                          "use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError("runtime.device", cfg.runtime.device, "the heads run on the CPU or a CUDA GPU",
                          "use auto, cpu, cuda or cuda:N")
    if device.type == "cpu" and device.index not in (None, 0):     # torch takes cpu:N and ignores N
        raise ConfigError("runtime.device", cfg.runtime.device, "the CPU takes no device index",
                          "use runtime.device=cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device", cfg.runtime.device, "no CUDA device is available here",
                          "use runtime.device=cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= (count := torch.cuda.device_count()):
        raise ConfigError("runtime.device", cfg.runtime.device,
                          f"a GPU index in [0, {count}): this machine has {count}",
                          f"use runtime.device=cuda:0{f' to cuda:{count - 1}' if count > 1 else ''} or cuda")
    if device.type == "cpu":
        return torch.device("cpu")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def weights_seed(cfg: DictConfig) -> int:
    """`weights.seed`, refused outside [0, 2^63): torch's generators take at most 2^64 - 1, and the demo draws
    its sequences from seed + 1."""
    seed = cfg.weights.seed
    if not 0 <= seed < 2**63:
        raise ConfigError("weights.seed", seed, "a seed in [0, 2^63)", "use one in that range, e.g. weights.seed=0")
    return seed


def allocated(make: Callable[[], T], field: str, value: object, nbytes: int, device: torch.device, fix: str) -> T:
    """`make()`, or a ConfigError naming the field that sized its `nbytes` when `device` cannot hold them."""
    try:
        return make()
    except RuntimeError as e:  # torch's allocators: CPU and CUDA out of memory, a size past int64
        raise ConfigError(field, value, f"sizes {nbytes / 2**30:.3g} GiB, which {device} cannot allocate "
                          f"({str(e).splitlines()[0][:200]})", fix) from None
