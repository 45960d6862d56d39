"""The config tree: +head selects a head and the groups it implies; the command line wins over the head
and over the environment; levers read MTPF_* variables."""

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import mtpfactory
from mtpfactory.build import runtime_device
from mtpfactory.config import PLANNED_HEADS
from mtpfactory.errors import ConfigError, UnknownNameError
from mtpfactory.weights.synthetic import qwen_mtp_weights


def test_head_implies_its_model_preset_and_quant():
    assert mtpfactory.compose("+head=dense").model.intermediate_size == 128
    moe = mtpfactory.compose("+head=bf16_moe")
    assert (moe.model.num_experts, moe.quant.mode, moe.head.ffn) == (8, "bf16", "moe")


def test_command_line_model_wins_over_the_head():
    cfg = mtpfactory.compose("+head=bf16_moe", "model=qwen3_next_80b")
    assert (cfg.model.hidden_size, cfg.model.num_experts, cfg.model.vocab_size) == (2048, 512, 151936)


def test_levers_read_the_environment_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("MTPF_DRAFTER_PREFILL", "0")
    monkeypatch.setenv("MTPF_MTP_VOCAB_SIZE", "100")
    monkeypatch.setenv("MTPF_EXPERTS_NVFP4", "yes")
    levers = mtpfactory.compose("+head=dense").levers
    got = (levers.mtp_vocab_size, levers.drafter_prefill, levers.experts_nvfp4, levers.kv_exact)
    assert got == (100, False, True, False)
    cfg = mtpfactory.compose("+head=dense", "levers.drafter_prefill=true", "levers.mtp_vocab_size=7")
    assert (cfg.levers.mtp_vocab_size, cfg.levers.drafter_prefill) == (7, True)


def test_malformed_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MTPF_MTP_VOCAB_SIZE", "lots")
    with pytest.raises(ConfigError, match="MTPF_MTP_VOCAB_SIZE"):
        mtpfactory.compose("+head=dense")


@pytest.mark.parametrize("value", ["2", "-1", "ye", "tru", " on "])
def test_a_switch_lever_refuses_values_that_are_not_switch_words(monkeypatch, value):
    monkeypatch.setenv("MTPF_KV_EXACT", value)
    with pytest.raises(ConfigError, match="MTPF_KV_EXACT"):
        mtpfactory.compose("+head=dense")


@pytest.mark.parametrize("override", ["model.tie_word_embeddings=2", "model.norm_topk_prob=-1", "levers.kv_exact=2"])
def test_every_bool_field_refuses_values_that_are_not_switch_words(override):
    """OmegaConf reads any integer as a bool (2 -> true): a typo must not switch a model flag on, as for a lever."""
    with pytest.raises(ConfigError, match=f"{override.partition('=')[0]}='.*': a switch: 1, 0, true"):
        mtpfactory.compose("+head=bf16_moe", override)
    assert mtpfactory.compose("+head=bf16_moe", "model.norm_topk_prob=null").model.norm_topk_prob is None


def test_schema_types_are_checked_at_compose():
    with pytest.raises(Exception, match="max_seqs"):
        mtpfactory.compose("+head=dense", "runtime.max_seqs=many")


@pytest.mark.parametrize("override, field", [
    ("runtime.backend=cuda_graphs", "runtime.backend"), ("runtime.dtype=int8", "runtime.dtype"),
    ("runtime.max_seq_len=100000", "runtime.max_seq_len"), ("runtime.block_size=0", "runtime.block_size"),
])
def test_cross_field_rules_are_checked_when_the_head_is_built(override, field):
    cfg = mtpfactory.compose("+head=dense", override)
    with pytest.raises(ConfigError) as e:
        mtpfactory.build_head(cfg)
    assert e.value.field == field


@pytest.mark.parametrize("override, says", [
    ("runtime.max_seqs=1000000000000", "which cpu cannot allocate"),       # the KV pool: 4.9e8 GiB
    ("runtime.prefill_chunk=100000000000", "which cpu cannot allocate"),   # the prefill's scratch rows
    ("weights.seed=99999999999999999999", "a seed in [0, 2^63)"), ("weights.seed=-1", "a seed in [0, 2^63)"),
])
def test_sizes_the_machine_cannot_hold_and_seeds_torch_cannot_take_are_refused_naming_the_field(override, says):
    """Each was torch's own error (a traceback, and the end of a sweep) before."""
    cfg = mtpfactory.compose("+head=dense", override)
    with pytest.raises(ConfigError) as e:
        mtpfactory.build_head(cfg)
    assert e.value.field == override.partition("=")[0] and says in str(e.value)


@pytest.mark.parametrize("override, group, says", [("kv=int4", "kv", "choose one of auto, bf16, fp32, fp8"),
                                                   ("quant=fp4", "quant", "did you mean 'nvfp4'"),
                                                   ("model=qwen3_next_tin", "model", "did you mean 'qwen3_next_tiny'")])
def test_an_unknown_group_option_is_refused_at_compose_with_the_options(override, group, says):
    with pytest.raises(UnknownNameError) as e:
        mtpfactory.compose("+head=dense", override)
    assert (e.value.field, e.value.value) == (group, override.partition("=")[2]) and says in str(e.value)


@pytest.mark.parametrize("head", PLANNED_HEADS)
def test_a_planned_head_is_refused_as_not_built_yet(head):
    """DESIGN's heads not built yet say so (not "unknown", not a "did you mean" to a built head's name)."""
    with pytest.raises(ConfigError) as e:
        mtpfactory.compose(f"+head={head}")
    assert not isinstance(e.value, UnknownNameError) and (e.value.field, e.value.value) == ("head", head)
    assert "not built yet" in str(e.value) and "choose one of bf16_moe, dense" in str(e.value)


def test_no_built_head_is_listed_as_planned():
    assert not set(PLANNED_HEADS) & set(mtpfactory.list_heads())


def test_compose_inside_a_callers_hydra_app_composes_ours_and_gives_the_callers_back(tmp_path):
    (tmp_path / "config.yaml").write_text("app:\n  name: serving\n")
    with initialize_config_dir(str(tmp_path), version_base="1.3"):
        cfg = mtpfactory.compose("+head=dense", "kv=fp8")
        assert (cfg.head.name, cfg.kv.dtype, cfg.levers.kv_exact) == ("dense", "fp8", False)
        assert hydra_compose(config_name="config") == {"app": {"name": "serving"}}
    assert not GlobalHydra.instance().is_initialized()


def test_the_command_line_wins_over_a_malformed_environment_value(monkeypatch):
    monkeypatch.setenv("MTPF_KV_EXACT", "maybe")
    monkeypatch.setenv("MTPF_MTP_VOCAB_SIZE", "lots")
    cfg = mtpfactory.compose("+head=dense", "kv=fp8", "levers.kv_exact=true", "levers.mtp_vocab_size=7")
    assert (cfg.levers.kv_exact, cfg.levers.mtp_vocab_size) == (True, 7)


def test_an_unreadable_lever_names_the_lever_not_an_unset_variable(monkeypatch):
    monkeypatch.delenv("MTPF_MTP_VOCAB_SIZE", raising=False)
    monkeypatch.delenv("MTPF_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as e:
        mtpfactory.compose("+head=dense", "levers.mtp_vocab_size=${oc.env:MTPF_TEST_UNSET}")
    assert e.value.field == "levers.mtp_vocab_size" and "MTPF_TEST_UNSET' not found" in str(e.value)


def test_mtp_vocab_size_truncates_the_draft_vocab():
    head = mtpfactory.build_head(mtpfactory.compose("+head=dense", "levers.mtp_vocab_size=100"))
    assert head.lm_head.draft_vocab == 100 and "vocab=100/512" in head.summary()
    full = mtpfactory.build_head(mtpfactory.compose("+head=dense", "levers.mtp_vocab_size=100000"))
    assert full.lm_head.draft_vocab == 512


def test_compose_refuses_a_key_the_schema_lacks_set_without_plus():
    """`levers.kv_exct=1` raised Hydra's ConfigCompositionException (not an MtpfError); it is a ConfigError with a
    "did you mean"."""
    with pytest.raises(mtpfactory.ConfigError, match=r"^levers.kv_exct='1': not a config key.*did you mean "
                                                     r"levers.kv_exact\?"):
        mtpfactory.compose("+head=dense", "levers.kv_exct=1")
    # a typo in the section: the key as written, and the key it meant (was "runtim='4' ... did you mean runtime?")
    with pytest.raises(mtpfactory.ConfigError, match=r"^runtim.max_seqs='4': not a config key.*did you mean "
                                                     r"runtime.max_seqs\?"):
        mtpfactory.compose("+head=dense", "runtim.max_seqs=4")


def test_a_section_set_whole_is_checked_key_by_key():
    """`demo={k:5,_target_:os.system}` ended in Hydra's own error (and stopped a `-m` sweep with no table); each of
    its keys is now checked as `demo.KEY=VALUE` would be. A group set to a dict is told to set its fields."""
    with pytest.raises(ConfigError, match=r"^demo._target_='os.system': not a config key.*never by _target_"):
        mtpfactory.compose("+head=dense", "demo={k:5,_target_:os.system}")
    with pytest.raises(ConfigError, match=r"^demo.k='abc': not a value of the field's type, int"):
        mtpfactory.compose("+head=dense", "demo={k:abc}")
    with pytest.raises(ConfigError, match=r"^demo.kk='5': not a config key.*did you mean demo.k\?"):
        mtpfactory.compose("+head=dense", "demo={kk:5}")
    with pytest.raises(ConfigError, match=r"^levers='\{kv_exct:true\}': a config group.*levers.FIELD=VALUE"):
        mtpfactory.compose("+head=dense", "levers={kv_exct:true}")
    assert mtpfactory.compose("+head=dense", "demo={k:2,sequences:1}").demo.k == 2


@pytest.mark.parametrize("value, want", [("TRUE", True), ("Yes", True), ("OFF", False), ("On", True)])
def test_a_switch_lever_reads_its_words_from_the_environment_in_any_case(monkeypatch, value, want):
    """The command line takes `levers.kv_exact=TRUE`; the environment takes the same words the same way."""
    monkeypatch.setenv("MTPF_KV_EXACT", value)
    assert mtpfactory.compose("+head=dense", "kv=fp8").levers.kv_exact is want


def test_compose_refuses_a_key_the_schema_lacks_added_with_plus():
    """Hydra appends `+key=value` as written: compose refuses it, or the typo would run as if absent."""
    with pytest.raises(ConfigError, match=r"^quantt='fp8': not a config key"):
        mtpfactory.compose("+head=dense", "+quantt=fp8")
    with pytest.raises(ConfigError, match=r"^levers.kv_exct=True: not a config key.*did you mean levers.kv_exact\?"):
        mtpfactory.compose("+head=dense", "+levers.kv_exct=true")
    with pytest.raises(ConfigError, match=r"^head._target_='os.system'.*never by _target_"):
        mtpfactory.compose("+head=dense", "+head._target_=os.system")


def test_compose_returns_the_levers_as_the_environment_was_when_it_composed(monkeypatch):
    """compose resolves the config: a variable changed (or a lever's default read) later does not change it."""
    monkeypatch.setenv("MTPF_KV_EXACT", "1")
    monkeypatch.setenv("MTPF_MTP_VOCAB_SIZE", "100")
    cfg = mtpfactory.compose("+head=dense", "kv=fp8")
    monkeypatch.setenv("MTPF_KV_EXACT", "0")
    monkeypatch.delenv("MTPF_MTP_VOCAB_SIZE")
    assert (cfg.levers.kv_exact, cfg.levers.mtp_vocab_size) == (True, 100)
    assert "oc.env" not in OmegaConf.to_yaml(cfg)


def test_runtime_device_auto_is_cuda_where_a_gpu_is_available(monkeypatch):
    """... as the device a tensor there reports: the current GPU by index (a caller's hidden on another GPU is
    refused by that comparison, not read by the kernels), the CPU without one (`cpu:0` tensors report `cpu`)."""
    cfg = mtpfactory.compose("+head=dense")
    assert runtime_device(cfg) == torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu").device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert runtime_device(cfg) == torch.device("cuda", 1)
    assert runtime_device(mtpfactory.compose("+head=dense", "runtime.device=cuda")) == torch.device("cuda", 1)
    assert runtime_device(mtpfactory.compose("+head=dense", "runtime.device=cuda:0")) == torch.device("cuda", 0)
    for spelled in ("cpu", "cpu:0"):
        assert runtime_device(mtpfactory.compose("+head=dense", f"runtime.device={spelled}")) == torch.device("cpu")


def test_weights_seed_picks_the_synthetic_weights():
    model = mtpfactory.compose("+head=dense").model
    a, b, again = (qwen_mtp_weights(model, "dense", seed) for seed in (0, 1, 0))
    assert all(torch.equal(a[n], again[n]) for n in a)
    assert not any(torch.equal(a[n], b[n]) for n in a if n.endswith("proj.weight"))


def test_synthetic_weights_size_the_shared_expert_by_its_own_width():
    """The seeds sized the shared expert with the experts' width (DESIGN 2): a preset whose widths differ built
    misshapen synthetic tensors, refused by the head."""
    cfg = mtpfactory.compose("+head=bf16_moe", "runtime.dtype=float32", "runtime.device=cpu",
                             "model.shared_expert_intermediate_size=80")
    w = qwen_mtp_weights(cfg.model, "moe", 0)
    assert w["mtp.layers.0.mlp.shared_expert.gate_proj.weight"].shape == (80, 64)
    assert w["mtp.layers.0.mlp.experts.0.gate_proj.weight"].shape == (48, 64)
    mtpfactory.build_head(cfg)
