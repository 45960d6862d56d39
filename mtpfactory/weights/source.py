"""Checked access to checkpoint-named tensors: every tensor a builder asks for must be there, with the
expected shape, a float dtype and finite values, or the build refuses naming it (a tensor that silently
fails to load collapses draft acceptance to ~0). The source also remembers what it handed out, so a build
can name every missing tensor at once and warn about MTP tensors it never read."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from mtpfactory.errors import WeightsError

log = logging.getLogger(__name__)

# Other spellings of a name: the multimodal releases put the text model under `model.language_model.`, and
# some Qwen3.5 exports put the MTP layer under `model.mtp.` or `model.language_model.mtp.` (DESIGN 2.1).
MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")
_ALT_PREFIXES = (("model.", ("model.language_model.",)), (MTP_PREFIXES[0], MTP_PREFIXES[1:]))
# Tensors beside `<proj>.weight` that change what the projection computes; a head that reads the weight
# as a plain matrix would compute something else than the checkpoint means.
_MODIFIERS = (".bias", ".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale")
SHOWN = 8  # names listed in a message before "and N more"


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


class TensorSource:
    """A mapping of checkpoint names to tensors, read through `take` (dtype-, shape- and finiteness-checked).

    A missing tensor does not stop the build at once: `take` records it and hands out zeros of the expected
    shape (one element broadcast, so a checkpoint without its experts does not allocate them), and `finish`
    refuses naming every missing tensor, so a user fixes a checkpoint in one round."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], origin: str = "the weights", mapped: bool = False) -> None:
        """`mapped`: the tensors are views of files (a checkpoint read through safetensors' memory map); `take`
        copies one its conversion would leave a view, so a head never reads a file that changes after its build
        (a file cut short under it ended the process with SIGBUS)."""
        self._tensors = tensors
        self.origin = origin
        self.mapped = mapped
        self.read: set[str] = set()
        self.missing: list[str] = []

    def _resolve(self, name: str) -> str | None:
        if name in self._tensors:
            return name
        for plain, alts in _ALT_PREFIXES:
            if name.startswith(plain):
                for alt in alts:
                    if alt + name[len(plain):] in self._tensors:
                        return alt + name[len(plain):]
        return None

    def __len__(self) -> int:
        return len(self._tensors)

    def has(self, name: str) -> bool:
        return self._resolve(name) is not None

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype of `name` (under any spelling of its prefix), or None when it is missing or not a tensor;
        reads nothing."""
        key = self._resolve(name)
        if key is None:
            return None
        stored = getattr(self._tensors, "stored_dtype", None)   # a checkpoint's, from its header
        if stored:
            return stored(key)
        t = self._tensors[key]
        return t.dtype if isinstance(t, torch.Tensor) else None    # not a tensor: `take` refuses it by name

    def mtp_names(self) -> list[str]:
        """The checkpoint's names under any spelling of the MTP prefix."""
        return [k for k in self._tensors if k.startswith(MTP_PREFIXES)]

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor `name`, checked (a float dtype, `shape`, finite in `dtype`), converted to dtype and device;
        read-only zeros (a zero-stride view of one element), recorded for `finish`, when it is missing."""
        key = self._resolve(name)
        if key is None:
            self.missing.append(name)
            return torch.zeros((), dtype=dtype, device=device).expand(shape)
        t = self._tensors[key]
        self._check_format(key, t)
        if tuple(t.shape) != tuple(shape):
            raise WeightsError(f"{key}.shape", tuple(t.shape), f"expected {tuple(shape)}",
                               "check that the model preset matches the checkpoint's config.json")
        out = t.to(device=device, dtype=dtype).contiguous()
        if self.mapped and out.data_ptr() == t.data_ptr():   # no conversion: still the file's pages
            out = out.clone()
        # Checked after the conversion: a finite value past the runtime dtype's range becomes inf there.
        if not bool(torch.isfinite(out).all()):
            if bad := int((~torch.isfinite(t)).sum()):
                raise WeightsError(key, f"{bad} NaN/Inf values", "weights must be finite",
                                   "the checkpoint is damaged: re-download or re-export it")
            raise WeightsError(key, f"{int((~torch.isfinite(out)).sum())} values overflow {dtype}",
                               f"weights must be finite in the runtime dtype (|x| <= {torch.finfo(dtype).max:.4g})",
                               "use runtime.dtype=bfloat16 or float32")
        self.read.add(key)
        return out

    def _check_format(self, key: str, t: torch.Tensor) -> None:
        """Refuse a tensor stored in a format these heads do not read: integer or FP8 codes, or a weight
        that a bias or scale beside it modifies; or a value that holds no tensor data."""
        if not isinstance(t, torch.Tensor):
            raise WeightsError(key, type(t).__name__, "not a torch.Tensor: the head reads checkpoint-named tensors",
                               "pass torch tensors (torch.from_numpy for a NumPy array), or the checkpoint's directory")
        if t.is_meta:
            raise WeightsError(key, f"{t.dtype} on meta", "a meta tensor holds no data (its model was built without "
                               "loading the weights)", "pass the loaded tensors, or the checkpoint's directory")
        stem = key.removesuffix(".weight")
        if t.is_complex():
            raise WeightsError(key, str(t.dtype), "complex numbers where this head reads real floating-point "
                               "weights", "re-export the tensor as bf16 or fp32")
        if not t.is_floating_point():
            if t.dtype == torch.uint8 and stem + ".weight_scale_2" in self._tensors:
                raise WeightsError(key, str(t.dtype), "packed NVFP4 codes with weight_scale_2 beside them: an NVFP4 "
                                   "ModelOpt checkpoint, which these heads do not load",
                                   "load the BF16 checkpoint and quantize at build time with quant=nvfp4")
            raise WeightsError(key, str(t.dtype), "stored as integers (a quantized checkpoint) where this head reads "
                               "floating-point weights", "use the BF16 release of the checkpoint")
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise WeightsError(key, str(t.dtype), "stored FP8 (a block-quantized checkpoint) where this head reads "
                               "unquantized weights", "use the BF16 release of the checkpoint")
        # a plain weight's modifiers sit beside `.weight`; fused experts' (`gate_up_proj`, no `.weight`) after
        # the name, either joined by a dot or, as GPT-OSS-style checkpoints write them, by an underscore
        near = ([stem + m for m in _MODIFIERS] if key.endswith(".weight")
                else [key + sep + m[1:] for m in _MODIFIERS for sep in (".", "_")])
        beside = [b for b in near if b in self._tensors]
        if beside:
            also = f" (and {', '.join(beside[1:])})" if len(beside) > 1 else ""
            raise WeightsError(beside[0], tuple(self._tensors[beside[0]].shape),
                               f"beside {key}{also}, which this head reads as a plain weight (no bias, no scales): "
                               "it would compute something else than the checkpoint means",
                               "use a checkpoint of the model this head builds (BF16, bias-free projections)")

    def take_experts(self, prefix: str, num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert weights as (gate_up [E, 2I, H] with gate rows first, down [E, H, I]) from either layout:
        fused `{prefix}gate_up_proj` / `{prefix}down_proj`, or per expert `{prefix}{i}.{gate,up,down}_proj.weight`."""
        if self.has(prefix + "gate_up_proj"):
            if self.has(prefix + "0.gate_proj.weight"):
                log.warning("%s carries the experts both fused (%sgate_up_proj, down_proj) and per expert "
                            "(%s{i}.{gate,up,down}_proj.weight): loading the fused ones", self.origin, prefix, prefix)
            gate_up = self.take(prefix + "gate_up_proj", (num_experts, 2 * inter, hidden), dtype, device)
            down = self.take(prefix + "down_proj", (num_experts, hidden, inter), dtype, device)
            return gate_up, down
        gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=device)
        down = torch.empty(num_experts, hidden, inter, dtype=dtype, device=device)
        for i in range(num_experts):
            p = f"{prefix}{i}."
            gate_up[i, :inter] = self.take(p + "gate_proj.weight", (inter, hidden), dtype, device)
            gate_up[i, inter:] = self.take(p + "up_proj.weight", (inter, hidden), dtype, device)
            down[i] = self.take(p + "down_proj.weight", (hidden, inter), dtype, device)
        return gate_up, down

    def finish(self) -> None:
        """End of a build (`build_head`, after every builder): refuse naming every missing tensor, so no head keeps
        the zeros that stand in for one; warn about MTP tensors never read."""
        if self.missing:
            first = self.missing[0]
            near = sorted(k for k in self._tensors if k.rsplit(".", 2)[0] == first.rsplit(".", 2)[0])[:6]
            fix = "the checkpoint must carry " + ("them" if len(self.missing) > 1 else "it")
            if any(".experts." in n for n in self.missing):
                fix += (" (experts: per expert {i}.{gate,up,down}_proj.weight, or fused experts.gate_up_proj"
                        " [E, 2I, H] and experts.down_proj [E, H, I])")
            if near:
                fix += f"; found beside {first}: {', '.join(near)}"
            also = f"; {len(self.missing)} missing in all: {_listed(self.missing)}" if len(self.missing) > 1 else ""
            raise WeightsError(first, None, f"missing from {self.origin}{also}", fix)
        unread = sorted(k for k in self.mtp_names() if k not in self.read)
        if unread:
            log.warning("%s: %d MTP tensors were never read, so the head ignores them: %s", self.origin, len(unread),
                        _listed(unread))
