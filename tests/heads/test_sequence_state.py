"""The state of a sequence (DESIGN 5), rule by rule, on a built tiny dense head in float32 on the CPU.

A sequence holds one written range [start, end). A write p..q needs start <= p <= end, overwrites p..q
and drops what follows (end = q + 1); a row at p attends to [start, p]; truncate sets end = min(end, n);
free returns the blocks; any other position is refused and a refused call changes nothing.

"A fresh head fed the same history" is a second head built from the same config (same synthetic
weights), so each comparison is between two independent KV pools.
"""

from __future__ import annotations

import pytest
import torch

import mtpfactory
from seq_state import assert_unchanged, snapshot

H, VOCAB, BLOCK = 64, 512, 16
BASE = ("+head=dense", "runtime.dtype=float32", "runtime.device=cpu")


# --- helpers -----------------------------------------------------------------------------------------
def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows of (token in [0, VOCAB), hidden float32 [n, H])."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, H, generator=g)


def cat(*parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([t for t, _ in parts]), torch.cat([h for _, h in parts])


def prefill(head, seq: int, r: tuple[torch.Tensor, torch.Tensor], start: int = 0) -> None:
    tokens, hidden = r
    head.prefill(seq, tokens, hidden, torch.arange(start, start + len(tokens)))


def step(head, seq: int, r: tuple[torch.Tensor, torch.Tensor], pos: int, i: int = 0) -> torch.Tensor:
    """Step row i of r for one sequence at `pos`; returns its logits [V]."""
    tokens, hidden = r
    logits, _ = head.step(torch.tensor([seq]), tokens[i:i + 1], hidden[i:i + 1], torch.tensor([pos]))
    return logits[0]


def state(head, seq: int) -> tuple[int, int, list[int]]:
    s = head.cache.state(seq)
    return s.start, s.end, list(s.blocks)


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-6) -> None:
    """max |a - b| <= rel * max |b| (logits of the same history, computed in two KV pools)."""
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel:g} * {scale:.3g}"


def seq_kv(head, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows of the sequence's written range, in position order: [end - start, kv_heads, D]."""
    s, c = head.cache.state(seq), head.cache
    slots = c.slots(seq, s.start, s.end - 1)
    return c.k.flatten(0, 1)[slots], c.v.flatten(0, 1)[slots]


def reset(head) -> None:
    for seq in list(head.cache.seqs):
        head.free(seq)
    assert head.cache.blocks_in_use == 0


# --- fixtures: heads built once per module, emptied around each test -----------------------------------
_BUILT: dict[tuple, mtpfactory.DraftHead] = {}


def built(*overrides: str, copy: int = 0) -> mtpfactory.DraftHead:
    """The head for BASE + overrides, built once per module (`copy` > 0: another head, same config)."""
    key = (overrides, copy)
    if key not in _BUILT:
        _BUILT[key] = mtpfactory.build_head(mtpfactory.compose(*BASE, *overrides))
    head = _BUILT[key]
    reset(head)
    return head


@pytest.fixture
def head():
    h = built()
    yield h
    reset(h)


@pytest.fixture
def ref():
    """A second head from the same config: the fresh head fed the same history."""
    h = built(copy=1)
    yield h
    reset(h)


def test_fixture_heads_share_weights_but_not_pools(head, ref):
    assert head is not ref and head.cache.k.data_ptr() != ref.cache.k.data_ptr()
    r = rows(3, 0)
    prefill(head, 1, r)
    prefill(ref, 1, r)
    assert torch.equal(step(head, 1, r, 3, i=2), step(ref, 1, r, 3, i=2))


# --- overwrite drops what follows ---------------------------------------------------------------------
@pytest.mark.parametrize("rewrite_rows", [1, 4], ids=["step", "prefill"])
def test_overwrite_drops_what_follows(head, ref, rewrite_rows):
    old, new, nxt = rows(40, 1), rows(rewrite_rows, 2), rows(1, 3)
    prefill(head, 1, old)
    assert state(head, 1)[:2] == (0, 40) and head.cache.blocks_in_use == 3  # 40 rows / 16 per block

    q = 20 + rewrite_rows - 1
    if rewrite_rows == 1:
        step(head, 1, new, 20)
    else:
        prefill(head, 1, new, start=20)
    start, end, blocks = state(head, 1)
    assert (start, end) == (0, q + 1)
    assert len(blocks) == 2 and head.cache.blocks_in_use == 2  # block 2 (positions 32..39) went back

    # the old end is now a hole
    snap = snapshot(head)
    with pytest.raises(mtpfactory.InputError, match="no holes"):
        step(head, 1, nxt, 40)
    assert_unchanged(head, snap)

    # a step at the new end sees exactly rows 0..19 of the old history and the rewritten rows
    got = step(head, 1, nxt, q + 1)
    prefill(ref, 1, cat((old[0][:20], old[1][:20]), new))
    want = step(ref, 1, nxt, q + 1)
    assert_rel_close(got, want)
    assert state(head, 1)[:2] == (0, q + 2)


def test_overwrite_at_start_and_at_end(head):
    prefill(head, 1, rows(20, 1))
    step(head, 1, rows(1, 2), 20)  # p == end: an append
    assert state(head, 1)[:2] == (0, 21)
    prefill(head, 1, rows(3, 3), start=0)  # p == start: everything after row 2 goes
    assert state(head, 1)[:2] == (0, 3) and head.cache.blocks_in_use == 1


# --- holes are refused and change nothing -------------------------------------------------------------
def test_hole_is_refused_and_changes_nothing(head):
    prefill(head, 1, rows(10, 1))
    prefill(head, 2, rows(5, 2), start=30)  # a cold sequence: holds [30, 35)
    snap = snapshot(head)
    r = rows(4, 3)
    calls = [
        lambda: step(head, 1, r, 11),  # one past end
        lambda: step(head, 1, r, 100),
        lambda: prefill(head, 1, r, start=12),
        lambda: head.propose(torch.tensor([1]), r[0][:1], r[1][:1], torch.tensor([11]), 3),
        lambda: step(head, 2, r, 29),  # before start
        lambda: prefill(head, 2, r, start=28),  # starts before start, ends inside the range
        # a batch where one write is fine and the other has a hole: neither is written
        lambda: head.step(torch.tensor([1, 2]), r[0][:2], r[1][:2], torch.tensor([10, 36])),
        lambda: head.step(torch.tensor([2, 1]), r[0][:2], r[1][:2], torch.tensor([35, 12])),
    ]
    for call in calls:
        with pytest.raises(mtpfactory.InputError, match="positions"):
            call()
        assert_unchanged(head, snap)


# --- a call whose forward fails part-way changes nothing ---------------------------------------------
def fail_after(n: int, real):
    """`real`, except that its n-th call raises after running (so what it wrote stays written)."""
    calls = []

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            raise mtpfactory.ConfigError("runtime.backend", "triton", "op ffn has no triton provider", "(a test)")
        return out

    return wrapped


def live(head):
    """What a caller can observe: each sequence's (start, end, blocks) and the K/V of its written range, the
    blocks in use, and the free list (which blocks the next write takes)."""
    c = head.cache
    scales = lambda i: [t.flatten(0, 1)[c.slots(i, c.seqs[i].start, c.seqs[i].end - 1)]  # noqa: E731
                        for t in (c.k_scale, c.v_scale) if t is not None]                   # kv_exact's
    seqs = {i: (state(head, i), *seq_kv(head, i), *scales(i)) for i in c.seqs}
    return seqs, head.cache.blocks_in_use, list(head.cache._free)


def assert_live_unchanged(head, before, call: str) -> None:
    seqs, in_use, free = live(head)
    assert {i: s[0] for i, s in seqs.items()} == {i: s[0] for i, s in before[0].items()}, call
    assert all(torch.equal(a, b) for i in seqs for a, b in zip(seqs[i][1:], before[0][i][1:])), call
    assert (in_use, free) == before[1:], call


@pytest.mark.parametrize("drafter_prefill", [True, False])
def test_a_call_whose_forward_fails_changes_nothing(drafter_prefill, monkeypatch):
    head = built(f"levers.drafter_prefill={drafter_prefill}")
    prefill(head, 1, rows(20, 1))
    prefill(head, 2, rows(5, 2), start=30)  # a cold sequence: holds [30, 35)
    before = live(head)
    r = rows(6, 3)
    calls = {  # (the call, the part that fails, on which of its calls)
        "step appending": (lambda: step(head, 1, r, 20), "ffn", 1),
        "step rewriting one, appending the other": (
            lambda: head.step(torch.tensor([1, 2]), r[0][:2], r[1][:2], torch.tensor([10, 35])), "ffn", 1),
        "propose over the end, second step fails": (
            lambda: head.propose(torch.tensor([1]), r[0][:1], r[1][:1], torch.tensor([18]), 4), "ffn", 2),
        "prefill rewriting": (lambda: prefill(head, 1, r, start=8), "write", 1),
        "prefill of a new sequence": (lambda: prefill(head, 3, r, start=40), "write", 1),
        # two new sequences take a block each: both blocks go back, in the order they left
        "step of two new sequences": (
            lambda: head.step(torch.tensor([3, 4]), r[0][:2], r[1][:2], torch.tensor([0, 50])), "ffn", 1),
    }
    for name, (call, part, n) in calls.items():
        with monkeypatch.context() as m:
            if part == "ffn" or not drafter_prefill:  # row by row, a prefill runs the decode path
                m.setattr(head.ffn, "forward", fail_after(n if part == "ffn" else 3, head.ffn.forward))
            else:
                m.setattr(head.attention, "write_kv", fail_after(n, head.attention.write_kv))
            with pytest.raises(mtpfactory.ConfigError, match="no triton provider"):
                call()
        assert_live_unchanged(head, before, name)
    ref = built(f"levers.drafter_prefill={drafter_prefill}", copy=1)
    prefill(ref, 1, rows(20, 1))
    assert_rel_close(step(head, 1, r, 20), step(ref, 1, r, 20))
    reset(head)
    reset(ref)


@pytest.mark.parametrize("kv", [(), ("kv=fp8", "levers.kv_exact=true")], ids=["kv-auto", "kv-fp8-exact"])
def test_a_failed_call_gives_back_rows_that_another_sequence_could_have_taken(kv, monkeypatch):
    """Sequence 1 rewrites at 10 (its block of 16..19 is dropped) while sequence 2, one full block, appends and
    needs a block: the dropped block goes back to the pool only after the call succeeds, so the failed call
    cannot have handed it to sequence 2 and overwritten rows the undo gives back to sequence 1 (K, V and,
    under kv_exact, their scales). On success the dropped block is returned."""
    head = built(*kv)
    prefill(head, 1, rows(20, 1))            # [0, 20): blocks for 0..15 and 16..19
    prefill(head, 2, rows(16, 2), start=30)  # [30, 46): one full block
    before = live(head)
    r = rows(2, 3)
    again = lambda: head.step(torch.tensor([1, 2]), r[0], r[1], torch.tensor([10, 46]))  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(head.ffn, "forward", fail_after(1, head.ffn.forward))
        with pytest.raises(mtpfactory.ConfigError, match="no triton provider"):
            again()
    assert_live_unchanged(head, before, "rewrite one, append the other")
    again()
    assert state(head, 1)[:2] == (0, 11) and len(state(head, 1)[2]) == 1 and head.cache.blocks_in_use == 3
    reset(head)


# --- truncate -----------------------------------------------------------------------------------------
def test_truncate_then_restep_equals_fresh_sequence(head, ref):
    hist, tail = rows(30, 1), rows(6, 2)
    prefill(head, 1, hist)
    head.truncate(1, 100)  # past the end: nothing changes
    assert state(head, 1)[:2] == (0, 30) and head.cache.blocks_in_use == 2
    head.truncate(1, 17)
    start, end, blocks = state(head, 1)
    assert (start, end, len(blocks)) == (0, 17, 2) and head.cache.blocks_in_use == 2
    head.truncate(1, 16)  # block 1 (positions 16..31) is empty now
    assert state(head, 1)[:2] == (0, 16) and head.cache.blocks_in_use == 1
    with pytest.raises(mtpfactory.InputError, match="no holes"):
        step(head, 1, tail, 17)

    prefill(ref, 1, (hist[0][:16], hist[1][:16]))
    for i in range(len(tail[0])):
        assert_rel_close(step(head, 1, tail, 16 + i, i), step(ref, 1, tail, 16 + i, i))
    assert state(head, 1)[:2] == state(ref, 1)[:2] == (0, 22)


def test_truncate_to_nothing_keeps_start(head):
    prefill(head, 1, rows(20, 1), start=50)
    head.truncate(1, 0)
    assert state(head, 1) == (50, 50, []) and head.cache.blocks_in_use == 0
    step(head, 1, rows(1, 2), 50)
    assert state(head, 1)[:2] == (50, 51) and head.cache.blocks_in_use == 1


# --- a cold drafter -----------------------------------------------------------------------------------
def test_cold_drafter_starts_at_its_first_step(head, ref, monkeypatch):
    r = rows(5, 1)
    step(head, 1, r, 100)
    start, end, blocks = state(head, 1)
    assert (start, end, len(blocks)) == (100, 101, 1) and head.cache.blocks_in_use == 1

    # a row at p attends to [start, p]: context p - start + 1 over the sequence's own blocks
    seen = []
    forward = head._forward

    def spy(tokens, hidden, positions, slots, block_tables, context_lens):
        seen.append(context_lens.tolist())
        return forward(tokens, hidden, positions, slots, block_tables, context_lens)

    monkeypatch.setattr(head, "_forward", spy)
    cold = [step(head, 1, r, 100 + i, i) for i in range(1, 5)]
    assert seen == [[2], [3], [4], [5]]
    assert state(head, 1)[:2] == (100, 105) and head.cache.blocks_in_use == 1

    # RoPE scores depend on relative position only, so the same rows written from position 0 give the
    # same logits; a sequence that also holds rows 0..99 does not.
    for i in range(5):
        warm = step(ref, 1, r, i, i)
        if i:
            assert_rel_close(cold[i - 1], warm, rel=1e-5)
    prefill(ref, 2, rows(100, 2))
    longer = [step(ref, 2, r, 100 + i, i) for i in range(5)]
    assert (longer[-1] - cold[-1]).abs().max() > 1e-2


def test_cold_prefill_sets_start(head):
    prefill(head, 1, rows(20, 1), start=100)
    assert state(head, 1)[:2] == (100, 120) and head.cache.blocks_in_use == 2  # 20 rows from 100: 2 blocks


# --- drafter_prefill: batched and row-by-row write the same KV ------------------------------------------
def test_drafter_prefill_on_and_off_write_the_same_kv(head):
    off = built("levers.drafter_prefill=false")
    small = built("runtime.prefill_chunk=16")
    assert off.prefill_scratch is None
    assert head.prefill_scratch is not None and head.prefill_scratch.rows == 256
    assert small.prefill_scratch is not None and small.prefill_scratch.rows == 16
    assert tuple(small.prefill_scratch.concat.shape) == (16, 2 * H)

    r, rewrite, nxt = rows(40, 1), rows(7, 2), rows(1, 3)
    logits = []
    for h in (head, off, small):
        prefill(h, 1, r)  # 40 rows: three chunks of 16 on `small`
        prefill(h, 2, r, start=100)  # cold, crossing a block edge at a different offset
        prefill(h, 3, r)
        prefill(h, 3, rewrite, start=13)  # a prefill that overwrites inside the range
        logits.append(step(h, 1, nxt, 40))
    for seq, n in ((1, 41), (2, 40), (3, 20)):
        want_k, want_v = seq_kv(head, seq)
        assert want_k.shape[0] == n
        for h in (off, small):
            assert state(h, seq)[:2] == state(head, seq)[:2]
            got_k, got_v = seq_kv(h, seq)
            # fp32 projections of 40 rows at once or one by one sum K in a different order (the BLAS picks
            # its kernel by M): a few fp32 ulps of values near 1 apart, so 1e-5, not bit equality
            torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-5)
    for got in logits[1:]:
        assert_rel_close(got, logits[0])
    reset(off)
    reset(small)


# --- free and independence ----------------------------------------------------------------------------
def test_free_returns_every_block(head):
    prefill(head, 1, rows(40, 1))
    prefill(head, 2, rows(17, 2), start=200)
    step(head, 3, rows(1, 3), 7)
    assert head.cache.blocks_in_use == 3 + 2 + 1
    head.free(2)
    assert head.cache.blocks_in_use == 4 and 2 not in head.cache.seqs
    with pytest.raises(mtpfactory.InputError, match="seq_id"):
        head.cache.state(2)
    head.free(1)
    head.free(3)
    assert head.cache.blocks_in_use == 0 and not head.cache.seqs
    # a freed id is a new sequence: its next first write sets start again
    step(head, 2, rows(1, 4), 5)
    assert state(head, 2)[:2] == (5, 6)


def test_two_sequences_are_independent(head, ref):
    a, b, nxt = rows(25, 1), rows(30, 2), rows(2, 3)
    prefill(head, 1, a)
    prefill(ref, 1, a)
    want = step(ref, 1, nxt, 25)

    prefill(head, 2, b)
    assert_rel_close(step(head, 1, nxt, 25), want)
    # whatever happens to sequence 2, sequence 1's row at 25 sees the same context
    for change in (lambda: prefill(head, 2, b, start=10), lambda: head.truncate(2, 3),
                   lambda: step(head, 2, nxt, 3, 1), lambda: head.free(2),
                   lambda: prefill(head, 2, b, start=25)):
        change()
        assert_rel_close(step(head, 1, nxt, 25), want)

    # a batched step equals the two single steps
    prefill(ref, 2, b, start=25)
    batch, _ = head.step(torch.tensor([2, 1]), nxt[0], nxt[1], torch.tensor([55, 26]))
    assert_rel_close(batch[1], step(ref, 1, nxt, 26, 1))
    assert_rel_close(batch[0], step(ref, 2, nxt, 55, 0))


# --- propose ------------------------------------------------------------------------------------------
def test_propose_writes_k_rows_then_truncate_to_accepted_end(head, ref):
    hist, last, nxt = rows(20, 1), rows(1, 2), rows(1, 3)
    prefill(head, 1, hist)
    k = 4
    drafts = head.propose(torch.tensor([1]), last[0], last[1], torch.tensor([20]), k)
    assert drafts.shape == (1, k) and drafts.dtype == torch.int64
    assert bool(((drafts >= 0) & (drafts < VOCAB)).all())
    assert state(head, 1)[:2] == (0, 20 + k) and head.cache.blocks_in_use == 2

    # the same chain by hand: each step feeds back its argmax token and its output hidden
    prefill(ref, 1, hist)
    tok, hid = last
    for j in range(k):
        logits, hid = ref.step(torch.tensor([1]), tok, hid, torch.tensor([20 + j]))
        tok = logits.argmax(dim=-1)
        assert int(tok) == int(drafts[0, j])

    # the target accepted one draft: keep rows 20 and 21, drop 22 and 23
    head.truncate(1, 22)
    ref.truncate(1, 22)
    assert state(head, 1)[:2] == (0, 22)
    with pytest.raises(mtpfactory.InputError, match="no holes"):
        step(head, 1, nxt, 24)
    assert_rel_close(step(head, 1, nxt, 22), step(ref, 1, nxt, 22))


def test_propose_may_draft_up_to_the_last_position(head):
    """Positions lie below runtime.max_seq_len: a chain ending at max_seq_len - 1 fits, one row more is refused."""
    last = head.max_seq_len - 1
    t, h = rows(1, 1)
    step(head, 1, (t, h), last - 3)  # a cold sequence near the end
    snap = snapshot(head)
    with pytest.raises(mtpfactory.InputError, match="^k=4"):
        head.propose(torch.tensor([1]), t, h, torch.tensor([last - 2]), 4)
    assert_unchanged(head, snap)
    drafts = head.propose(torch.tensor([1]), t, h, torch.tensor([last - 2]), 3)
    assert drafts.shape == (1, 3) and state(head, 1)[:2] == (last - 3, last + 1)


def test_batched_propose(head):
    prefill(head, 1, rows(10, 1))
    prefill(head, 2, rows(15, 2), start=40)
    t, h = rows(2, 3)
    drafts = head.propose(torch.tensor([1, 2]), t, h, torch.tensor([10, 55]), 3)
    assert drafts.shape == (2, 3)
    assert state(head, 1)[:2] == (0, 13) and state(head, 2)[:2] == (40, 58)
    head.truncate(1, 10)
    head.truncate(2, 56)
    assert state(head, 1)[:2] == (0, 10) and state(head, 2)[:2] == (40, 56)


# --- integer dtypes and malformed arguments ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.uint16, torch.uint32,
                                   torch.uint64])
def test_small_integer_tokens_and_positions_mean_what_int64_does(head, ref, dtype):
    """Ids and positions of any accepted integer dtype are widened before any arithmetic: a propose from
    position 125 drafts to 129 (an int8 position wrapped at 127), and a uint8 id is not compared with the
    vocab size in uint8 (where 512 is 0)."""
    r = rows(125, 1)
    prefill(head, 1, r)
    prefill(ref, 1, r)
    t, h = rows(1, 2)
    t = t % 100
    got = head.propose(torch.tensor([1], dtype=dtype), t.to(dtype), h, torch.tensor([125], dtype=dtype), 5)
    want = ref.propose(torch.tensor([1]), t, h, torch.tensor([125]), 5)
    assert torch.equal(got, want) and state(head, 1)[:2] == state(ref, 1)[:2] == (0, 130)


def test_uint64_values_past_int64_are_refused_at_their_own_value(head):
    """A uint64 id past 2^63 was widened to a negative int64 and reported at that wrapped value."""
    prefill(head, 1, rows(4, 1))
    snap = snapshot(head)
    t, h = rows(1, 2)
    big = torch.tensor([2**63 + 5], dtype=torch.uint64)
    calls = {"seq_ids": lambda: head.step(big, t, h, torch.tensor([4])),
             "tokens": lambda: head.step(torch.tensor([1]), big, h, torch.tensor([4])),
             "positions": lambda: head.step(torch.tensor([1]), t, h, big)}
    for field, call in calls.items():
        with pytest.raises(mtpfactory.InputError, match=f"^{field}=9223372036854775813: at most 9223372036854775807"):
            call()
    assert_unchanged(head, snap)


def test_malformed_ids_and_k_are_refused_naming_the_argument(head):
    prefill(head, 1, rows(4, 1))
    snap = snapshot(head)
    t, h = rows(1, 2)
    calls = {
        "seq_ids": lambda: head.step(None, t, h, torch.tensor([4])),
        "tokens": lambda: head.step(torch.tensor([1]), None, h, torch.tensor([4])),
        "positions": lambda: head.step(torch.tensor([1]), t, h, [[4]]),
    }
    for field, call in calls.items():
        with pytest.raises(mtpfactory.InputError, match=f"^{field}="):
            call()
    with pytest.raises(mtpfactory.InputError, match="^seq_ids="):
        head.step([2**70], t, h, torch.tensor([4]))
    for k in (True, 1.0, 0):
        with pytest.raises(mtpfactory.InputError, match="^k="):
            head.propose(torch.tensor([1]), t, h, torch.tensor([4]), k)
    assert_unchanged(head, snap)
    import numpy as np
    assert head.propose(torch.tensor([1]), t, h, torch.tensor([4]), np.int64(2)).shape == (1, 2)
