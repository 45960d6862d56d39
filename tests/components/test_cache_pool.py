"""Pool sizing (DESIGN 7): one function, used by the head and by kv_reserve_bytes; and a decode step's tables
from the pool (`commit_step`)."""

import pytest
import torch

import mtpfactory
from mtpfactory.components.cache import PagedKVCache, PoolSpec, WritePlan, drafter_pool_blocks
from mtpfactory.errors import UnknownNameError


@pytest.mark.parametrize("max_seq_len, block, max_seqs, main, extra, expected", [
    (4096, 16, 8, 0, 1, 257 * 8),          # no cap: per_seq * max_seqs
    (4096, 16, 8, 1000, 1, 1000),          # capped at the target's pool
    (4096, 16, 8, 100, 1, 257),            # never below one sequence
    (4096, 16, 8, 10**6, 1, 257 * 8),      # a large target pool does not grow it
    (100, 16, 3, 0, 1, 7 * 3),             # 100 // 16 + 1 = 7
    (100, 16, 3, 0, 2, 8 * 3),             # the GLM drafter's + 2
])
def test_drafter_pool_blocks(max_seq_len, block, max_seqs, main, extra, expected):
    assert drafter_pool_blocks(max_seq_len, block, max_seqs, main, extra) == expected


@pytest.mark.parametrize("overrides", [
    ("+head=dense",),
    ("+head=bf16_moe", "runtime.main_kv_blocks=0", "kv=fp32"),
    ("+head=bf16_moe", "runtime.main_kv_blocks=300", "runtime.max_seq_len=1000"),
    ("+head=dense", "runtime.main_kv_blocks=5", "runtime.max_seq_len=1000", "runtime.block_size=32"),
    ("+head=dense", "kv=fp8", "levers.kv_exact=true", "runtime.max_seq_len=1000"),  # fp32 scales per token
])
def test_kv_reserve_bytes_is_what_the_built_head_allocates(overrides):
    cfg = mtpfactory.compose(*overrides, "runtime.device=cpu")
    head = mtpfactory.build_head(cfg)
    r = cfg.runtime
    blocks = drafter_pool_blocks(r.max_seq_len, r.block_size, r.max_seqs, r.main_kv_blocks)
    c = head.cache
    assert c.k.shape == (blocks, r.block_size, cfg.model.num_key_value_heads, cfg.model.head_dim)
    scales = (c.k_scale, c.v_scale) if cfg.levers.kv_exact else ()
    assert all(t.shape == (blocks, r.block_size, cfg.model.num_key_value_heads) for t in scales)
    assert (c.k_scale is None) == (c.v_scale is None) == (not cfg.levers.kv_exact)
    allocated = sum(t.numel() * t.element_size() for t in (c.k, c.v, *scales))
    assert mtpfactory.kv_reserve_bytes(cfg) == allocated
    assert f"pool={blocks} blocks" in head.summary()


def test_kv_reserve_bytes_at_real_size_needs_no_build():
    cfg = mtpfactory.compose("+head=bf16_moe", "model=qwen3_next_80b")
    # 257 blocks * 8 seqs * 16 tokens * 2 kv heads * 256 dims * 2 (K, V) * 2 bytes
    assert mtpfactory.kv_reserve_bytes(cfg) == 257 * 8 * 16 * 2 * 256 * 2 * 2


@pytest.mark.parametrize("field", ["head.attention", "head.lm_head", "head.norm"])
def test_kv_reserve_bytes_refuses_a_component_the_build_would(field):
    """An unknown component name was counted as the built-in attention's pool; the build refuses it."""
    cfg = mtpfactory.compose("+head=dense", f"{field}=nope")
    with pytest.raises(UnknownNameError, match=rf"^{field}='nope': unknown"):
        mtpfactory.kv_reserve_bytes(cfg)


def test_commit_step_gives_each_rows_slot_its_blocks_and_its_context_from_one_tensor():
    """A decode step's tables (`PagedKVCache.commit_step`): each row's slot as `slots` gives it, the block table of
    each sequence's blocks padded with 0 to the widest, the context after the write; three views of one int32
    tensor (one host-to-device copy a step). Sequences of mixed lengths, one started cold at a late position, and
    one stepped back into its range (a rewrite: its blocks past the row stay until `writing` ends)."""
    spec = PoolSpec(num_blocks=20, block_size=4, kv_heads=1, head_dim=2, dtype=torch.float32)
    c = PagedKVCache(spec, max_seq_len=40, max_seqs=4, device=torch.device("cpu"))
    with c.writing([WritePlan(0, 0, 9), WritePlan(1, 30, 30), WritePlan(2, 0, 13)]):
        for w in (WritePlan(0, 0, 9), WritePlan(1, 30, 30), WritePlan(2, 0, 13)):
            c.commit(w)
    ids, plist = [0, 1, 2, 3], [10, 31, 5, 7]       # 3: cold at 7; 2: back to 5 from its end at 14
    with c.writing([WritePlan(i, p, p) for i, p in zip(ids, plist)]):
        slots, table, lens = c.commit_step(ids, plist)
        blocks = [list(c.seqs[i].blocks) for i in ids]
        assert len(blocks[2]) == 4                  # 0..13 in 4 blocks, kept while writing
        want_slots = torch.cat([c.slots(i, p, p) for i, p in zip(ids, plist)])
    assert slots.dtype == table.dtype == lens.dtype == torch.int32
    assert slots.tolist() == want_slots.tolist()
    assert table.tolist() == [b + [0] * (4 - len(b)) for b in blocks]
    assert lens.tolist() == [11, 2, 6, 1]           # p - start + 1
    assert slots.untyped_storage().data_ptr() == table.untyped_storage().data_ptr() == lens.untyped_storage().data_ptr()
    assert c.seqs[2].end == 6 and len(c.seqs[2].blocks) == 2   # the rewrite dropped its rows past 5 on leaving
