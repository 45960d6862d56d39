"""Bad input gets a clear error, and a refused call changes nothing.

Every refusal is an `mtpfactory.MtpfError` (a `ValueError`) whose message names the field and the value
(`field=value: what is allowed. Fix: ...`). A refused call on a head that holds a sequence leaves the
sequence's state (start, end, blocks), the blocks in use and the K/V pool tensors exactly as they were.
"""

from __future__ import annotations

import pytest
import torch

import mtpfactory
from mtpfactory import ConfigError, InputError, KVPoolExhaustedError, MtpfError, UnknownNameError, WeightsError
from mtpfactory.weights.synthetic import qwen_mtp_weights
from seq_state import assert_unchanged, snapshot

H, VOCAB, MAX_LEN = 64, 512, 64
CPU = ("runtime.dtype=float32", "runtime.device=cpu")
# max_seq_len 64, block 16: per_seq = 5 blocks; main_kv_blocks=5 caps the pool at 5 blocks.
SMALL = ("+head=dense", *CPU, f"runtime.max_seq_len={MAX_LEN}", "runtime.max_seqs=3", "runtime.main_kv_blocks=5")
HELD = 7  # the sequence every head test holds: rows 0..19 (2 blocks)


# --- helpers -----------------------------------------------------------------------------------------
def rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g), torch.randn(n, H, generator=g)


def refused(exc: type[MtpfError], call, *in_message: str) -> MtpfError:
    """Run `call`, expect `exc`, check the message names each of `in_message`; return the error."""
    with pytest.raises(exc) as info:
        call()
    err = info.value
    assert isinstance(err, MtpfError) and isinstance(err, ValueError)
    for text in in_message:
        assert text in str(err), f"{text!r} not in {str(err)!r}"
    return err


def dense_weights(**changes) -> dict[str, torch.Tensor]:
    return qwen_mtp_weights(mtpfactory.compose("+head=dense").model, "dense", 0) | changes


def with_value(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


# --- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_head():
    return mtpfactory.build_head(mtpfactory.compose(*SMALL))


@pytest.fixture
def head(small_head):
    """The module's head holding only sequence HELD, rows 0..19."""
    for seq in list(small_head.cache.seqs):
        small_head.free(seq)
    tokens, hidden = rows(20, 1)
    small_head.prefill(HELD, tokens, hidden, torch.arange(20))
    assert small_head.cache.blocks_in_use == 2 and small_head.cache.spec.num_blocks == 5
    return small_head


def test_errors_are_value_errors():
    for exc in (ConfigError, UnknownNameError, WeightsError, InputError, KVPoolExhaustedError):
        assert issubclass(exc, MtpfError) and issubclass(exc, ValueError)


# --- config: names --------------------------------------------------------------------------------------
def test_unknown_head():
    err = refused(UnknownNameError, lambda: mtpfactory.compose("+head=dens"), "head='dens'",
                  "did you mean 'dense'", "bf16_moe, dense")
    assert err.suggestion == "dense"


@pytest.mark.parametrize("override, good", [("kv=FP8", "fp8"), ("quant=NVFP4", "nvfp4"), ("+head=DENSE", "dense")])
def test_an_option_in_other_capitals_is_suggested(override, good):
    """`kv=FP8` got "choose one of ...": difflib compared it with `fp8` letter by letter, capitals unequal."""
    err = refused(UnknownNameError, lambda: mtpfactory.compose("+head=dense", override), f"did you mean '{good}'")
    assert err.suggestion == good


def test_unknown_head_without_a_close_name_lists_the_heads():
    refused(UnknownNameError, lambda: mtpfactory.compose("+head=xyzzy"), "head='xyzzy'", "bf16_moe", "dense")


def test_no_head_chosen_is_refused_listing_the_heads():
    cfg = mtpfactory.compose(*CPU)
    for call in (mtpfactory.build_head, mtpfactory.kv_reserve_bytes):
        refused(ConfigError, lambda: call(cfg), "head=None: no head chosen; heads: bf16_moe, dense",
                "compose with +head=NAME")


def test_a_long_value_is_cut_in_the_message():
    err = ConfigError("weights.path", "x" * 500, "not a directory", "pass the directory")
    assert str(err) == f"weights.path='{'x' * 76}...: not a directory. Fix: pass the directory" and err.value == "x" * 500


@pytest.mark.parametrize("field, bad, good", [
    ("head.ffn", "swiglo", "swiglu"),
    ("head.attention", "gated_gq", "gated_gqa"),
    ("head.norm", "rms_norm", "rmsnorm"),
    ("head.lm_head", "lmhead", "lm_head"),
])
def test_unknown_component(field, bad, good):
    cfg = mtpfactory.compose("+head=dense", *CPU, f"{field}={bad}")
    refused(UnknownNameError, lambda: mtpfactory.build_head(cfg), f"{field}='{bad}'", f"did you mean '{good}'")


# --- config: values and environment ------------------------------------------------------------------
@pytest.mark.parametrize("head, ffn, fix", [("dense", "moe", "use head.ffn=swiglu, or +head=bf16_moe"),
                                           ("bf16_moe", "swiglu", "use head.ffn=moe, or +head=dense")])
def test_a_builtin_ffn_of_the_other_form_is_refused_naming_head_ffn(head, ffn, fix):
    """Before: the dense head with head.ffn=moe failed with a TypeError on the preset's missing MoE fields, and
    bf16_moe with head.ffn=swiglu blamed the checkpoint for lacking dense FFN weights."""
    cfg = mtpfactory.compose(f"+head={head}", *CPU, f"head.ffn={ffn}")
    refused(ConfigError, lambda: mtpfactory.build_head(cfg), f"head.ffn='{ffn}'", f"head {head} has a", fix)


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_a_device_the_heads_do_not_run_on_is_refused(device):
    cfg = mtpfactory.compose("+head=dense", "runtime.dtype=float32", f"runtime.device={device}")
    refused(ConfigError, lambda: mtpfactory.build_head(cfg), f"runtime.device='{device}'", "CPU or a CUDA GPU")


@pytest.mark.parametrize("overrides, field", [((), "runtime.prefill_chunk=256"),
                                              (("runtime.prefill_chunk=32", "runtime.max_seqs=33"),
                                               "runtime.max_seqs=33")])
def test_backend_triton_refuses_more_rows_a_call_than_its_linear_kernels_take(overrides, field):
    """Under backend=triton a prefill pass of prefill_chunk rows, or a step of max_seqs, is one call of each
    projection, which the Triton linear kernels take up to 32 rows of; without the check the call failed part-way.
    Row by row (drafter_prefill off) the chunk does not matter."""
    cfg = mtpfactory.compose("+head=dense", *CPU, "runtime.backend=triton", *overrides)
    refused(ConfigError, lambda: mtpfactory.build_head(cfg), field, "at most 32 under runtime.backend=triton",
            "runtime.backend=auto")
    from mtpfactory.heads import qwen_mtp
    qwen_mtp.check_config(mtpfactory.compose("+head=dense", *CPU, "runtime.backend=triton",
                                             "levers.drafter_prefill=false"), "dense")


def test_an_nvfp4_projection_whose_k_is_not_a_multiple_of_16_is_named():
    cfg = mtpfactory.compose("+head=dense", *CPU, "quant=nvfp4", "model.hidden_size=72")
    refused(WeightsError, lambda: mtpfactory.build_head(cfg), "mtp.layers.0.self_attn.q_proj.weight.shape[1]=72",
            "quant=fp8 or bf16")


def test_kv_exact_from_the_environment_says_so(monkeypatch):
    monkeypatch.setenv("MTPF_KV_EXACT", "1")
    refused(ConfigError, lambda: mtpfactory.build_head(mtpfactory.compose("+head=dense", *CPU)),
            "levers.kv_exact=True", "unset MTPF_KV_EXACT='1'")


def test_mtp_vocab_size_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("MTPF_MTP_VOCAB_SIZE", "-5")
    refused(ConfigError, lambda: mtpfactory.build_head(mtpfactory.compose("+head=dense", *CPU)),
            "levers.mtp_vocab_size=-5", "unset MTPF_MTP_VOCAB_SIZE='-5' if the command line does not set")


def test_moe_head_on_a_preset_without_moe_fields():
    cfg = mtpfactory.compose("+head=bf16_moe", "model=qwen3_5_dense_tiny", *CPU)
    refused(ConfigError, lambda: mtpfactory.build_head(cfg), "model.num_experts=None", "head bf16_moe",
            "model=qwen3_next_tiny")


def test_missing_moe_fields_are_all_named_in_the_message():
    cfg = mtpfactory.compose("+head=bf16_moe", "model=qwen3_5_dense_tiny", *CPU)
    err = refused(ConfigError, lambda: mtpfactory.build_head(cfg))
    for name in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "norm_topk_prob"):
        assert name in str(err)


def test_dense_head_on_a_preset_without_intermediate_size():
    cfg = mtpfactory.compose("+head=dense", *CPU, "model.intermediate_size=null")
    refused(ConfigError, lambda: mtpfactory.build_head(cfg), "model.intermediate_size=None", "head dense")


@pytest.mark.parametrize("head, override, in_message", [
    ("dense", "model.num_key_value_heads=0", "model.num_key_value_heads=0: must be >= 1"),
    ("dense", "model.hidden_size=0", "model.hidden_size=0: must be >= 1"),
    ("dense", "model.intermediate_size=0", "model.intermediate_size=0: must be >= 1"),
    ("bf16_moe", "model.moe_intermediate_size=-2", "model.moe_intermediate_size=-2: must be >= 1"),
    ("bf16_moe", "model.num_experts_per_tok=9", "model.num_experts_per_tok=9: at most num_experts=8"),
    ("dense", "model.rms_norm_eps=-1", "model.rms_norm_eps=-1.0: a positive finite number"),
    ("dense", "model.rope_theta=inf", "model.rope_theta=inf: a positive finite number"),
])
def test_model_dimensions_that_cannot_build_a_head_are_refused_by_name(head, override, in_message):
    """Zero sizes (a raw ZeroDivisionError, which ended a whole -m sweep), more experts a token than there are
    (which built, then refused every step naming top_k) and a non-positive eps (NaN logits) are refused at
    build, naming the model field."""
    cfg = mtpfactory.compose(f"+head={head}", *CPU, override)
    refused(ConfigError, lambda: mtpfactory.build_head(cfg), in_message)


@pytest.mark.parametrize("override, in_message", [
    ("runtime.dtype=float8", "runtime.dtype='float8'"),
    ("runtime.backend=cuda_graphs", "runtime.backend='cuda_graphs'"),
    ("runtime.device=tpu9", "runtime.device='tpu9'"),
    ("runtime.device=cpu:1", "runtime.device='cpu:1': the CPU takes no device index"),
    ("runtime.prefill_chunk=0", "runtime.prefill_chunk=0"),
    ("runtime.max_seq_len=9000", "runtime.max_seq_len=9000"),
    ("runtime.main_kv_blocks=-1", "runtime.main_kv_blocks=-1: must be >= 0"),
    ("levers.mtp_vocab_size=-1", "levers.mtp_vocab_size=-1: must be >= 0"),
    ("model=qwen3_next_tiny", None),  # a dense head on a preset that has intermediate_size: allowed
])
def test_runtime_values(override, in_message):
    cfg = mtpfactory.compose("+head=dense", *CPU, override)
    if in_message is None:
        mtpfactory.build_head(cfg)
    else:
        refused(ConfigError, lambda: mtpfactory.build_head(cfg), in_message)


def test_a_gpu_index_past_the_machines_gpus_is_refused(monkeypatch):
    """cuda:N past the GPUs there are is refused at build, naming how many (torch's own error came at the first
    allocation: "invalid device ordinal")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = mtpfactory.compose("+head=dense", *CPU, "runtime.device=cuda:2")
    refused(ConfigError, lambda: mtpfactory.build_head(cfg), "runtime.device='cuda:2': a GPU index in [0, 2)",
            "cuda:0 to cuda:1")


@pytest.mark.parametrize("var, bad", [("MTPF_DRAFTER_PREFILL", "maybe"), ("MTPF_DRAFTER_PREFILL", "1.5"),
                                      ("MTPF_DRAFTER_PREFILL", ""),
                                      ("MTPF_MTP_VOCAB_SIZE", "many")])
def test_malformed_environment_value_fails_in_compose(monkeypatch, var, bad):
    monkeypatch.setenv(var, bad)
    refused(ConfigError, lambda: mtpfactory.compose("+head=dense"), f"{var}='{bad}'",
            f"levers.{var.removeprefix('MTPF_').lower()}")


def test_wellformed_environment_value_and_command_line_wins(monkeypatch):
    monkeypatch.setenv("MTPF_DRAFTER_PREFILL", "0")
    assert mtpfactory.compose("+head=dense").levers.drafter_prefill is False
    assert mtpfactory.compose("+head=dense", "levers.drafter_prefill=true").levers.drafter_prefill is True


def test_weights_of_the_wrong_type():
    cfg = mtpfactory.compose("+head=dense", *CPU)
    refused(ConfigError, lambda: mtpfactory.build_head(cfg, [1, 2]), "weights='list'")


# --- weights ------------------------------------------------------------------------------------------
def test_dense_head_on_moe_weights():
    cfg = mtpfactory.compose("+head=dense", *CPU)
    moe = qwen_mtp_weights(mtpfactory.compose("+head=bf16_moe").model, "moe", 0)
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, moe), "head='dense'", "quant=bf16", "dense FFN False",
            "MoE router True", "FP8 experts False", "+head=bf16_moe")


def fp8_moe_weights(form: str) -> dict[str, torch.Tensor]:
    """The tiny MoE weights with their experts stored FP8, as an FP8 release writes them: e4m3 per expert with a
    block-128 `weight_scale_inv` or a per-tensor `weight_scale` beside each, or fused e4m3 experts."""
    model = mtpfactory.compose("+head=bf16_moe").model
    w = qwen_mtp_weights(model, "moe", 0, fused_experts=form == "fused")
    for k in [k for k in w if k.startswith("mtp.layers.0.mlp.experts.")]:
        w[k] = w[k].to(torch.float8_e4m3fn)
        if form != "fused":
            w[k.removesuffix("weight") + form] = torch.ones((1, 1) if form == "weight_scale_inv" else ())
    return w


@pytest.mark.parametrize("form", ["weight_scale_inv", "weight_scale", "fused"])
def test_fp8_experts_are_named_with_the_rule_that_refuses_them(form):
    """A dense head on FP8 MoE weights is refused for its FFN form (not for experts it does not read); a MoE head
    for the FP8 experts, however the release stores them (block-128 tables, a per-tensor scale, fused codes)."""
    w = fp8_moe_weights(form)
    dense = mtpfactory.compose("+head=dense", *CPU)
    refused(WeightsError, lambda: mtpfactory.build_head(dense, w), "head='dense'", "needs a dense FFN",
            "dense FFN False", "MoE router True", "FP8 experts True", "+head=bf16_moe with the BF16 release")
    moe = mtpfactory.compose("+head=bf16_moe", *CPU)
    refused(WeightsError, lambda: mtpfactory.build_head(moe, w), "head='bf16_moe'", "reads BF16 experts",
            "FP8 experts True", "BF16 release")


def test_moe_head_on_dense_weights():
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, dense_weights()), "head='bf16_moe'", "quant=bf16",
            "dense FFN True", "MoE router False", "+head=dense")


@pytest.mark.parametrize("name", ["mtp.layers.0.self_attn.k_proj.weight", "mtp.fc.weight", "mtp.norm.weight",
                                  "lm_head.weight", "model.embed_tokens.weight", "mtp.layers.0.mlp.up_proj.weight"])
def test_missing_tensor_is_named(name):
    cfg = mtpfactory.compose("+head=dense", *CPU)
    w = dense_weights()
    del w[name]
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}=None", "missing")


def test_missing_expert_tensor_is_named():
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    w = qwen_mtp_weights(cfg.model, "moe", 0)
    del w["mtp.layers.0.mlp.experts.5.down_proj.weight"]
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), "mtp.layers.0.mlp.experts.5.down_proj.weight",
            "missing")


@pytest.mark.parametrize("name, shape, expected", [
    ("mtp.layers.0.self_attn.k_proj.weight", (16, 64), (32, 64)),
    ("mtp.fc.weight", (64, 64), (64, 128)),
    ("mtp.layers.0.self_attn.q_norm.weight", (32,), (16,)),
    ("model.embed_tokens.weight", (500, 64), (512, 64)),
])
def test_misshapen_tensor_names_both_shapes(name, shape, expected):
    cfg = mtpfactory.compose("+head=dense", *CPU)
    w = dense_weights(**{name: torch.zeros(shape, dtype=torch.bfloat16)})
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}.shape={shape}", f"expected {expected}")


def test_fused_experts_stored_transposed_are_refused():
    # the tiny preset's H=64 differs from 2I=96, so a [E, H, 2I] table cannot pass for [E, 2I, H]
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    name = "mtp.layers.0.mlp.experts.gate_up_proj"
    w = qwen_mtp_weights(cfg.model, "moe", 0, fused_experts=True)
    w[name] = w[name].transpose(1, 2).contiguous()
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}.shape=(8, 64, 96)", "expected (8, 96, 64)")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight",
                                  "mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
                                  "lm_head.weight"])
def test_non_finite_weight_is_named(name, value):
    cfg = mtpfactory.compose("+head=dense", *CPU)
    w = dense_weights()
    w[name] = with_value(w[name], value)
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}='1 NaN/Inf values'", "finite")


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_non_finite_expert_weight_is_named(fused):
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    w = qwen_mtp_weights(cfg.model, "moe", 0, fused_experts=fused)
    name = "mtp.layers.0.mlp.experts." + ("gate_up_proj" if fused else "3.up_proj.weight")
    w[name] = with_value(w[name], float("nan"))
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}=", "NaN/Inf")


def moe_weights(**changes) -> dict[str, torch.Tensor]:
    return qwen_mtp_weights(mtpfactory.compose("+head=bf16_moe").model, "moe", 0) | changes


def test_every_missing_tensor_is_named_at_once_and_the_fused_experts_are_offered():
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    w = moe_weights()
    gone = ["mtp.layers.0.self_attn.k_norm.weight", "mtp.layers.0.mlp.experts.5.up_proj.weight", "mtp.norm.weight"]
    for name in gone:
        del w[name]
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{gone[0]}=None", "3 missing in all", *gone,
            "fused experts.gate_up_proj")


def test_a_missing_tensor_stands_in_as_zeros_that_take_no_memory():
    """Until `finish` names it, a missing tensor is one zero broadcast to its shape: a checkpoint without its
    fused experts (1 GiB at Qwen3-Next's 512) allocates nothing for them before the refusal."""
    from mtpfactory.weights.source import TensorSource
    src = TensorSource({}, "a test")
    t = src.take("mtp.layers.0.mlp.experts.gate_up_proj", (512, 1024, 2048), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (512, 1024, 2048) and t.dtype == torch.bfloat16 and t.stride() == (0, 0, 0)
    assert t.untyped_storage().nbytes() == 2 and not t[-1, -1, -1]
    refused(WeightsError, src.finish, "mtp.layers.0.mlp.experts.gate_up_proj=None", "missing from a test")


def test_a_registered_head_cannot_keep_the_zeros_of_a_missing_tensor(monkeypatch):
    """build_head refuses after any builder, so a head registered from outside that reads a tensor the weights
    lack is refused like a built-in one, instead of running on the zeros that stand in for it."""
    from mtpfactory import registry
    from mtpfactory.heads import qwen_mtp
    from mtpfactory.heads.spec import HeadBuilder

    def build(ctx):
        head = qwen_mtp._build(ctx, "dense")
        head.extra = ctx.tensor("mtp.my_extra.weight", 4, 4)          # the user's own tensor, absent
        return head

    monkeypatch.setitem(registry._registered["head"], "mine", HeadBuilder(
        ffn_form="dense", check=lambda c: qwen_mtp.check_config(c, "dense"), build=build,
        pool_spec=qwen_mtp.pool_spec))
    cfg = mtpfactory.compose("+head=dense", *CPU)
    cfg.head.name = "mine"
    refused(WeightsError, lambda: mtpfactory.build_head(cfg), "mtp.my_extra.weight=None", "missing from")


@pytest.mark.parametrize("extra", ["mtp.layers.0.self_attn.q_proj.bias", "mtp.layers.0.self_attn.o_proj.bias",
                                   "mtp.layers.0.mlp.shared_expert.down_proj.weight_scale_inv",
                                   "mtp.fc.input_scale"])
def test_a_bias_or_scale_beside_a_plain_weight_is_refused(extra):
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    w = moe_weights(**{extra: torch.ones(1)})
    weight = extra.rsplit(".", 1)[0] + ".weight"
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{extra}=(1,): beside {weight}", "plain weight")


@pytest.mark.parametrize("extra", ["gate_up_proj_bias", "gate_up_proj.bias", "down_proj.weight_scale",
                                   "down_proj_weight_scale_inv"])
def test_a_bias_or_scale_beside_the_fused_experts_is_refused(extra):
    """Fused experts (`experts.gate_up_proj`, no `.weight`) have their modifiers after the name, by a dot or (as
    GPT-OSS-style checkpoints write them) an underscore: refused as beside a plain weight, not left unread."""
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    x = "mtp.layers.0.mlp.experts."
    w = qwen_mtp_weights(cfg.model, "moe", 0, fused_experts=True) | {x + extra: torch.ones(1)}
    fused = x + extra.split(".")[0].removesuffix("_bias").removesuffix("_weight_scale_inv")
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{x + extra}=(1,): beside {fused}", "plain weight")


def test_unread_mtp_tensors_are_named_in_a_warning(caplog):
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    stray = {"mtp.layers.1.fc.weight": torch.zeros(64, 128), "mtp.layers.0.mlp.gate.e_score_correction_bias":
             torch.zeros(8), "model.language_model.mtp.extra.weight": torch.zeros(2)}
    mtpfactory.build_head(cfg, moe_weights(**stray, **{"model.layers.3.mlp.gate.weight": torch.zeros(2)}))
    unread = [r.message for r in caplog.records if "never read" in r.message]
    assert len(unread) == 1 and "3 MTP tensors" in unread[0] and all(n in unread[0] for n in stray), unread
    caplog.clear()
    mtpfactory.build_head(cfg, moe_weights())  # a complete checkpoint reads every MTP tensor: no warning
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_both_expert_layouts_say_which_one_is_loaded(caplog):
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    fused = qwen_mtp_weights(cfg.model, "moe", 1, fused_experts=True)
    both = moe_weights(**{n: t for n, t in fused.items() if ".experts." in n})
    head = mtpfactory.build_head(cfg, both)
    assert torch.equal(head.ffn.experts.w_gate_up, fused["mtp.layers.0.mlp.experts.gate_up_proj"].float())
    assert any("loading the fused ones" in r.message for r in caplog.records)
    assert any("24 MTP tensors were never read" in r.message for r in caplog.records)


def test_weights_without_mtp_tensors_say_the_export_dropped_them():
    cfg = mtpfactory.compose("+head=bf16_moe", *CPU)
    w = {n: t for n, t in moe_weights().items() if not n.startswith("mtp.")}
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), "holds no mtp.* tensors (2 tensors",
            "dropped the MTP layer", "use a checkpoint that keeps it")


@pytest.mark.parametrize("prefix", ["model.mtp.", "model.language_model.mtp."])
def test_mtp_layer_under_another_prefix_loads_the_same(prefix, caplog):
    cfg = mtpfactory.compose("+head=dense", *CPU)
    w = dense_weights()
    moved = {(prefix + n[4:] if n.startswith("mtp.") else n): t for n, t in w.items()}
    tokens, hidden = rows(3)
    with caplog.at_level("WARNING"):
        a, b = (mtpfactory.build_head(cfg, x).step(torch.arange(3), tokens, hidden,
                                                   torch.zeros(3, dtype=torch.long))[0] for x in (w, moved))
    assert torch.equal(a, b)
    assert not [r for r in caplog.records if "never read" in r.message]  # read under their own spelling


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_integer_weight_is_refused(dtype):
    cfg = mtpfactory.compose("+head=dense", *CPU)
    name = "mtp.layers.0.mlp.down_proj.weight"
    w = dense_weights(**{name: torch.ones(64, 96, dtype=dtype)})
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}='{dtype}'", "integers")


def test_complex_weight_is_refused_as_complex():
    """A complex tensor was refused as "stored as integers"."""
    cfg = mtpfactory.compose("+head=dense", *CPU)
    name = "mtp.layers.0.mlp.down_proj.weight"
    w = dense_weights(**{name: torch.ones(64, 96, dtype=torch.complex64)})
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}='torch.complex64': complex numbers")


@pytest.mark.parametrize("head, name", [("dense", "mtp.layers.0.mlp.down_proj.weight"),
                                         ("bf16_moe", "mtp.layers.0.mlp.experts.0.gate_proj.weight")])
@pytest.mark.parametrize("value, what", [
    (lambda t: t.float().numpy(), "'ndarray': not a torch.Tensor"),  # a state dict read with safetensors.numpy
    (lambda t: t.tolist(), "'list': not a torch.Tensor"),
    (lambda t: None, "'NoneType': not a torch.Tensor"),
    (lambda t: torch.empty_like(t, device="meta"), "a meta tensor"),  # a model built without loading its weights
], ids=["numpy", "list", "none", "meta"])
def test_a_value_that_holds_no_tensor_data_is_refused_by_name(head, name, value, what):
    """Such a value ended the build in AttributeError ('numpy.ndarray' object has no attribute 'is_complex') or
    NotImplementedError (a meta tensor has no data), naming no tensor."""
    cfg = mtpfactory.compose(f"+head={head}", *CPU)
    w = qwen_mtp_weights(cfg.model, "dense" if head == "dense" else "moe", 0)
    w[name] = value(w[name])
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}=", what)


def test_nvfp4_modelopt_weight_says_what_it_is():
    cfg = mtpfactory.compose("+head=dense", *CPU)
    name = "mtp.layers.0.self_attn.q_proj.weight"  # [128, 64] as NVFP4: codes [128, 32], scales [128, 4]
    w = dense_weights(**{name: torch.zeros(128, 32, dtype=torch.uint8), name + "_scale": torch.ones(128, 4),
                         name + "_scale_2": torch.tensor(1.0)})
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}='torch.uint8'", "NVFP4 ModelOpt",
            "quant=nvfp4")


def test_a_value_past_the_runtime_dtype_is_refused():
    cfg = mtpfactory.compose("+head=dense", "runtime.dtype=float16", "runtime.device=cpu")
    name = "model.embed_tokens.weight"
    w = dense_weights(**{name: with_value(dense_weights()[name].float(), 1e6)})
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), f"{name}='1 values overflow torch.float16'",
            "finite in the runtime dtype", "runtime.dtype=bfloat16")


def test_a_tied_preset_on_a_checkpoint_with_its_own_lm_head_warns(caplog):
    cfg = mtpfactory.compose("+head=dense", *CPU, "model.tie_word_embeddings=true")
    head = mtpfactory.build_head(cfg, dense_weights())
    assert head.lm_head.proj.weight.data_ptr() == head.embed.data_ptr()
    warned = "lm_head.weight is in the weights passed to build_head, but model.tie_word_embeddings=true"
    assert any(warned in r.message for r in caplog.records)


def test_a_failed_build_logs_no_build_line(caplog):
    caplog.set_level("INFO")
    cfg = mtpfactory.compose("+head=dense", *CPU)
    w = dense_weights(**{"mtp.norm.weight": with_value(dense_weights()["mtp.norm.weight"], float("nan"))})
    refused(WeightsError, lambda: mtpfactory.build_head(cfg, w), "mtp.norm.weight=")
    assert not [r for r in caplog.records if "MTP head" in r.message]
    mtpfactory.build_head(cfg, dense_weights())
    assert [r for r in caplog.records if r.message.startswith("MTP head dense")]


# --- calls on a head that holds a sequence: refused, and nothing changes ----------------------------------
def _step(seq_ids, tokens=None, hidden=None, positions=None):
    t, h = rows(len(seq_ids), 2)
    return lambda head: head.step(torch.tensor(seq_ids), t if tokens is None else tokens,
                                  h if hidden is None else hidden, torch.tensor(positions))


def _prefill(seq, positions, tokens=None, hidden=None):
    t, h = rows(len(positions), 3)
    return lambda head: head.prefill(seq, t if tokens is None else tokens, h if hidden is None else hidden,
                                     torch.tensor(positions))


def _propose(seq_ids, positions, k):
    t, h = rows(len(seq_ids), 4)
    return lambda head: head.propose(torch.tensor(seq_ids), t, h, torch.tensor(positions), k)


def _tokens(*ids):
    return torch.tensor(ids)


REFUSED_CALLS = {
    # token ids outside the vocab
    "token_negative": (_step([HELD], _tokens(-1), positions=[20]), InputError, ["tokens=-1", "vocab_size=512"]),
    "token_is_vocab": (_step([HELD], _tokens(512), positions=[20]), InputError, ["tokens=512", "[0, vocab_size=512)"]),
    "token_in_prefill": (_prefill(HELD, [20, 21, 22], tokens=_tokens(3, 600, 4)), InputError, ["tokens=600"]),
    "token_in_propose": (lambda h: h.propose(torch.tensor([HELD]), _tokens(1 << 20), rows(1)[1],
                                             torch.tensor([20]), 2), InputError, ["tokens=1048576"]),
    # hidden of the wrong width, row count or dtype
    "hidden_width": (_step([HELD], hidden=torch.zeros(1, 32), positions=[20]), InputError,
                     ["hidden.shape=(1, 32)", "expected (1, 64)"]),
    "hidden_rows": (_prefill(HELD, [20, 21, 22], hidden=torch.zeros(2, H)), InputError,
                    ["hidden.shape=(2, 64)", "expected (3, 64)"]),
    "hidden_bf16": (_step([HELD], hidden=torch.zeros(1, H, dtype=torch.bfloat16), positions=[20]), InputError,
                    ["hidden='torch.bfloat16 on cpu'", "torch.float32"]),
    "hidden_fp64_prefill": (_prefill(HELD, [20, 21], hidden=torch.zeros(2, H, dtype=torch.float64)), InputError,
                            ["hidden='torch.float64 on cpu'"]),
    # positions at or past runtime.max_seq_len, negative, with a hole, not consecutive
    "position_at_max_len": (_step([8], positions=[MAX_LEN]), InputError,
                            [f"positions=({MAX_LEN}, {MAX_LEN})", f"runtime.max_seq_len={MAX_LEN}"]),
    "position_past_max_len": (_step([HELD], positions=[1000]), InputError, ["positions=(1000, 1000)"]),
    "prefill_crossing_max_len": (_prefill(8, list(range(60, 68))), InputError,
                                 ["positions=(60, 67)", f"runtime.max_seq_len={MAX_LEN}"]),
    "propose_crossing_max_len": (_propose([HELD], [20], MAX_LEN - 20 + 1), InputError,
                                 [f"k={MAX_LEN - 20 + 1}", f"positions 20 to {MAX_LEN}",
                                  f"k <= {MAX_LEN - 20} here"]),
    "position_negative": (_step([HELD], positions=[-1]), InputError, ["positions=-1", ">= 0"]),
    "hole_after_end": (_step([HELD], positions=[21]), InputError, ["positions=21", "[0, 20)", "no holes"]),
    "prefill_not_consecutive": (_prefill(HELD, [20, 21, 23]), InputError, ["positions=[20, 21, 23]", "consecutive"]),
    # sequence ids
    "same_id_twice_step": (_step([HELD, HELD], positions=[20, 20]), InputError, ["seq_ids=[7, 7]", "once"]),
    "same_id_twice_propose": (_propose([HELD, HELD], [20, 21], 2), InputError, ["seq_ids=[7, 7]", "once"]),
    "too_many_sequences": (_step([8, 9, 10], positions=[0, 0, 0]), InputError,
                           ["seq_ids=[8, 9, 10]", "runtime.max_seqs=3"]),
    "seq_ids_float": (lambda h: h.step(torch.tensor([7.0]), _tokens(1), rows(1)[1], torch.tensor([20])), InputError,
                      ["seq_ids=", "integer"]),
    "batch_mismatch": (_step([HELD], tokens=_tokens(1, 2), positions=[20]), InputError,
                       ["tokens='(2,) int64'", "1 rows"]),
    "truncate_unknown": (lambda h: h.truncate(99, 3), InputError, ["seq_id=99", "unknown", "[7]"]),
    "free_unknown": (lambda h: h.free(99), InputError, ["seq_id=99", "unknown"]),
    "truncate_negative": (lambda h: h.truncate(HELD, -1), InputError, ["length=-1"]),
    "propose_k_zero": (_propose([HELD], [20], 0), InputError, ["k=0"]),
    "prefill_seq_id_float": (lambda h: h.prefill(7.5, *rows(1, 4), torch.tensor([20])), InputError,
                             ["seq_id=7.5", "an integer"]),
    "truncate_seq_id_float": (lambda h: h.truncate(7.0, 3), InputError, ["seq_id=7.0", "an integer"]),
    "truncate_length_float": (lambda h: h.truncate(HELD, 2.5), InputError, ["length=2.5", "an integer"]),
    "free_seq_id_bool": (lambda h: h.free(True), InputError, ["seq_id=True", "an integer"]),
    "free_seq_id_float_tensor": (lambda h: h.free(torch.tensor(7.0)), InputError, ["seq_id=tensor(7.)", "an integer"]),
}


@pytest.mark.parametrize("name", list(REFUSED_CALLS))
def test_refused_call_changes_nothing(head, name):
    call, exc, in_message = REFUSED_CALLS[name]
    snap = snapshot(head)
    refused(exc, lambda: call(head), *in_message)
    assert_unchanged(head, snap)
    # and the head still works: the held sequence takes its next row
    t, h = rows(1, 5)
    head.step(torch.tensor([HELD]), t, h, torch.tensor([20]))
    assert head.cache.state(HELD).end == 21


NON_INTEGER_CALLS = {
    "bool_tokens_step": (_step([HELD], _tokens(True), positions=[20]), "tokens"),
    "bool_tokens_prefill": (_prefill(HELD, [20, 21], tokens=_tokens(True, False)), "tokens"),
    "bool_positions_step": (_step([HELD], positions=[True]), "positions"),
    "complex_tokens_step": (_step([HELD], torch.tensor([3 + 0j]), positions=[20]), "tokens"),
}


@pytest.mark.parametrize("name", list(NON_INTEGER_CALLS))
def test_non_integer_ids_are_refused_and_change_nothing(head, name):
    call, field = NON_INTEGER_CALLS[name]
    snap = snapshot(head)
    try:
        refused(InputError, lambda: call(head), field)
    finally:
        assert_unchanged(head, snap)


def test_kv_pool_exhausted(head):
    t, h = rows(48, 6)
    head.prefill(8, t, h, torch.arange(48))  # 3 blocks: the pool's 5 are all taken
    assert head.cache.blocks_in_use == 5
    snap = snapshot(head)
    calls = [
        _step([9], positions=[0]),  # a new sequence needs a block
        _step([8], positions=[48]),  # 8 grows into a fourth block
        _prefill(HELD, list(range(20, 40))),  # HELD grows into a third block
        _propose([HELD], [20], 13),  # the chain crosses into position 32
        _step([HELD, 9], positions=[20, 0]),  # one write fits, the other does not: neither is made
    ]
    for call in calls:
        err = refused(KVPoolExhaustedError, lambda: call(head), "kv pool=", "0 free", "5 blocks")
        assert isinstance(err, InputError)
        assert_unchanged(head, snap)
    # writes inside the blocks a sequence holds still go through, and a freed block is used again
    _step([HELD, 8], positions=[20, 47])(head)
    head.truncate(8, 32)
    assert head.cache.blocks_in_use == 4
    _step([9], positions=[0])(head)
    assert head.cache.blocks_in_use == 5


# --- the module's conversions -------------------------------------------------------------------------
@pytest.mark.parametrize("convert, field", [
    (lambda h: h.to(torch.bfloat16), "runtime.dtype"),   # a bf16 head's dtype: its FP8 codes would become bf16
    (lambda h: h.half(), "runtime.dtype"),
    (lambda h: h.float(), "runtime.dtype"),
    (lambda h: h.to("meta"), "runtime.device"),
], ids=["to-its-own-dtype", "half", "float", "to-meta"])
def test_a_conversion_that_would_change_the_heads_tensors_is_refused_and_changes_nothing(convert, field):
    """`head.to(torch.bfloat16)` on a bf16 FP8 head cast its FP8 codes to bf16 without their scales, and the next
    call failed naming a weight; a dtype or device change left the KV pool and the input checks behind."""
    head = mtpfactory.build_head(mtpfactory.compose("+head=dense", "quant=fp8", "runtime.device=cpu",
                                                    f"runtime.max_seq_len={MAX_LEN}", "runtime.max_seqs=1"))
    before = {n: (t.dtype, t.device) for n, t in head.state_dict().items()}
    refused(ConfigError, lambda: convert(head), f"{field}=", "is refused. Fix: ")
    assert {n: (t.dtype, t.device) for n, t in head.state_dict().items()} == before
    tokens, hidden = rows(3)
    head.step(torch.arange(1), tokens[:1], hidden[:1].bfloat16(), torch.zeros(1, dtype=torch.long))


def test_a_conversion_that_changes_nothing_passes(small_head):
    assert small_head.to("cpu") is small_head and small_head.to(torch.float32).float() is small_head
