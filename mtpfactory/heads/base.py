"""`DraftHead`: the sequence API every head shares (DESIGN 5), with its input checks.

A family implements two methods over already-checked inputs whose KV slots are reserved:
`_write_rows` (the batched path that writes rows' KV only) and `_forward` (one row per sequence, the
decode path: writes KV, attends, returns logits and the chained hidden).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
from torch import nn

from mtpfactory import ops
from mtpfactory.components.cache import PagedKVCache, WritePlan
from mtpfactory.errors import ConfigError, InputError
from mtpfactory.kernels import argmax


INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8)


@dataclass
class PrefillScratch:
    """Staging buffers of `prefill_chunk` rows for the batched prefill (present only with
    `levers.drafter_prefill`)."""

    rows: int
    concat: torch.Tensor  # [rows, 2H]


class DraftHead(nn.Module):
    def __init__(self, *, cache: PagedKVCache, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, backend: str, prefill_scratch: PrefillScratch | None, summary: str) -> None:
        super().__init__()
        self.cache = cache
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device, self.backend = dtype, device, ops.check_backend(backend)
        self.prefill_scratch = prefill_scratch
        self._summary = summary

    # --- the API -------------------------------------------------------------------------------------
    def summary(self) -> str:
        """The build line: quant, shapes, FFN, experts, vocab, LM head MB, KV dtype, pool blocks."""
        return self._summary

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    @torch.inference_mode()
    def prefill(self, seq_id: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Write rows at consecutive `positions` (row p: hidden h_p with token x_{p+1}) into the drafter's KV."""
        tokens, hidden, positions, p = self._check_rows(tokens, hidden, positions)
        if p != list(range(p[0], p[0] + len(p))):
            raise InputError("positions", p if len(p) <= 8 else f"{p[:8]}...", "prefill positions must be "
                             "consecutive (p, p+1, ..., q)", "split the rows into consecutive runs")
        plan = WritePlan(_as_int(seq_id, "seq_id"), p[0], p[-1])
        with self.cache.writing([plan]):
            if self.prefill_scratch is None:  # row by row through the decode path
                for i in range(len(p)):
                    self._step_checked([plan.seq_id], tokens[i:i + 1], hidden[i:i + 1], positions[i:i + 1], p[i:i + 1])
                return
            slots = self.cache.commit(plan)
            c = self.prefill_scratch.rows
            with ops.running(self.backend, self.device):
                for a in range(0, len(p), c):
                    self._write_rows(tokens[a:a + c], hidden[a:a + c], positions[a:a + c], slots[a:a + c])

    @torch.inference_mode()
    def step(self, seq_ids: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per sequence. Returns (logits [B, draft_vocab], hidden_out [B, H])."""
        ids = self._check_seq_ids(seq_ids)
        tokens, hidden, positions, plist = self._check_rows(tokens, hidden, positions, batch=len(ids))
        with self.cache.writing([WritePlan(i, p, p) for i, p in zip(ids, plist)]):
            return self._step_checked(ids, tokens, hidden, positions, plist)

    @torch.inference_mode()
    def propose(self, seq_ids: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                k: int) -> torch.Tensor:
        """k chained steps, each feeding back its argmax token and output hidden at position + 1.
        Returns the drafted tokens, int64 [B, k]."""
        ids = self._check_seq_ids(seq_ids)
        tokens, hidden, positions, plist = self._check_rows(tokens, hidden, positions, batch=len(ids))
        k = _as_int(k, "k")
        if k < 1:
            raise InputError("k", k, "must be an int >= 1", "ask for at least one draft token")
        for i, p in zip(ids, plist):
            if p < self.max_seq_len < p + k:
                raise InputError("k", k, f"sequence {i} would draft positions {p} to {p + k - 1}, and positions lie "
                                 f"below runtime.max_seq_len={self.max_seq_len}: k <= {self.max_seq_len - p} here",
                                 "ask for fewer drafts, or raise runtime.max_seq_len")
        drafts = []
        with self.cache.writing([WritePlan(i, p, p + k - 1) for i, p in zip(ids, plist)]):
            for j in range(k):
                logits, hidden = self._step_checked(ids, tokens, hidden, positions + j, [p + j for p in plist])
                with ops.running(self.backend, self.device):
                    tokens = argmax(logits)
                drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep positions below `length` (end = min(end, length)); the blocks past it go back to the pool."""
        self.cache.truncate(_as_int(seq_id, "seq_id"), _as_int(length, "length"))

    def free(self, seq_id: int) -> None:
        """Forget the sequence and give its blocks back."""
        self.cache.free(_as_int(seq_id, "seq_id"))

    def _apply(self, fn, recurse=True):
        """Under `.to()`, `.half()`, `.cuda()`, ...: refused where it would change a tensor's dtype or device. The head
        is built for runtime.dtype on runtime.device: its KV pool (no buffer of the module), its quantized weights
        (FP8 codes cast to bf16 would lose their scales) and its input checks hold to them. A conversion that changes
        nothing (`head.to(head.device)`) passes."""
        for t in {(t.dtype, t.device): t for t in itertools.chain(self.parameters(), self.buffers())}.values():
            to = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if (to.dtype, to.device) != (t.dtype, t.device):
                field, value = ("runtime.device", to.device) if to.device != t.device else ("runtime.dtype", to.dtype)
                value, dtype = (str(v).removeprefix("torch.") for v in (value, self.dtype))
                raise ConfigError(field, value, f"the head is fixed at its build's runtime.dtype={dtype} and "
                                  f"runtime.device={self.device} (its KV pool, quantized weights and input checks "
                                  "hold to them), so a conversion that changes its "
                                  f"{str(t.dtype).removeprefix('torch.')} tensors is refused",
                                  f"leave the head as built: it runs {value} already" if value == dtype
                                  else f"build the head with {field}={value} instead of converting it")
        return super()._apply(fn, recurse)

    # --- for the families ----------------------------------------------------------------------------
    def _write_rows(self, tokens, hidden, positions, slots) -> None:
        raise NotImplementedError

    def _forward(self, tokens, hidden, positions, slots, block_tables, context_lens):
        raise NotImplementedError

    # --- internals -----------------------------------------------------------------------------------
    def _step_checked(self, ids: list[int], tokens, hidden, positions, plist: list[int]):
        """One decode step of checked rows: `positions` on the device, `plist` the same on the host (no sync)."""
        slots, block_tables, context_lens = self.cache.commit_step(ids, plist)
        with ops.running(self.backend, self.device):
            return self._forward(tokens, hidden, positions, slots, block_tables, context_lens)

    def _check_seq_ids(self, seq_ids) -> list[int]:
        ids = _int_rows("seq_ids", seq_ids, "pass torch.tensor([id, ...])")
        return [int(i) for i in ids.tolist()]

    def _check_rows(self, tokens, hidden, positions, batch: int | None = None):
        """The rows checked: (tokens int64 and positions int64 on the device, hidden, positions on the host).
        One sync each for tokens and positions given on a GPU (their range checks), none for CPU tensors."""
        tokens = _int_rows("tokens", tokens, "pass tokens as a LongTensor [rows]", batch)
        positions = _int_rows("positions", positions, "pass positions as a LongTensor [rows]", batch)
        n = tokens.shape[0]
        if positions.numel() != n:
            raise InputError("positions.shape", tuple(positions.shape), f"one position per token ({n})",
                             "pass one position per row")
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != (n, self.hidden_size):
            raise InputError("hidden.shape", tuple(getattr(hidden, "shape", ())), f"expected ({n}, {self.hidden_size})",
                             "pass the target's last hidden state of each row, [rows, hidden_size]")
        if hidden.dtype != self.dtype or hidden.device != self.device:    # another GPU's: its kernels would read
            raise InputError("hidden", f"{hidden.dtype} on {hidden.device}", f"the head runs {self.dtype} on "
                             f"{self.device}", f"pass hidden.to({str(self.device)!r}, {self.dtype})")
        tokens = tokens.to(torch.int64)  # before any arithmetic: a uint8 or int8 id would wrap
        lo, hi = torch.stack(torch.aminmax(tokens)).tolist()
        if lo < 0 or hi >= self.vocab_size:
            raise InputError("tokens", lo if lo < 0 else hi, f"token ids must lie in [0, vocab_size={self.vocab_size})",
                             "check the tokenizer matches the model preset")
        plist = positions.tolist()
        if min(plist) < 0:
            raise InputError("positions", min(plist), "must be >= 0", "pass absolute positions")
        # hidden contiguous: a column slice of the caller's wider buffer is normal, and the Triton providers (the
        # first norm's) take contiguous rows only; a no-op for contiguous hidden
        return tokens.to(self.device), hidden.contiguous(), positions.to(self.device, torch.int64), plist


def _int_rows(name: str, value, fix: str, batch: int | None = None) -> torch.Tensor:
    """`value` as a non-empty 1-D integer tensor (of `batch` rows when given), or an InputError naming `name`."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(name, value, f"a non-empty 1-D integer tensor ({e})", fix) from None
    if t.dim() != 1 or t.dtype not in INT_DTYPES or t.numel() == 0 or (batch is not None and t.numel() != batch):
        raise InputError(name, f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}",
                         f"a non-empty 1-D integer tensor{f' of {batch} rows' if batch else ''}", fix)
    if t.dtype == torch.uint64 and bool((t.view(torch.int64) < 0).any()):   # past 2^63: int64 would wrap it
        raise InputError(name, max(t.tolist()), f"at most {torch.iinfo(torch.int64).max} (int64)", fix)
    return t


def _as_int(value, field: str) -> int:
    """An integer argument (an int, or an integer 0-d tensor / numpy scalar); a float or bool is refused."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise InputError(field, value, "an integer", f"pass {field} as an int")
