"""A Hugging Face checkpoint directory as a lazy mapping of tensor names to tensors.

Reads `model.safetensors.index.json` when present (sharded checkpoints), else every `*.safetensors` file in
the directory. Tensors are read with safetensors (never pickle) when a builder asks for them, so only the
MTP layer, the embedding and the LM head leave the disk.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mtpfactory.errors import ConfigError, WeightsError

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
# config.json fields that no tensor shape reveals: a preset that differs in one builds a head whose numbers
# are silently off. (tie_word_embeddings shows in the tensors only where lm_head.weight is absent: a checkpoint
# that carries both would otherwise build its LM head from the embedding with a warning.)
CONFIG_FIELDS = ("rope_theta", "partial_rotary_factor", "rms_norm_eps", "norm_topk_prob", "num_experts_per_tok",
                 "tie_word_embeddings")


def _json_number(v: object) -> bool:
    """A finite JSON number a float holds (true and false count: bools are ints). An integer of 400 digits made
    the comparison overflow; a quoted one went unchecked."""
    if isinstance(v, int):
        return abs(v) < 2**1024
    return isinstance(v, float) and math.isfinite(v)


def _object_or_none(fields: dict, name: str) -> dict:
    """config.json's object `name` ({} where absent or null), or a refusal naming it (a string there ended in
    Python's own TypeError or AttributeError)."""
    value = fields.get(name)
    if value is not None and not isinstance(value, dict):
        raise WeightsError(f"config.json {name}", json.dumps(value)[:80], "an object (or null)",
                           "re-download config.json")
    return value or {}


# safetensors' header dtypes (`get_slice(name).get_dtype()`) as torch's
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16,
                       "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "U8": torch.uint8,
                       "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not str(path) or not self.path.is_dir():     # Path("") is the working directory
            raise WeightsError("weights.path", str(path), "not a directory",
                               "pass the checkpoint's directory (the one holding *.safetensors)")
        # One open handle per file for the checkpoint's lifetime: opening parses the whole header (16 ms at
        # 20k tensors), and a per-expert MTP layer reads thousands of tensors.
        self._open: dict[Path, safe_open] = {}
        index = self.path / INDEX
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightsError(INDEX, type(weight_map).__name__, "a weight_map object of tensor name -> shard file",
                                   f"re-download {INDEX}, or delete it to read every *.safetensors file")
            if bad := next(((name, f) for name, f in weight_map.items() if not isinstance(f, str) or not f), None):
                raise WeightsError(f"{INDEX} weight_map[{bad[0]!r}]", json.dumps(bad[1])[:80], "a shard file name",
                                   f"re-download {INDEX}, or delete it to read every *.safetensors file")
            if not weight_map:
                raise WeightsError(f"{INDEX} weight_map", "{}", "the checkpoint's tensor names, each with its shard",
                                   f"re-download {INDEX}, or delete it to read every *.safetensors file")
            self._where = {name: self.path / f for name, f in weight_map.items()}
            self._check_index()
        else:
            self._where = {}
            for f in sorted(self.path.glob("*.safetensors")):
                for name in self._keys(f):
                    if name in self._where:   # which copy is the checkpoint's cannot be told without an index
                        raise WeightsError(name, f"in {self._where[name].name} and {f.name}", "one file a tensor",
                                           f"remove the stale file, or add the checkpoint's {INDEX}")
                    self._where[name] = f
        if not self._where:
            raise WeightsError("weights.path", str(path), f"holds no *.safetensors files (and no {INDEX})",
                               "point at a Hugging Face checkpoint directory")

    def _check_index(self) -> None:
        """Shards the index names but the directory lacks are named in a warning: a drafter reads only the MTP
        layer, the embedding and the LM head, so downloading just their shards is normal, and a read from a
        missing shard is refused naming the tensor (`__getitem__`). A *.safetensors file the index does not
        name is never read: warned too."""
        per_file = Counter(self._where.values())
        missing = sorted(f for f in per_file if not f.exists())
        if missing:
            log.warning("%s: %s names shards the directory lacks: %s; a tensor the head reads from one is refused",
                        self.path, INDEX, ", ".join(f"{f.name} ({per_file[f]} tensors)" for f in missing))
        unlisted = sorted(f.name for f in self.path.glob("*.safetensors") if f not in per_file)
        if unlisted:
            log.warning("%s: %s not listed in %s, so never read; add their tensors to the index's weight_map if "
                        "the head needs them", self.path, ", ".join(unlisted), INDEX)

    def check_model_config(self, model) -> None:
        """Refuse a model preset whose CONFIG_FIELDS differ from the checkpoint's config.json (its `text_config`
        in the multimodal Qwen3.5 releases; RoPE fields also under `rope_parameters`)."""
        file = self.path / "config.json"
        if not file.exists():
            log.warning("%s has no config.json: the preset's %s are not checked against the checkpoint (a wrong "
                        "rope_theta would build and draft badly); add the release's config.json", self.path,
                        ", ".join(CONFIG_FIELDS))
            return
        top = _read_json(file)
        text = top.get("text_config") or top
        if not isinstance(text, dict):
            raise WeightsError("config.json text_config", type(text).__name__, "an object of the text model's fields",
                               "re-download config.json")
        # the text model's fields first, then its rope_parameters, then the top level's (the multimodal releases
        # write tie_word_embeddings there, beside text_config)
        outer = {f: top[f] for f in CONFIG_FIELDS if f in top} if text is not top else {}
        found = {**outer, **_object_or_none(text, "rope_parameters"), **text}
        scaling = _object_or_none(found, "rope_scaling")
        kind = scaling.get("rope_type", scaling.get("type")) or found.get("rope_type")
        if kind not in (None, "default", "mrope"):   # MRoPE with text positions (t = h = w) is plain RoPE
            raise ConfigError("config.json rope scaling", kind, "the heads apply default RoPE only (theta and the "
                              "partial factor), so positions under another scaling would be encoded wrong",
                              "use a config without rope_scaling (as the released checkpoints ship)")
        for field in CONFIG_FIELDS:
            want, have = found.get(field), model.get(field)
            if want is not None and not _json_number(want):  # e.g. "1e7": it would go unchecked
                raise WeightsError(f"config.json {field}", json.dumps(want)[:80], "a JSON number (true or false "
                                   "for a flag), as the releases write it", f"write {field} unquoted in "
                                   f"{file}, or remove it to leave it unchecked")
            if want is not None and have is not None and not math.isclose(want, have, rel_tol=1e-6):
                # (a bool is an int here: true against false differs by 1)
                want = json.dumps(want)  # as an override reads it: false, not False
                raise ConfigError(f"model.{field}", have, f"the checkpoint's config.json says {field}={want}",
                                  f"set model.{field}={want}, or choose the model preset of this checkpoint")

    def _handle(self, file: Path):
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file]

    def _keys(self, file: Path) -> list[str]:
        """The tensor names of a file of the unindexed directory, or a refusal naming the file."""
        try:
            return list(self._handle(file).keys())
        except (SafetensorError, OSError) as e:
            raise WeightsError("weights.path", str(file), f"not a readable safetensors file: {e}",
                               f"re-download {file.name}, or move it out of {self.path}") from e

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._where[name]
        if not file.exists():
            raise WeightsError(name, file.name, f"lives in {file.name}, which {INDEX} names but {self.path} lacks",
                               f"download {file.name} (a drafter reads the shards of the MTP layer, the embedding "
                               "and the LM head)")
        try:
            return self._handle(file).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise WeightsError(name, file.name, f"could not be read from {file}: {e}",
                               f"re-download {file.name}, or re-export the checkpoint (a stale {INDEX} can name a "
                               "tensor its shard lacks)") from e

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """`name`'s dtype as its file's header gives it, without reading the tensor; None for a dtype torch lacks,
        or a shard missing or unreadable (reading the tensor then refuses it by name: `__getitem__`)."""
        file = self._where[name]
        try:
            return _SAFETENSORS_DTYPES.get(self._handle(file).get_slice(name).get_dtype()) if file.exists() else None
        except (SafetensorError, OSError):
            return None

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor to find out
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.path)!r}, {len(self)} tensors)"


def _read_json(file: Path) -> dict:
    """A JSON object from `file`, or a refusal naming it."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(file.name, str(file), f"not readable JSON: {e}", f"re-download {file.name}") from e
    if not isinstance(data, dict):
        raise WeightsError(file.name, type(data).__name__, "a JSON object", f"re-download {file.name}")
    return data
