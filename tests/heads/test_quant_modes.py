"""Quant modes of the Qwen-style heads (DESIGN 2.2): each quantized head equals an unquantized head built
on its dequantized weights, through the native and the Triton path; against the unquantized head on the
same synthetic weights its error stays within the format's budget; the rules refuse what the table
does not allow."""

import importlib

import pytest
import torch

import mtpfactory
from mtpfactory.components.ffn import ExpertsNVFP4
from mtpfactory.components.linear import Linear, Projections
from mtpfactory.errors import ConfigError, WeightsError
from mtpfactory.weights.synthetic import qwen_mtp_weights

CPU = ("runtime.device=cpu", "runtime.max_seq_len=256", "runtime.max_seqs=2", "runtime.prefill_chunk=32")
# (head, overrides): every quantized combination the table allows for these heads
QUANTIZED = {
    "dense_fp8": ("dense", ("quant=fp8",)),
    "dense_nvfp4": ("dense", ("quant=nvfp4",)),
    "dense_bf16_lm_fp8": ("dense", ("quant=bf16", "quant.lm_head=fp8")),
    "dense_fp8_lm_bf16": ("dense", ("quant=fp8", "quant.lm_head=bf16")),
    "moe_experts_nvfp4": ("bf16_moe", ("levers.experts_nvfp4=true",)),
    "moe_lm_nvfp4": ("bf16_moe", ("quant.lm_head=nvfp4",)),
}


def build(head, *overrides, weights=None):
    return mtpfactory.build_head(mtpfactory.compose(f"+head={head}", *CPU, *overrides), weights)


def synthetic(head):
    cfg = mtpfactory.compose(f"+head={head}")
    return qwen_mtp_weights(cfg.model, "dense" if head == "dense" else "moe", seed=0)


def dequantized_weights(head, quantized):
    """The synthetic checkpoint with every quantized tensor replaced by what the head computes with."""
    w = dict(synthetic(head))
    for m in quantized.modules():
        if isinstance(m, Projections):   # its parts by their names (a stacked part's own name is theirs joined)
            w.update({name + ".weight": t for name, t in m.dequantize().items()})
        elif isinstance(m, Linear) and m.fmt != "unq" and m.name + ".weight" in w:
            w[m.name + ".weight"] = m.dequantize()
        if isinstance(m, ExpertsNVFP4):
            w = {k: v for k, v in w.items() if ".mlp.experts." not in k}
            w["mtp.layers.0.mlp.experts.gate_up_proj"], w["mtp.layers.0.mlp.experts.down_proj"] = m.dequantize()
    return w


def linears(head) -> dict[str, Linear]:
    """{checkpoint name: the projection that stores it}: a projection stacked from several (`Projections`) is
    named by theirs joined with "+", and stores each."""
    return {name: m for m in head.modules() if isinstance(m, Linear) for name in m.name.split("+")}


def run(head, rows=20, seed=0, hidden_out=False):
    """Prefill one sequence of `rows` rows, then step it twice; returns the logits of both steps (with
    `hidden_out`, the chained hiddens the steps return instead)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, head.vocab_size, (rows + 2,), generator=g)
    hidden = torch.randn(rows + 2, head.hidden_size, generator=g).to(head.dtype)
    head.prefill(0, tokens[:rows], hidden[:rows], torch.arange(rows))
    out = [head.step(torch.tensor([0]), tokens[r:r + 1], hidden[r:r + 1], torch.tensor([r]))[int(hidden_out)]
           for r in (rows, rows + 1)]
    return torch.cat(out).float()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_hidden_sliced_from_a_wider_buffer_runs_under_backend_triton():
    """A column slice of the caller's wider buffer (strides (H + 8, 1)): the first norm's Triton provider takes
    contiguous rows, and the head passes them so; equal, bit for bit, to the contiguous hidden's run. It was
    refused ("op rms_norm has no triton provider")."""
    head = build("dense", "runtime.dtype=float32", "runtime.backend=triton")
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, head.vocab_size, (2,), generator=g)
    wide = torch.randn(2, head.hidden_size + 8, generator=g)
    hidden = wide[:, 4:4 + head.hidden_size]
    got = head.step(torch.arange(2), tokens, hidden, torch.zeros(2, dtype=torch.int64))
    head = build("dense", "runtime.dtype=float32", "runtime.backend=triton")
    want = head.step(torch.arange(2), tokens, hidden.contiguous(), torch.zeros(2, dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("case", list(QUANTIZED))
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_quantized_head_equals_unquantized_head_on_its_dequantized_weights(case, dtype, tol):
    head, overrides = QUANTIZED[case]
    q = build(head, *overrides, f"runtime.dtype={dtype}")
    u = build(head, f"runtime.dtype={dtype}", weights=dequantized_weights(head, q))
    # float32: the same math on the same numbers up to summation order (measured ~1e-6); bf16: the
    # quantized path keeps fp32 accumulators where the unquantized one rounds to bf16 (measured ~5e-3).
    assert rel(run(q), run(u)) < tol


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_quantized_head_chains_the_hidden_after_the_final_norm(case):
    """The hidden a step returns (fed back by `propose`) is the final norm's output, whichever format the LM head
    has: an NVFP4 LM head takes the norm with it in one op (`rms_norm_linear_nvfp4`), and must hand back that
    op's normed x, not its input. Equal to the unquantized head's on the dequantized weights."""
    head, overrides = QUANTIZED[case]
    q = build(head, *overrides, "runtime.dtype=float32")
    u = build(head, "runtime.dtype=float32", weights=dequantized_weights(head, q))
    assert rel(run(q, hidden_out=True), run(u, hidden_out=True)) < 1e-4


def test_nvfp4_experts_keep_the_gate_and_up_global_scales_apart():
    """Gate and up rows are quantized as separate tensors, each with its own fp32 global scale (ModelOpt's
    layout): experts whose up rows are 64 times their gate rows come back, and run, within NVFP4's error. With
    the two globals swapped, up would come back 64 times too small (the synthetic presets' gate and up share one
    scale, so the other tests cannot tell)."""
    w = dict(synthetic("bf16_moe"))
    experts = "mtp.layers.0.mlp.experts."
    for name in [n for n in w if n.startswith(experts) and n.endswith("up_proj.weight")]:
        w[name] = w[name] * 64  # a power of two: exact in bf16
    q = build("bf16_moe", "levers.experts_nvfp4=true", "runtime.dtype=float32", weights=w)
    gu, dn = q.ffn.experts.dequantize()
    e = gu.shape[0]
    want_gu = torch.stack([torch.cat([w[f"{experts}{i}.gate_proj.weight"], w[f"{experts}{i}.up_proj.weight"]])
                           for i in range(e)]).float()
    inter = gu.shape[1] // 2
    assert rel(gu[:, :inter], want_gu[:, :inter]) < 0.15 and rel(gu[:, inter:], want_gu[:, inter:]) < 0.15
    u = build("bf16_moe", "runtime.dtype=float32", weights=w)
    assert rel(run(q), run(u)) < 0.35


def test_kv_exact_attends_over_exactly_its_dequantized_cache(monkeypatch):
    """With levers.kv_exact the FP8 cache means codes times an fp32 scale per token and KV head, K's for K and
    V's for V: a step attends over exactly those values. An fp32-KV head holding them, dequantized, in the same
    blocks (its own write skipped) gives the same logits. (Against the unquantized KV, the synthetic weights'
    K and V scales are too alike for a tolerance to tell one scale from the other.)"""
    fp8 = build("dense", "runtime.dtype=float32", "kv=fp8", "levers.kv_exact=true")
    ref = build("dense", "runtime.dtype=float32", "kv=fp32")
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, fp8.vocab_size, (21,), generator=g)
    hidden = torch.randn(21, fp8.hidden_size, generator=g)
    for h in (fp8, ref):
        h.prefill(0, tokens[:20], hidden[:20], torch.arange(20))
    row = (torch.tensor([0]), tokens[20:], hidden[20:], torch.tensor([20]))
    want = fp8.step(*row)  # writes row 20, then attends over rows 0..20
    c = fp8.cache
    ref.cache.k.copy_(c.k.float() * c.k_scale[..., None])
    ref.cache.v.copy_(c.v.float() * c.v_scale[..., None])
    monkeypatch.setattr(ref.attention, "write_kv", lambda *a: None)
    got = ref.step(*row)
    assert ref.cache.seqs[0].blocks == c.seqs[0].blocks
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5


# The build line (DESIGN 7) of a few heads, every field computed here: fc [H, 2H] and Q [2 * heads * head_dim, H]
# at H 64, 4 heads of 16; the pool 2 seqs x (256 // 16 + 1) blocks; LM head MB of its stored bytes, scales
# included, over the draft vocab: NVFP4 512 x 64 / 2 + 512 x 64 / 16 + 4 = 18436 B, FP8 512 x 64 + 4 x 512 = 34816 B,
# bf16 512 x 64 x 2 = 65536 B, NVFP4 at 100 rows 3604 B.
BUILD_LINES = {
    ("dense", "quant=nvfp4"): "MTP head dense: quant=nvfp4 (weight-only NVFP4: q, o, dense FFN), fc=[64,128], "
    "attn Q=[128,64], ffn=swiglu, 0 experts, vocab=512/512 (LM head nvfp4 0.018 MB), kv=bfloat16, pool=34 blocks",
    ("dense", "quant=fp8", "runtime.dtype=float32"): "MTP head dense: quant=fp8, fc=[64,128], attn Q=[128,64], "
    "ffn=swiglu, 0 experts, vocab=512/512 (LM head fp8 0.033 MB), kv=float32, pool=34 blocks",
    ("bf16_moe", "levers.experts_nvfp4=true", "kv=fp8", "levers.kv_exact=true"): "MTP head bf16_moe: quant=bf16, "
    "experts nvfp4, fc=[64,128], attn Q=[128,64], ffn=moe, 8 experts, vocab=512/512 (LM head unq 0.062 MB), "
    "kv=float8_e4m3fn per-token scales, pool=34 blocks",
    ("bf16_moe", "quant.lm_head=nvfp4", "levers.mtp_vocab_size=100"): "MTP head bf16_moe: quant=bf16, "
    "fc=[64,128], attn Q=[128,64], ffn=moe, 8 experts, vocab=100/512 (LM head nvfp4 0.003 MB), kv=bfloat16, "
    "pool=34 blocks",
    ("dense", "runtime.dtype=float16"): "MTP head dense: quant=bf16 (unquantized float16), fc=[64,128], "
    "attn Q=[128,64], ffn=swiglu, 0 experts, vocab=512/512 (LM head unq 0.062 MB), kv=float16, pool=34 blocks",
}


@pytest.mark.parametrize("overrides", list(BUILD_LINES), ids=[" ".join(o) for o in BUILD_LINES])
def test_build_line_says_what_was_built(overrides):
    assert build(*overrides).summary() == BUILD_LINES[overrides]


@pytest.mark.parametrize("case", ["dense_fp8", "dense_nvfp4", "moe_experts_nvfp4"])
def test_triton_path_equals_native_path(case):
    head, overrides = QUANTIZED[case]
    native = build(head, *overrides, "runtime.dtype=float32", "runtime.backend=native")
    triton = build(head, *overrides, "runtime.dtype=float32", "runtime.backend=triton")
    # float32 through the interpreter: summation order only
    assert rel(run(triton, rows=6), run(native, rows=6)) < 1e-4


def test_triton_bf16_fp8_head_with_x_pass_equals_native_path(monkeypatch):
    """bf16 through the Triton path with every FP8 weight counted as large, so the tiny head's prefill takes
    what the LM heads do at several tokens: the FP8 dot in fp16 after x's row pass. x * 2^e in fp16 is exact
    here and the interpreter's dot sums the same fp32 products in the same order, so the logits equal those
    with the pass off bit for bit; against the native path, bf16 roundings (measured 8.3e-3 either way).
    (The NVFP4 GEMV's x pass is the same op call as in `tests/kernels/test_linear_nvfp4.py`; through a whole
    head in the interpreter it takes minutes.)"""
    linear = importlib.import_module("mtpfactory.kernels.linear")
    head, overrides = QUANTIZED["dense_fp8"]
    native = build(head, *overrides, "runtime.dtype=bfloat16", "runtime.backend=native")
    without = run(build(head, *overrides, "runtime.dtype=bfloat16", "runtime.backend=triton"), rows=6)
    monkeypatch.setattr(linear, "F16_DOT_MIN_ELEMENTS", 0)
    calls = []
    monkeypatch.setattr(linear, "_x_f16_rows_kernel", _Counted(linear._x_f16_rows_kernel, calls))
    with_pass = run(build(head, *overrides, "runtime.dtype=bfloat16", "runtime.backend=triton"), rows=6)
    assert calls, "the prefill never ran x's row pass"
    assert torch.equal(with_pass, without)
    assert rel(with_pass, run(native, rows=6)) < 2e-2


class _Counted:
    """A Triton kernel whose launches (`kernel[grid](...)`) are recorded in `calls`."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("case, budget", [("dense_fp8", 0.08), ("dense_nvfp4", 0.35),
                                          ("moe_experts_nvfp4", 0.35), ("moe_lm_nvfp4", 0.35)])
def test_quantization_error_against_the_unquantized_head(case, budget):
    head, overrides = QUANTIZED[case]
    err = rel(run(build(head, *overrides, "runtime.dtype=float32")), run(build(head, "runtime.dtype=float32")))
    assert 0 < err < budget, err


def test_weight_only_nvfp4_dense_head_keeps_fc_k_v_unquantized():
    head = build("dense", "quant=nvfp4")
    assert "weight-only NVFP4" in head.summary() and "LM head nvfp4" in head.summary()
    fmts = {name.rsplit(".", 1)[-1]: m.fmt for name, m in linears(head).items()}
    assert fmts["fc"] == fmts["k_proj"] == fmts["v_proj"] == "unq"
    assert fmts["q_proj"] == fmts["o_proj"] == fmts["gate_proj"] == fmts["up_proj"] == fmts["down_proj"] == "nvfp4"


# DESIGN 2.2's table, for the heads built so far: how each projection is stored, by checkpoint name.
L = "mtp.layers.0."
ATTN = [L + f"self_attn.{p}_proj" for p in "qkvo"]
MOE = [L + "mlp.gate", L + "mlp.shared_expert_gate",
       *(L + f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down"))]
STORED = {"unq": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}  # runtime.dtype=bfloat16
TABLE = ([("dense", quant, lm, False) for quant in ("bf16", "fp8", "nvfp4") for lm in ("auto", "bf16", "fp8", "nvfp4")]
         + [("bf16_moe", "bf16", lm, nvfp4) for nvfp4 in (False, True) for lm in ("auto", "bf16", "fp8", "nvfp4")])


def table_formats(head, quant, lm_head, experts_nvfp4):
    """{checkpoint name: format} of every projection, and the routed experts' format, as the table says."""
    as_quant = {"bf16": "unq"}.get(quant, quant)
    lm = {"auto": as_quant, "bf16": "unq"}.get(lm_head, lm_head)
    if head == "dense":
        fp8_only = "fp8" if quant == "fp8" else "unq"  # fc, k, v: FP8 under fp8, else unquantized
        f = {"mtp.fc": fp8_only, ATTN[0]: as_quant, ATTN[1]: fp8_only, ATTN[2]: fp8_only, ATTN[3]: as_quant}
        f |= {L + f"mlp.{p}_proj": as_quant for p in ("gate", "up", "down")}
        return f | {"lm_head": lm}, None
    f = dict.fromkeys(["mtp.fc", *ATTN, *MOE], "unq")
    return f | {"lm_head": lm}, "nvfp4" if experts_nvfp4 else "unq"


@pytest.mark.parametrize("head, quant, lm_head, experts_nvfp4", TABLE,
                         ids=[f"{h}-{q}-lm_{lm}{'-experts_nvfp4' if e else ''}" for h, q, lm, e in TABLE])
def test_every_projection_is_stored_as_the_quant_table_says(head, quant, lm_head, experts_nvfp4):
    built = build(head, f"quant={quant}", f"quant.lm_head={lm_head}", f"levers.experts_nvfp4={experts_nvfp4}",
                  "runtime.backend=native", "runtime.dtype=bfloat16")
    projections = linears(built)
    want, experts = table_formats(head, quant, lm_head, experts_nvfp4)
    assert {name: m.fmt for name, m in projections.items()} == want
    for name, m in projections.items():
        assert m.weight.dtype == STORED[m.fmt], name
    if experts is None:
        assert not hasattr(built.ffn, "experts")
    else:
        stored = built.ffn.experts
        assert stored.fmt == experts and isinstance(stored, ExpertsNVFP4) == (experts == "nvfp4")
        assert next(stored.parameters()).dtype == STORED[experts]


@pytest.mark.parametrize("kv, exact", [("fp8", False), ("fp8", True)])
def test_fp8_kv_close_to_unquantized_kv(kv, exact):
    base = run(build("dense", "runtime.dtype=float32"))
    head = build("dense", "runtime.dtype=float32", f"kv={kv}", f"levers.kv_exact={exact}")
    assert head.cache.k.dtype == torch.float8_e4m3fn and (head.cache.k_scale is not None) == exact
    assert 0 < rel(run(head), base) < 0.05


def test_kv_exact_changes_the_cache_and_its_reserve():
    unit = mtpfactory.compose("+head=dense", *CPU, "kv=fp8")
    exact = mtpfactory.compose("+head=dense", *CPU, "kv=fp8", "levers.kv_exact=true")
    blocks = build("dense", "kv=fp8").cache.spec.num_blocks
    # per token and KV head: one fp32 scale for K and one for V
    assert mtpfactory.kv_reserve_bytes(exact) - mtpfactory.kv_reserve_bytes(unit) == blocks * 16 * 2 * 2 * 4
    assert rel(run(build("dense", "runtime.dtype=float32", "kv=fp8", "levers.kv_exact=true")),
               run(build("dense", "runtime.dtype=float32", "kv=fp8"))) > 0


@pytest.mark.parametrize("overrides, field, says", [
    (("+head=bf16_moe", "quant=fp8"), "quant", "levers.experts_nvfp4"),
    (("+head=bf16_moe", "quant=nvfp4"), "quant", "allows quant=bf16"),
    (("+head=bf16_moe", "quant=fp8"), "quant", "FP8 experts are DESIGN's per_expert_moe and native_fp8_moe heads"),
    (("+head=bf16_moe", "quant=nvfp4"), "quant", "NVFP4 ones its nvfp4_moe head"),
    (("+head=dense", "levers.experts_nvfp4=true"), "levers.experts_nvfp4",
     "head dense (quant=bf16) builds dense FFN: yes, experts: none (neither BF16 nor FP8)"),
    (("+head=dense", "quant=fp8", "levers.experts_nvfp4=true"), "levers.experts_nvfp4", "quant=fp8"),
    (("+head=dense", "levers.kv_exact=true"), "levers.kv_exact", "kv=fp8"),
    (("+head=dense", "quant.lm_head=int4"), "quant.lm_head", "auto, bf16, fp8, nvfp4"),
])
def test_combinations_outside_the_table_are_refused(overrides, field, says):
    with pytest.raises(ConfigError) as e:
        mtpfactory.build_head(mtpfactory.compose(*overrides, *CPU))
    assert e.value.field == field and says in str(e.value)


@pytest.mark.parametrize("env, override, names_var", [("1", (), True), (None, ("levers.experts_nvfp4=true",), False),
                                                    ("0", ("levers.experts_nvfp4=true",), False)])
def test_experts_nvfp4_on_a_dense_head_says_where_the_lever_came_from(monkeypatch, env, override, names_var):
    if env is None:
        monkeypatch.delenv("MTPF_EXPERTS_NVFP4", raising=False)
    else:
        monkeypatch.setenv("MTPF_EXPERTS_NVFP4", env)
    with pytest.raises(ConfigError) as e:
        mtpfactory.kv_reserve_bytes(mtpfactory.compose("+head=dense", *override))
    assert "levers.experts_nvfp4=false" in e.value.fix and "+head=bf16_moe quant=bf16" in e.value.fix
    assert ("unset MTPF_EXPERTS_NVFP4='1'" in e.value.fix) == names_var


@pytest.mark.parametrize("case, fused", [("dense_nvfp4", True), ("moe_lm_nvfp4", True), ("dense_fp8", False)])
def test_nvfp4_lm_head_runs_after_the_final_norm_in_one_op(monkeypatch, case, fused):
    """An NVFP4 LM head takes the final norm with it (`rms_norm_linear_nvfp4`, whose Triton provider lets the
    norm make the GEMV's x pass: tests/kernels/test_rms_norm_linear_nvfp4.py) at every step;
    other formats call the norm and then the LM head."""
    import mtpfactory.kernels as K

    calls = []
    real = K.rms_norm_linear_nvfp4
    monkeypatch.setattr(K, "rms_norm_linear_nvfp4", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    head, overrides = QUANTIZED[case]
    run(build(head, *overrides), rows=3)
    assert calls == ([(1, head_hidden(head))] * 2 if fused else [])


def head_hidden(head):
    return mtpfactory.compose(f"+head={head}").model.hidden_size


@pytest.mark.parametrize("quant", [("quant=fp8", "quant.lm_head=bf16"), ("quant=nvfp4",)], ids=["fp8", "nvfp4"])
@pytest.mark.parametrize("split", [True, False])
def test_gemv_split_work_reaches_every_projection(monkeypatch, split, quant):
    """The lever picks the GEMV kernels' split-K variant (tests/kernels/test_linear*.py show both give the
    same results; the tiny shapes here are too small for the planner to split, so this checks the wiring),
    the NVFP4 LM head's fused norm + GEMV included."""
    import mtpfactory.kernels as K

    seen = {}
    for op in ("linear", "linear_fp8", "linear_nvfp4", "rms_norm_linear_nvfp4"):
        real = getattr(K, op)
        monkeypatch.setattr(K, op, lambda *a, _real=real, _op=op, **kw: seen.setdefault(_op, []).append(
            kw["split_work"]) or _real(*a, **kw))
    run(build("dense", *quant, f"levers.gemv_split_work={split}"), rows=2)
    ops = {"quant=fp8": {"linear", "linear_fp8"}, "quant=nvfp4": {"linear", "linear_nvfp4", "rms_norm_linear_nvfp4"}}
    assert set(seen) == ops[quant[0]] and sum(map(len, seen.values())) > 10
    assert {s for calls in seen.values() for s in calls} == {split}


@pytest.mark.parametrize("override, tensor", [("model.moe_intermediate_size=40", "down_proj"),
                                              ("model.hidden_size=72", "gate_proj")])
def test_nvfp4_experts_whose_k_is_not_a_multiple_of_16_are_refused_naming_the_lever(override, tensor):
    """The fix said "keep this tensor unquantized or pad K", which no setting does: the lever is the fix."""
    with pytest.raises(WeightsError) as e:
        build("bf16_moe", "levers.experts_nvfp4=true", override)
    assert e.value.field == f"mtp.layers.0.mlp.experts.0.{tensor}.weight.shape[1]"
    assert "multiple of 16" in str(e.value) and "levers.experts_nvfp4=false" in e.value.fix


def test_expert_quantization_reports_progress(monkeypatch, caplog):
    import mtpfactory.components.ffn as ffn

    monkeypatch.setattr(ffn, "PROGRESS_EVERY", 4)  # the tiny preset has 8 experts; real heads report every 128
    with caplog.at_level("INFO", logger="mtpfactory.components.ffn"):
        build("bf16_moe", "levers.experts_nvfp4=true")
    assert [r.getMessage() for r in caplog.records if "experts quantized" in r.getMessage()] == [
        "  MTP experts quantized: 4/8", "  MTP experts quantized: 8/8"]
