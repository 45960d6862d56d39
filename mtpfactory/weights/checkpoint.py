"""A Hugging Face checkpoint directory as a lazy mapping of tensor names to tensors.

Reads `model.safetensors.index.json` when present (sharded checkpoints), else every `*.safetensors` file in
the directory. Tensors are read with safetensors (never pickle) when a builder asks for them, so only the
MTP layer, the embedding and the LM head leave the disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from mtpfactory.errors import WeightsError

INDEX = "model.safetensors.index.json"


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise WeightsError("weights.path", str(path), "not a directory",
                               "pass the checkpoint's directory (the one holding *.safetensors)")
        index = self.path / INDEX
        if index.exists():
            self._where = {name: self.path / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self._where = {}
            for f in sorted(self.path.glob("*.safetensors")):
                with safe_open(f, framework="pt") as st:
                    self._where |= {name: f for name in st.keys()}
        if not self._where:
            raise WeightsError("weights.path", str(path), f"holds no *.safetensors files (and no {INDEX})",
                               "point at a Hugging Face checkpoint directory")

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self._where[name], framework="pt") as st:
            return st.get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor to find out
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.path)!r}, {len(self)} tensors)"
