"""What every builder receives: the composed config, the checked weights, and where tensors live."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from mtpfactory.components.linear import Linear
from mtpfactory.errors import ConfigError
from mtpfactory.weights.source import TensorSource

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class BuildContext:
    cfg: DictConfig
    weights: TensorSource
    dtype: torch.dtype
    device: torch.device

    @property
    def model(self) -> DictConfig:
        return self.cfg.model

    def tensor(self, name: str, *shape: int) -> torch.Tensor:
        """A checked weight in the runtime dtype on the runtime device."""
        return self.weights.take(name, shape, self.dtype, self.device)

    def linear(self, name: str, out_features: int, in_features: int) -> Linear:
        """The projection `name` ([out, in], checkpoint name without `.weight`) as stored under `quant`."""
        return Linear(self.tensor(name + ".weight", out_features, in_features))


def runtime_dtype(cfg: DictConfig) -> torch.dtype:
    if cfg.runtime.dtype not in DTYPES:
        raise ConfigError("runtime.dtype", cfg.runtime.dtype, f"allowed: {', '.join(DTYPES)}",
                          "set runtime.dtype=bfloat16 (the default) or float32 for a reference run")
    return DTYPES[cfg.runtime.dtype]


def runtime_device(cfg: DictConfig) -> torch.device:
    if cfg.runtime.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(cfg.runtime.device)
    except RuntimeError:
        raise ConfigError("runtime.device", cfg.runtime.device, "not a torch device",
                          "use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device", cfg.runtime.device, "no CUDA device is available here",
                          "use runtime.device=cpu or auto")
    return device
