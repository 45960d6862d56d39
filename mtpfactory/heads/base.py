"""`DraftHead`: the sequence API every head shares (DESIGN 5), with its input checks.

A family implements two methods over already-checked inputs whose KV slots are reserved:
`_write_rows` (the batched path that writes rows' KV only) and `_forward` (one row per sequence, the
decode path: writes KV, attends, returns logits and the chained hidden).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import nn

from mtpfactory import ops
from mtpfactory.components.cache import PagedKVCache, WritePlan
from mtpfactory.errors import InputError
from mtpfactory.kernels import argmax


INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


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
        tokens, hidden, positions = self._check_rows(tokens, hidden, positions)
        p = positions.tolist()
        if p != list(range(p[0], p[0] + len(p))):
            raise InputError("positions", p if len(p) <= 8 else f"{p[:8]}...", "prefill positions must be "
                             "consecutive (p, p+1, ..., q)", "split the rows into consecutive runs")
        plan = WritePlan(_as_int(seq_id, "seq_id"), p[0], p[-1])
        with self.cache.writing([plan]):
            if self.prefill_scratch is None:  # row by row through the decode path
                for i in range(len(p)):
                    self._step_checked([plan.seq_id], tokens[i:i + 1], hidden[i:i + 1], positions[i:i + 1])
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
        tokens, hidden, positions = self._check_rows(tokens, hidden, positions, batch=len(ids))
        plans = [WritePlan(i, p, p) for i, p in zip(ids, positions.tolist())]
        with self.cache.writing(plans):
            return self._step_checked(ids, tokens, hidden, positions)

    @torch.inference_mode()
    def propose(self, seq_ids: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                k: int) -> torch.Tensor:
        """k chained steps, each feeding back its argmax token and output hidden at position + 1.
        Returns the drafted tokens, int64 [B, k]."""
        ids = self._check_seq_ids(seq_ids)
        tokens, hidden, positions = self._check_rows(tokens, hidden, positions, batch=len(ids))
        if not isinstance(k, int) or k < 1:
            raise InputError("k", k, "must be an int >= 1", "ask for at least one draft token")
        plans = [WritePlan(i, p, p + k - 1) for i, p in zip(ids, positions.tolist())]
        drafts = []
        with self.cache.writing(plans):
            for _ in range(k):
                logits, hidden = self._step_checked(ids, tokens, hidden, positions)
                with ops.running(self.backend, self.device):
                    tokens = argmax(logits)
                drafts.append(tokens)
                positions = positions + 1
        return torch.stack(drafts, dim=1)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep positions below `length` (end = min(end, length)); the blocks past it go back to the pool."""
        self.cache.truncate(_as_int(seq_id, "seq_id"), _as_int(length, "length"))

    def free(self, seq_id: int) -> None:
        """Forget the sequence and give its blocks back."""
        self.cache.free(_as_int(seq_id, "seq_id"))

    # --- for the families ----------------------------------------------------------------------------
    def _write_rows(self, tokens, hidden, positions, slots) -> None:
        raise NotImplementedError

    def _forward(self, tokens, hidden, positions, slots, block_tables, context_lens):
        raise NotImplementedError

    # --- internals -----------------------------------------------------------------------------------
    def _step_checked(self, ids: list[int], tokens, hidden, positions):
        plist = positions.tolist()
        slots = torch.cat([self.cache.commit(WritePlan(i, p, p)) for i, p in zip(ids, plist)])
        starts = torch.tensor([self.cache.seqs[i].start for i in ids], device=self.device)
        context_lens = positions - starts + 1
        with ops.running(self.backend, self.device):
            return self._forward(tokens, hidden, positions, slots, self.cache.block_table(ids), context_lens)

    def _check_seq_ids(self, seq_ids) -> list[int]:
        ids = torch.as_tensor(seq_ids)
        if ids.dim() != 1 or ids.dtype not in INT_DTYPES or ids.numel() == 0:
            raise InputError("seq_ids", seq_ids, "a non-empty 1-D integer tensor [B]", "pass torch.tensor([id, ...])")
        return [int(i) for i in ids.tolist()]

    def _check_rows(self, tokens, hidden, positions, batch: int | None = None):
        tokens, positions = torch.as_tensor(tokens), torch.as_tensor(positions)
        n = tokens.shape[0] if tokens.dim() == 1 else -1
        for name, t in (("tokens", tokens), ("positions", positions)):
            wrong_rows = batch is not None and t.numel() != batch
            if t.dim() != 1 or t.dtype not in INT_DTYPES or t.numel() == 0 or wrong_rows:
                raise InputError(name, f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}",
                                 "a non-empty 1-D integer tensor"
                                 f"{f' of {batch} rows' if batch else ''}", f"pass {name} as a LongTensor [rows]")
        if positions.numel() != n:
            raise InputError("positions.shape", tuple(positions.shape), f"one position per token ({n})",
                             "pass one position per row")
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != (n, self.hidden_size):
            raise InputError("hidden.shape", tuple(getattr(hidden, "shape", ())), f"expected ({n}, {self.hidden_size})",
                             "pass the target's last hidden state of each row, [rows, hidden_size]")
        if hidden.dtype != self.dtype or hidden.device.type != self.device.type:
            raise InputError("hidden", f"{hidden.dtype} on {hidden.device}", f"the head runs {self.dtype} on "
                             f"{self.device}", f"pass hidden.to({self.device.type!r}, {self.dtype})")
        bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
        if bad.numel():
            raise InputError("tokens", int(bad[0]), f"token ids must lie in [0, vocab_size={self.vocab_size})",
                             "check the tokenizer matches the model preset")
        if bool((positions < 0).any()):
            raise InputError("positions", int(positions.min()), "must be >= 0", "pass absolute positions")
        return tokens.to(self.device), hidden, positions.to(self.device)


def _as_int(value, field: str) -> int:
    """An integer argument (an int, or an integer 0-d tensor / numpy scalar); a float or bool is refused."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise InputError(field, value, "an integer", f"pass {field} as an int")
