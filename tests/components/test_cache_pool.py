"""Pool sizing (DESIGN 7): one function, used by the head and by kv_reserve_bytes."""

import pytest

import mtpfactory
from mtpfactory.components.cache import drafter_pool_blocks
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
