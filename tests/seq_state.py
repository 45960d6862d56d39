"""What the head tests share: a snapshot of everything a refused call must leave alone."""

import torch


def snapshot(head):
    """Each sequence's (start, end, blocks), the blocks in use, and the K/V pool tensors."""
    seqs = {i: (s.start, s.end, list(s.blocks)) for i, s in head.cache.seqs.items()}
    return seqs, head.cache.blocks_in_use, head.cache.k.clone(), head.cache.v.clone()


def assert_unchanged(head, snap) -> None:
    seqs, in_use, k, v = snap
    assert {i: (s.start, s.end, list(s.blocks)) for i, s in head.cache.seqs.items()} == seqs
    assert head.cache.blocks_in_use == in_use
    assert torch.equal(head.cache.k, k) and torch.equal(head.cache.v, v)
