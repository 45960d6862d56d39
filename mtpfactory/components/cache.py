"""The drafter's paged KV pool and the state of each sequence (DESIGN 5).

A sequence's state is one written range of positions [start, end). The first write sets start; a write
covers consecutive positions p..q with start <= p <= end, overwrites p..q and drops everything after q
(end = q + 1). Position p lives in slot p - start of the sequence's block list, so a drafter that starts
cold at a late position uses no blocks for the positions before it. Every check runs before any state
changes: a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mtpfactory.errors import InputError, KVPoolExhaustedError


def drafter_pool_blocks(max_seq_len: int, block_size: int, max_seqs: int, main_kv_blocks: int,
                        extra_blocks: int = 1) -> int:
    """Blocks in the drafter's KV pool (DESIGN 7): per_seq * max_seqs, where per_seq =
    max_seq_len // block_size + extra_blocks; when the target's pool size `main_kv_blocks` is given (> 0),
    capped at it but never below one sequence's worth."""
    per_seq = max_seq_len // block_size + extra_blocks
    if main_kv_blocks == 0:
        return per_seq * max_seqs
    return min(per_seq * max_seqs, max(main_kv_blocks, per_seq))


@dataclass(frozen=True)
class PoolSpec:
    """The shape of a drafter's KV pool: `num_blocks` blocks of `block_size` tokens, K and V each
    [kv_heads, head_dim] per token; with `token_scales` (FP8 KV, `levers.kv_exact`) also an fp32 scale
    per token and KV head for K and for V, [num_blocks, block_size, kv_heads]."""

    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    token_scales: bool = False

    @property
    def nbytes(self) -> int:
        tokens = self.num_blocks * self.block_size * self.kv_heads
        scales = 4 if self.token_scales else 0
        return 2 * tokens * (self.head_dim * self.dtype.itemsize + scales)


@dataclass
class SeqState:
    start: int
    end: int
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WritePlan:
    """Where rows p..q of one sequence go: their slots in the pool, and the sequence's state after."""

    seq_id: int
    p: int
    q: int


class PagedKVCache:
    def __init__(self, spec: PoolSpec, max_seq_len: int, max_seqs: int, device: torch.device) -> None:
        self.spec, self.max_seq_len, self.max_seqs = spec, max_seq_len, max_seqs
        shape = (spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.k_scale = self.v_scale = None
        if spec.token_scales:
            self.k_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
        self._free = list(range(spec.num_blocks - 1, -1, -1))  # a stack: lowest block first
        self.seqs: dict[int, SeqState] = {}
        self._taken: list[int] | None = None    # inside `writing`: the blocks taken, in order

    # --- queries -------------------------------------------------------------------------------------
    @property
    def blocks_in_use(self) -> int:
        return self.spec.num_blocks - len(self._free)

    def state(self, seq_id: int) -> SeqState:
        if seq_id not in self.seqs:
            raise InputError("seq_id", seq_id, f"unknown; live sequences: {sorted(self.seqs) or 'none'}",
                             "use an id that has been written (prefill or step) and not freed")
        return self.seqs[seq_id]

    def _blocks_for(self, start: int, q: int) -> int:
        return (q - start) // self.spec.block_size + 1

    # --- writes --------------------------------------------------------------------------------------
    def check_writes(self, writes: list[WritePlan]) -> None:
        """Refuse, before anything changes, a batch of writes that breaks a rule or does not fit."""
        ids = [w.seq_id for w in writes]
        if len(set(ids)) != len(ids):
            raise InputError("seq_ids", ids, "each sequence may appear once in a call",
                             "step each sequence once per call")
        new = [w.seq_id for w in writes if w.seq_id not in self.seqs]
        if len(self.seqs) + len(new) > self.max_seqs:
            raise InputError("seq_ids", new, f"would make {len(self.seqs) + len(new)} live sequences; "
                             f"runtime.max_seqs={self.max_seqs}", "free finished sequences or raise runtime.max_seqs")
        need = 0
        for w in writes:
            if w.q >= self.max_seq_len or w.p < 0:
                raise InputError("positions", (w.p, w.q), f"must lie in [0, runtime.max_seq_len={self.max_seq_len})",
                                 "raise runtime.max_seq_len or stop drafting this sequence")
            s = self.seqs.get(w.seq_id)
            if s is not None and not s.start <= w.p <= s.end:
                raise InputError("positions", w.p, f"sequence {w.seq_id} holds [{s.start}, {s.end}); a write must "
                                 f"start in [{s.start}, {s.end}] (no holes)",
                                 "write the missing rows first, or truncate/free the sequence")
            start = w.p if s is None else s.start
            need += max(0, self._blocks_for(start, w.q) - (0 if s is None else len(s.blocks)))
        if need > len(self._free):
            raise KVPoolExhaustedError("kv pool", f"{need} blocks needed, {len(self._free)} free",
                                       f"the pool has {self.spec.num_blocks} blocks",
                                       "free finished sequences, or raise runtime.main_kv_blocks / max_seqs")

    @contextmanager
    def writing(self, writes: list[WritePlan]) -> Iterator[None]:
        """Check the writes (`check_writes`: a refused batch changes nothing), then apply them inside: `commit`
        each. If the enclosed forward raises part-way (an op with no provider under backend=triton, an
        interrupt), the cache is put back as it was: a refused call changes nothing (DESIGN 5).

        Blocks a write drops (those past its q) go back to the pool only once the block ends without an error,
        so no other sequence of the call can take them and overwrite rows an undo gives back. The undo then
        needs only each touched sequence's (start, end, block count), the blocks taken (returned to the free
        stack in reverse, which restores its order), and the rows a rewrite (p < end) overwrites: none for a
        decode step at the end."""
        assert self._taken is None, "writes do not nest"
        self.check_writes(writes)
        saved = {w.seq_id: None if (s := self.seqs.get(w.seq_id)) is None else (s.start, s.end, len(s.blocks))
                 for w in writes}
        over = [self.slots(w.seq_id, w.p, min(w.q, s.end - 1)) for w in writes
                if (s := self.seqs.get(w.seq_id)) is not None and w.p < s.end]
        slots = torch.cat(over) if over else None
        rows = [None if t is None or slots is None else _flat(t)[slots] for t in self._pools()]  # copies
        self._taken = []
        try:
            yield
        except BaseException:
            for seq_id, was in saved.items():
                if was is None:
                    self.seqs.pop(seq_id, None)
                elif seq_id in self.seqs:
                    s = self.seqs[seq_id]
                    s.start, s.end = was[0], was[1]
                    del s.blocks[was[2]:]
            self._free.extend(reversed(self._taken))
            for t, r in zip(self._pools(), rows):
                if r is not None:
                    _flat(t)[slots] = r
            raise
        else:
            for seq_id in saved:
                if (s := self.seqs.get(seq_id)) is not None and s.end > s.start:
                    self._release(s, self._blocks_for(s.start, s.end - 1))
        finally:
            self._taken = None

    def commit(self, w: WritePlan) -> torch.Tensor:
        """Apply a checked write, inside `writing`; returns the slots of rows p..q (int64 [q - p + 1]). The blocks
        past q stay with the sequence until `writing` ends."""
        self._commit(w)
        return self.slots(w.seq_id, w.p, w.q)

    def commit_step(self, seq_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's checked writes, one row a sequence (seq_ids[r] at positions[r]), inside `writing`:
        commits each and returns (slots [B], block_tables [B, the most blocks of these sequences] padded with 0,
        context_lens [B]) on the pool's device: views of one int32 tensor (int64 for a pool past 2^31 slots), so
        a step makes one tensor and one host-to-device copy however many sequences it has (a tensor and a copy
        a sequence made 32 sequences' eager step 1.45x slower on an H100: BENCHMARKS, thirty-first run)."""
        bs = self.spec.block_size
        states = [self._commit(WritePlan(i, p, p)) for i, p in zip(seq_ids, positions)]
        rows = [p - s.start for s, p in zip(states, positions)]      # each row's index in its sequence's slots
        width = max(len(s.blocks) for s in states)
        flat = [s.blocks[r // bs] * bs + r % bs for s, r in zip(states, rows)] + [r + 1 for r in rows]
        for s in states:
            flat += s.blocks
            flat += [0] * (width - len(s.blocks))
        b = len(states)
        dtype = torch.int32 if self.spec.num_blocks * bs < 2**31 else torch.int64
        packed = torch.tensor(flat, dtype=dtype).to(self.k.device)
        return packed[:b], packed[2 * b:].view(b, width), packed[b:2 * b]

    def _commit(self, w: WritePlan) -> SeqState:
        assert self._taken is not None, "commit runs inside PagedKVCache.writing"
        s = self.seqs.setdefault(w.seq_id, SeqState(start=w.p, end=w.p))
        n = self._blocks_for(s.start, w.q)
        while len(s.blocks) < n:
            s.blocks.append(self._free.pop())
            self._taken.append(s.blocks[-1])
        s.end = w.q + 1
        return s

    def _pools(self) -> tuple[torch.Tensor | None, ...]:
        return self.k, self.v, self.k_scale, self.v_scale

    def slots(self, seq_id: int, p: int, q: int) -> torch.Tensor:
        s = self.seqs[seq_id]
        idx = torch.arange(p - s.start, q - s.start + 1)
        blocks = torch.tensor(s.blocks, dtype=torch.int64)[idx // self.spec.block_size]
        return (blocks * self.spec.block_size + idx % self.spec.block_size).to(self.k.device)

    # --- shrinking -----------------------------------------------------------------------------------
    def truncate(self, seq_id: int, length: int) -> None:
        """end = min(end, length) (never below start); blocks past the new end go back to the pool."""
        s = self.state(seq_id)
        if length < 0:
            raise InputError("length", length, "must be >= 0", "pass the number of positions to keep")
        s.end = max(s.start, min(s.end, length))
        self._release(s, 0 if s.end == s.start else self._blocks_for(s.start, s.end - 1))

    def free(self, seq_id: int) -> None:
        s = self.state(seq_id)
        self._release(s, 0)
        del self.seqs[seq_id]

    def _release(self, s: SeqState, keep: int) -> None:
        while len(s.blocks) > keep:
            self._free.append(s.blocks.pop())


def _flat(pool: torch.Tensor) -> torch.Tensor:
    """A view of a pool [num_blocks, block_size, ...] by slot: [num_blocks * block_size, ...]."""
    return pool.view(-1, *pool.shape[2:])
