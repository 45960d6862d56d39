"""The MTP layer's fc input in one op (`embed_norm_cat`) against its reference, the gather, the two norms and the
concatenation one after the other (DESIGN 2.1, 4): odd widths, both norms, every dtype, strided rows; outputs
poisoned with NaN; an id past the table; what the provider refuses, refused by the predicate too."""

from __future__ import annotations

import re

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.embed_norm_cat import embed_norm_cat, embed_norm_cat_refusal
from mtpfactory.kernels.embedding import embedding
from mtpfactory.kernels.rms_norm import rms_norm
from backend_refusal import assert_backend_refuses, assert_overlap_refused
# each half is a norm computed and rounded as the reference's, its sum of squares in another order: the norms'
# tolerance (at most 1% of 16-bit elements one ulp off; fp32 relative 1e-6). A swapped half, weight or row misses
# by far more.
from norm_cases import assert_norm_matches as assert_matches

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (N, H, V): one row of one element, odd widths, Qwen3-Next's hidden size
SHAPES = [(1, 1, 3), (5, 7, 11), (33, 64, 40), (2, 130, 5), (3, 2048, 17)]


def _operands(n, h, v, dtype, seed):
    """ids [n] into a [v, h] table, hidden [n, h], the two norms' weights [h]: a distinct scale each, so that a
    swapped weight or half shows."""
    gen = torch.Generator().manual_seed(seed)
    table = (3 * torch.randn(v, h, generator=gen)).to(dtype)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    we, wh = (0.5 * torch.randn(h, generator=gen)).to(dtype), (2 + torch.randn(h, generator=gen)).to(dtype)
    return torch.randint(0, v, (n,), generator=gen), table, we, hidden, wh


def test_the_reference_is_the_gather_the_norms_and_the_concatenation():
    ids, table, we, hidden, wh = _operands(3, 20, 7, torch.bfloat16, 1)
    want = torch.cat([rms_norm.reference(embedding.reference(ids, table), we, 1e-6, True),
                      rms_norm.reference(hidden, wh, 1e-6, True)], dim=-1)
    assert torch.equal(embed_norm_cat.reference(ids, table, we, hidden, wh, 1e-6, True), want)


@pytest.mark.parametrize("zero_centred", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, shape, zero_centred):
    ids, table, we, hidden, wh = _operands(*shape, dtype, sum(shape))
    out = torch.full((shape[0], 2 * shape[1]), float("nan"), dtype=dtype)
    with ops.use_backend("triton"):
        y = embed_norm_cat(ids, table, we, hidden, wh, 1e-6, zero_centred, out=out)
    assert y is out
    assert_matches(y, embed_norm_cat.reference(ids, table, we, hidden, wh, 1e-6, zero_centred))


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_strided_rows_int32_ids_and_an_out_inside_a_wider_buffer(backend):
    """table and hidden rows at strides past their width (columns of wider buffers), ids a column of a wider
    tensor, int32, and `out` the middle of a poisoned buffer: every provider takes them, writes only `out`."""
    ids, table, we, hidden, wh = _operands(4, 24, 9, torch.bfloat16, 2)
    wide_table, wide_hidden = torch.cat([table, table], 1)[:, :24], torch.cat([hidden, hidden], 1)[:, 24:]
    ids = torch.stack([ids, ids]).t()[:, 0].int()
    buf = torch.full((4, 64), float("nan"), dtype=torch.bfloat16)
    with ops.use_backend(backend):
        y = embed_norm_cat(ids, wide_table, we, wide_hidden, wh, 1e-5, True, out=buf[:, 8:56])
    assert_matches(y, embed_norm_cat.reference(ids.long(), table, we, hidden, wh, 1e-5, True))
    assert buf[:, :8].isnan().all() and buf[:, 56:].isnan().all()


def test_dispatch_allocates():
    ids, table, we, hidden, wh = _operands(3, 16, 5, torch.bfloat16, 3)
    with ops.use_backend("triton"):
        y = embed_norm_cat(ids, table, we, hidden, wh, 1e-6, True)
    assert_matches(y, embed_norm_cat.reference(ids, table, we, hidden, wh, 1e-6, True))


@pytest.mark.parametrize("bad", [-1, 5])
def test_an_id_past_the_table_is_refused_by_the_reference_and_normed_zeros_from_the_kernel(bad):
    """As the embedding op: the reference refuses it (a sync); the kernel, which cannot raise, reads nothing and
    writes the normed zero row, zeros, beside the hidden row's norm."""
    ids, table, we, hidden, wh = _operands(3, 16, 5, torch.float32, 4)
    ids[1] = bad
    with pytest.raises(InputError, match=r"^ids=.*lie in \[0, 5\)"):
        embed_norm_cat.reference(ids, table, we, hidden, wh, 1e-6, True)
    with ops.use_backend("triton"):
        y = embed_norm_cat(ids, table, we, hidden, wh, 1e-6, True)
    assert torch.equal(y[1, :16], torch.zeros(16))
    ok = torch.tensor([0, 2])
    assert_matches(y[ok], embed_norm_cat.reference(ids[ok], table, we, hidden[ok], wh, 1e-6, True))
    assert_matches(y[1, 16:], rms_norm.reference(hidden[1], wh, 1e-6, True))


@pytest.mark.parametrize("shares", ["hidden", "table"])
def test_an_out_sharing_memory_with_an_input_is_left_to_the_reference(shares):
    """`out` over hidden's rows (program 0 would write row 1's hidden before its program read it), or over the
    table (read by every program): refused naming both, nothing written; `auto` runs the reference."""
    ids, table, we, hidden, wh = _operands(3, 8, 4, torch.float32, 5)
    buf = torch.randn(64)
    if shares == "hidden":
        hidden, out = buf[:24].view(3, 8), buf[8:56].view(3, 16)
        hidden.copy_(torch.randn(3, 8))
    else:
        table, out = buf[:32].view(4, 8), buf[:48].view(3, 16)
    want = embed_norm_cat.reference(ids, table.clone(), we, hidden.clone(), wh, 1e-6, True)
    assert_overlap_refused(embed_norm_cat, "out", shares, ids, table, we, hidden, wh, 1e-6, True, out=out)
    with ops.use_backend("auto"):
        assert torch.equal(embed_norm_cat(ids, table, we, hidden, wh, 1e-6, True, out=out), want)


def _ops():
    """(ids [3], table [5, 12], embed_weight, hidden [3, 12], hidden_weight), fp32: operands the kernel takes."""
    return _operands(3, 12, 5, torch.float32, 8)


# case: a change to `_ops()`'s operands, the field refused, what its message says
BAD = {
    "ids 2-D": (lambda i, t, we, h, wh: (i[:, None], t, we, h, wh), "ids", r"int32 or int64 \[N\]"),
    "ids float": (lambda i, t, we, h, wh: (i.float(), t, we, h, wh), "ids", "int32 or int64"),
    "ids elsewhere": (lambda i, t, we, h, wh: (i.to("meta"), t, we, h, wh), "ids", "on hidden's device, cpu"),
    "hidden of other rows": (lambda i, t, we, h, wh: (i, t, we, h[:2], wh), "hidden", r"one row an id"),
    "table of another width": (lambda i, t, we, h, wh: (i, t[:, :6], we, h, wh), "table", r"\[V, 12\]"),
    "table of another dtype": (lambda i, t, we, h, wh: (i, t.double(), we, h, wh), "table", "hidden's dtype"),
    "table strided along H": (lambda i, t, we, h, wh: (i, torch.cat([t, t], 1)[:, ::2], we, h, wh), "table",
                              "unit stride along a row"),
    "hidden strided along H": (lambda i, t, we, h, wh: (i, t, we, torch.cat([h, h], 1)[:, ::2], wh), "hidden",
                               "unit stride along a row"),
    "hidden past a block": (lambda i, t, we, h, wh: (i[:1], torch.zeros(5, 16385), torch.zeros(16385),
                                                     torch.zeros(1, 16385), torch.zeros(16385)), "hidden",
                            "H <= 16384"),
    "embed_weight short": (lambda i, t, we, h, wh: (i, t, we[:6], h, wh), "embed_weight", r"\[H\] = \[12\]"),
    "hidden_weight strided": (lambda i, t, we, h, wh: (i, t, we, h, torch.stack([wh, wh], -1)[:, 0]),
                              "hidden_weight", "contiguous"),
    "hidden_weight elsewhere": (lambda i, t, we, h, wh: (i, t, we, h, wh.to("meta")), "hidden_weight",
                                "on hidden's device, cpu"),
}


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`embed_norm_cat_refusal`): the predicate says no, and an explicit `runtime.backend=triton` names
    the operand (or the contract's error, where the reference refuses it too); `auto` gives the reference what
    it takes."""
    make, field, allowed = BAD[case]
    args = (*make(*_ops()), 1e-6, True)
    why = embed_norm_cat_refusal(*args)
    assert isinstance(why, InputError) and why.field == field, why
    assert re.search(allowed, str(why)), str(why)
    assert not embed_norm_cat.providers["triton"].supports(*args)
    with ops.use_backend("triton"):
        assert_backend_refuses(embed_norm_cat, field, *args)
    if embed_norm_cat.contract(*args) is None and all(t.device.type == "cpu" for t in args[:5]):
        with ops.use_backend("auto"):
            assert torch.equal(embed_norm_cat(*args), embed_norm_cat.reference(*args))


def test_an_eps_that_is_not_a_number_is_left_to_the_reference():
    ids, table, we, hidden, wh = _ops()
    why = embed_norm_cat_refusal(ids, table, we, hidden, wh, torch.tensor(1e-6), True)
    assert isinstance(why, InputError) and why.field == "eps"
    with ops.use_backend("auto"):
        got = embed_norm_cat(ids, table, we, hidden, wh, torch.tensor(1e-6), True)
    assert torch.equal(got, embed_norm_cat.reference(ids, table, we, hidden, wh, 1e-6, True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 32])
def test_gpu_matches_reference(dtype, n):
    """Qwen3-Next's hidden size (2048) and a wide one (5120), compiled."""
    for h in (2048, 5120):
        ids, table, we, hidden, wh = (t.cuda() for t in _operands(n, h, 1000, dtype, n + h))
        out = torch.full((n, 2 * h), float("nan"), dtype=dtype, device="cuda")
        with ops.use_backend("triton"):
            y = embed_norm_cat(ids, table, we, hidden, wh, 1e-6, True, out=out)
        assert_matches(y, embed_norm_cat.reference(ids, table, we, hidden, wh, 1e-6, True))
