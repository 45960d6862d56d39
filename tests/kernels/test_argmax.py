"""Batched argmax's Triton provider against its reference (DESIGN 4). Exact: it only compares values (every
dtype converts to fp32 exactly), so the index must equal torch's, ties going to the lowest index, NaN
beating every number (the first NaN wins), as torch.argmax has it. Outputs poisoned with -1."""

from __future__ import annotations

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.argmax import _chunk_for, argmax, argmax_refusal, argmax_triton
from backend_refusal import assert_backend_refuses, assert_overlap_refused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def run(logits: torch.Tensor, **kw) -> torch.Tensor:
    """The Triton provider into a poisoned out: through the op, or with tuning arguments (`chunk`), which the op
    does not take, called directly."""
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    with ops.use_backend("triton"):
        got = argmax_triton(logits, out=out, **kw) if kw else argmax(logits, out=out)
    assert got is out
    return got


def planted(B: int, V: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Random rows, then: row 1 the max at two indices (the lower one answers), far apart so that they
    fall in different chunks when V is large; row 2 all -inf; row 3 -inf but for one finite value; row 4
    all equal."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, V, device=device, generator=gen).to(dtype)
    if B > 1 and V > 1:
        lo, hi = V // 3, V - 1
        x[1, lo] = x[1, hi] = 10.0
    if B > 2:
        x[2] = float("-inf")
    if B > 3:
        x[3] = float("-inf")
        x[3, V // 2] = -1e4
    if B > 4:
        x[4] = 0.5
    return x


@pytest.mark.parametrize("V", [1, 3, 1000, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, V):
    """V = 4099 spans three 2048 chunks (two stages); smaller V is one chunk (one stage)."""
    x = planted(6, V, dtype, seed=V)
    assert torch.equal(run(x), argmax.reference(x))


@pytest.mark.parametrize("chunk", [16, 64])
def test_many_chunks_ties_across_chunks(chunk):
    """Small chunks force the second stage over many partials; maxima tied within and across chunks."""
    x = planted(6, 1000, torch.bfloat16, seed=chunk)
    x[0, 100] = x[0, 101] = x[0, 900] = 20.0  # within one chunk of 16 or 64, and across
    x[5, 640] = x[5, 64] = float("inf")       # +inf ties too
    want = argmax.reference(x)
    assert want[0] == 100 and want[1] == 333 and want[2] == 0 and want[5] == 64
    assert torch.equal(run(x, chunk=chunk), want)


@pytest.mark.parametrize("chunk", [16, 2048])
def test_nan_and_signed_zero(chunk):
    x = torch.full((5, 100), -1.0)
    x[0, 70], x[0, 30], x[0, 50] = float("nan"), float("nan"), float("inf")  # the first NaN: 30
    x[1, 99] = float("nan")
    x[2, 10], x[2, 5] = 0.0, -0.0  # -0 == +0: the lower index
    x[3, 0] = float("nan")
    x[4, 2], x[4, 80] = float("inf"), float("nan")  # a NaN after +inf still wins
    want = argmax.reference(x)
    assert want.tolist() == [30, 99, 5, 0, 80]
    assert torch.equal(run(x, chunk=chunk), want)


def test_strided_rows_and_dispatch():
    """Rows of a wider buffer (stride(0) > V), and the op allocating its own output."""
    x = torch.randn(5, 4200)[:, :4099]
    with ops.use_backend("triton"):
        assert torch.equal(argmax(x), argmax.reference(x))


@pytest.mark.parametrize("V", [100, 4099])  # one stage; two
@pytest.mark.parametrize("backend", ["triton", "native"])
def test_strided_out_which_every_provider_takes(backend, V):
    """`out` a column of a wider buffer, written by its stride by the Triton provider and the reference alike;
    an `out` of another dtype or length refused by both."""
    x = planted(5, V, torch.float32, seed=7)
    buf = torch.full((5, 2), -1, dtype=torch.int64)
    with ops.use_backend(backend):
        assert torch.equal(argmax(x, out=buf[:, 0]), argmax.reference(x)) and (buf[:, 1] == -1).all()
        for bad in (torch.empty(5, dtype=torch.int32), torch.empty(4, dtype=torch.int64)):
            with pytest.raises(InputError, match="out="):
                argmax(x, out=bad)


def test_an_out_sharing_memory_with_the_logits_is_left_to_the_reference():
    """`out` (int64) a view of the logits' own bytes, over row 1: one chunk a row, so program 0 wrote its index
    over row 1's largest logit before program 1 read the row (row 1 then answered 5, not 0). The provider refuses
    it naming both, writing nothing; `auto` runs the reference, which finds every index before it writes."""
    buf = torch.randn(32, generator=torch.Generator().manual_seed(0))
    logits = buf.view(4, 8)
    logits[1, 0] = 10.0
    out = buf.view(torch.int64)[4:8]
    want = argmax.reference(logits.clone())
    assert_overlap_refused(argmax, "out", "logits", logits, out=out)
    with pytest.raises(InputError, match="^out='memory shared with logits'"):
        argmax_triton(logits, out=out)
    with ops.use_backend("auto"):
        assert torch.equal(argmax(logits, out=out), want)


def _logits():
    """[3, 100] fp32: logits the kernel takes."""
    return torch.randn(3, 100, generator=torch.Generator().manual_seed(10))


# case: logits from `_logits()`, what the refusal (field logits) says they must be
BAD = {
    "1-D": (lambda x: x[0], r"a 2-D bf16, fp16 or fp32 \[B, V\]"),
    "3-D": (lambda x: x[None], r"a 2-D bf16, fp16 or fp32 \[B, V\]"),
    "fp64": (lambda x: x.double(), "bf16, fp16 or fp32"),
    "int64": (lambda x: (100 * x).long(), "bf16, fp16 or fp32"),
    "V = 0": (lambda x: x[:, :0], "at least one logit a row"),
    "B = 0, V = 0": (lambda x: x[:0, :0], "at least one logit a row"),
    "strided along V": (lambda x: torch.cat([x, x], 1)[:, ::2], "unit stride along V"),
    "V past int32 indices": (lambda x: x[:1, :1].expand(1, 2**30 + 1), "V <= 1073741824"),
    "B past the grid": (lambda x: x[:1].expand(2**31, 100), "B <= 2147483647"),
}


def _poisoned(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, what to check is still -1): int64 [B], one -1 seen through stride 0 where B is huge."""
    if b <= 2**16:
        out = torch.full((b,), -1, dtype=torch.int64)
        return out, out
    one = torch.full((1,), -1, dtype=torch.int64)
    return one.expand(b), one


@pytest.mark.parametrize("case", BAD)
def test_logits_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`argmax_refusal`): the predicate says no, `argmax_triton` called directly raises it naming logits
    and writes nothing, and an explicit `runtime.backend=triton` says it refuses logits."""
    make, allowed = BAD[case]
    x = make(_logits())
    out, poison = _poisoned(x.shape[0] if x.dim() > 1 else 1)
    assert argmax_refusal(x).field == "logits"
    with ops.use_backend("triton"):
        assert not argmax.providers["triton"].supports(x, out)
        with pytest.raises(InputError, match=rf"^logits=.*{allowed}"):
            argmax_triton(x, out=out)
        assert_backend_refuses(argmax, "logits", x, out=out)
    assert (poison == -1).all()


@pytest.mark.parametrize("chunk, V, allowed", [(0, 100, "a power of two"), (48, 100, "a power of two"),
                                                (2**22, 2**21 + 1, "at most 1048576 once capped at V"),
                                                (1, 70000, "at most 65535 chunks of V = 70000")])
def test_chunks_the_kernel_cannot_take_are_refused_by_the_provider(chunk, V, allowed):
    """`chunk` (the provider's tuning argument, which the op does not take) builds one tl.arange and cuts V across
    the grid's second dimension: one it cannot is refused naming it, and nothing is written."""
    x, out = torch.zeros(2, V), torch.full((2,), -1, dtype=torch.int64)
    assert argmax_refusal(x, chunk).field == "chunk"
    with pytest.raises(InputError, match=rf"^chunk={chunk}: .*{allowed}"):
        argmax_triton(x, out=out, chunk=chunk)
    assert (out == -1).all()


def test_the_ops_chunk_cuts_every_v_it_takes_within_the_grid():
    """Through the op (chunk None) V up to 2^30 runs: 2048 a chunk, more past 65535 * 2048, capped at V."""
    assert _chunk_for(151_936, None) == 2048 and _chunk_for(100, None) == 128
    for v in (65535 * 2048, 65535 * 2048 + 1, 2**30):
        chunk = _chunk_for(v, None)
        assert chunk & (chunk - 1) == 0 and -(-v // chunk) <= 65535 and chunk <= 2**20


@pytest.mark.parametrize("case", ["V = 0", "B = 0, V = 0"])
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_empty_rows_are_refused_by_the_reference(case, backend):
    """A row of no logits, which torch.argmax met with a raw IndexError, is refused naming logits, before anything
    is written; so are rows of one or three dims with none."""
    x = BAD[case][0](_logits())
    out = torch.full((x.shape[0],), -1, dtype=torch.int64)
    with ops.use_backend(backend), pytest.raises(InputError, match="^logits=.*at least one logit a row"):
        argmax(x, out=out)
    assert (out == -1).all()
    for empty in (torch.zeros(0), torch.zeros(2, 3, 0)):
        with ops.use_backend(backend), pytest.raises(InputError, match="^logits="):
            argmax(empty)


@pytest.mark.parametrize("backend", ["native", "auto", "triton"])
def test_bool_and_complex_logits_are_refused_under_every_backend(backend):
    """torch.argmax met bool logits with a raw RuntimeError under native and auto, while triton refused them."""
    for x in (_logits() > 0, _logits().to(torch.complex64)):
        out = torch.full((x.shape[0],), -1, dtype=torch.int64)
        with ops.use_backend(backend), pytest.raises(InputError, match=rf"^logits='{x.dtype}"):
            argmax(x, out=out)
        assert (out == -1).all()


def test_the_reference_takes_what_only_the_kernel_refuses():
    """Logits of none, one or three dims, fp64, int64, strided along V: the reference takes their argmax (under
    `auto` the op falls back to it)."""
    x = _logits()
    want = torch.argmax(x, dim=-1)
    ref = argmax.reference
    assert ref(torch.tensor(1.0)) == 0 and ref(x[1]) == want[1]
    assert torch.equal(ref(x[None]), want[None]) and torch.equal(ref(x.double()), want)
    assert torch.equal(ref((1000 * x).long()), torch.argmax((1000 * x).long(), dim=-1))
    wide = torch.cat([x, x], 1)
    assert torch.equal(ref(wide[:, ::2]), torch.argmax(wide[:, ::2], dim=-1))
    with ops.use_backend("auto"):
        assert torch.equal(argmax(x.double()), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("V", [129_280, 151_936, 248_320])
@pytest.mark.parametrize("B", [1, 8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(dtype, B, V):
    x = planted(max(B, 6), V, dtype, seed=B + V, device="cuda")[:B]
    assert torch.equal(run(x), argmax.reference(x))


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_the_op_takes_no_tuning_argument_under_any_backend(backend):
    """`chunk` belongs to `argmax_triton`: through the op it is refused alike, whichever provider would run."""
    with ops.use_backend(backend), pytest.raises(TypeError, match="chunk"):
        argmax(torch.zeros(2, 5), chunk=16)
    with pytest.raises(InputError, match="chunk=1: at most 65535 chunks"):
        argmax_triton(torch.zeros(1, 70000), chunk=1)
