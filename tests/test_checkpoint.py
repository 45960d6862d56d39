"""A safetensors checkpoint directory loads through the same checked path as a mapping."""

import json
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import mtpfactory
from mtpfactory.errors import ConfigError, WeightsError
from mtpfactory.weights import checkpoint
from mtpfactory.weights.synthetic import qwen_mtp_weights


def _save_sharded(tensors, folder, shards=3):
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, folder / file)
        weight_map |= {n: file for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [True, False])
def test_checkpoint_directory_equals_the_mapping(tmp_path, sharded):
    cfg = mtpfactory.compose("+head=bf16_moe", "runtime.dtype=float32", "runtime.device=cpu")
    tensors = qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True)
    tensors["model.language_model.embed_tokens.weight"] = tensors.pop("model.embed_tokens.weight")
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(4)  # a trunk tensor the head never reads
    if sharded:
        _save_sharded(tensors, tmp_path)
    else:
        save_file({n: t.contiguous() for n, t in tensors.items()}, tmp_path / "model.safetensors")
    from_dir = mtpfactory.build_head(cfg, tmp_path)
    from_cfg = mtpfactory.build_head(mtpfactory.compose("+head=bf16_moe", "runtime.dtype=float32", "runtime.device=cpu",
                                                        "weights=checkpoint", f"weights.path={tmp_path}"))
    from_map = mtpfactory.build_head(cfg, tensors)
    g = torch.Generator().manual_seed(0)
    tok, hid = torch.randint(0, 512, (1,), generator=g), torch.randn(1, 64, generator=g)
    logits = [h.step(torch.tensor([0]), tok, hid, torch.tensor([0]))[0] for h in (from_dir, from_cfg, from_map)]
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[2])


def test_a_directory_without_config_json_builds_and_says_what_goes_unchecked(tmp_path, caplog):
    cfg = mtpfactory.compose("+head=bf16_moe", "runtime.device=cpu")
    save_file({n: t.contiguous() for n, t in qwen_mtp_weights(cfg.model, "moe", seed=3).items()},
              tmp_path / "model.safetensors")
    mtpfactory.build_head(cfg, tmp_path)
    assert any("has no config.json" in r.message and "rope_theta" in r.message for r in caplog.records)


def test_each_tensor_is_read_from_disk_once_through_one_open_handle(tmp_path, monkeypatch):
    cfg = mtpfactory.compose("+head=bf16_moe", "runtime.dtype=float32", "runtime.device=cpu")
    _save_sharded({n: t.contiguous() for n, t in qwen_mtp_weights(cfg.model, "moe", seed=3).items()}, tmp_path, 2)
    reads, opens = Counter(), Counter()

    class CountingOpen:
        def __init__(self, file, **kwargs):
            opens[file.name] += 1
            self.st = safe_open(file, **kwargs)

        def keys(self):
            return self.st.keys()

        def get_tensor(self, name):
            reads[name] += 1
            return self.st.get_tensor(name)

        def get_slice(self, name):   # a header's dtype (`stored_dtype`), not a read
            return self.st.get_slice(name)

    monkeypatch.setattr(checkpoint, "safe_open", CountingOpen)
    mtpfactory.build_head(cfg, tmp_path)
    assert reads and set(reads.values()) == {1}, reads.most_common(3)
    # opening a file parses its whole header: once per shard, not once per tensor
    assert opens == {"model-00001-of-00002.safetensors": 1, "model-00002-of-00002.safetensors": 1}, opens


def test_fp8_experts_are_told_from_the_header_without_reading_them(tmp_path, monkeypatch):
    """A checkpoint's fused FP8 experts (no scale beside them to name them) are found by the dtype in the file's
    header: the MoE head refuses them before reading a byte of them."""
    cfg = mtpfactory.compose("+head=bf16_moe", "runtime.dtype=float32", "runtime.device=cpu")
    tensors = qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True)
    for name in ("mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"):
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    _save_sharded(tensors, tmp_path, 2)
    reads = Counter()
    get_tensor = safe_open.get_tensor

    def counting(handle, name):
        reads[name] += 1
        return get_tensor(handle, name)

    monkeypatch.setattr(safe_open, "get_tensor", counting, raising=False)
    with pytest.raises(WeightsError, match="FP8 experts True.*BF16 release"):
        mtpfactory.build_head(cfg, tmp_path)
    assert not [n for n in reads if ".experts." in n]


def test_a_directory_without_safetensors_is_refused(tmp_path):
    cfg = mtpfactory.compose("+head=dense")
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        mtpfactory.build_head(cfg, tmp_path)
    with pytest.raises(WeightsError, match="not a directory"):
        mtpfactory.build_head(cfg, tmp_path / "missing")


def test_weights_checkpoint_without_a_path_says_to_add_one():
    for path in (None, ""):     # an empty path read the working directory
        cfg = mtpfactory.compose("+head=dense", "weights=checkpoint", *(() if path is None else ("weights.path=''",)))
        with pytest.raises(ConfigError) as e:
            mtpfactory.build_head(cfg)
        assert (e.value.field, e.value.value) == ("weights.path", path) and "add weights.path=DIR" in str(e.value)
    with pytest.raises(WeightsError, match="^weights.path='': not a directory"):
        mtpfactory.build_head(mtpfactory.compose("+head=dense"), "")


def test_a_path_beside_synthetic_weights_is_refused(tmp_path):
    """weights.path without weights=checkpoint built from synthetic weights, silently: the drafts were noise."""
    cfg = mtpfactory.compose("+head=dense", f"weights.path={tmp_path}")
    with pytest.raises(ConfigError, match=r"^weights.path='.*': read only with weights=checkpoint.*add "
                                          r"weights=checkpoint, or drop weights.path"):
        mtpfactory.build_head(cfg)


def test_a_head_built_from_a_file_owns_its_weights(tmp_path):
    """A tensor read in its stored dtype was the file's memory map: new bytes written into the file changed the
    built head's logits, and a file cut short ended the process (SIGBUS). The head copies them."""
    cfg = mtpfactory.compose("+head=dense", "runtime.dtype=float32", "runtime.device=cpu")
    file = tmp_path / "model.safetensors"
    save_file({n: t.float().contiguous() for n, t in qwen_mtp_weights(cfg.model, "dense", seed=3).items()}, file)
    head = mtpfactory.build_head(cfg, tmp_path)
    args = (torch.tensor([5]), torch.randn(1, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0)),
            torch.tensor([0]))
    before = head.step(torch.tensor([0]), *args)[0]
    other = tmp_path / "other.safetensors"
    save_file({n: t.float().contiguous() for n, t in qwen_mtp_weights(cfg.model, "dense", seed=4).items()}, other)
    with open(file, "r+b") as f:            # the same layout, other values, written in place (the same inode)
        f.write(other.read_bytes())
    assert torch.equal(head.step(torch.tensor([1]), *args)[0], before)


def _moe_cfg(*overrides):
    return mtpfactory.compose("+head=bf16_moe", "runtime.dtype=float32", "runtime.device=cpu", *overrides)


def test_a_missing_shard_is_refused_only_when_the_head_reads_from_it(tmp_path, caplog):
    """Downloading only the shards a drafter reads is normal: a missing shard of trunk tensors is a warning;
    one holding a tensor the head reads is refused naming the tensor and the file."""
    cfg = _moe_cfg()
    tensors = qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True)
    trunk = {"model.layers.0.mlp.gate.weight": torch.zeros(4, 4)}
    save_file({n: t.contiguous() for n, t in tensors.items()}, tmp_path / "model-00001-of-00002.safetensors")
    weight_map = dict.fromkeys(tensors, "model-00001-of-00002.safetensors")
    weight_map |= dict.fromkeys(trunk, "model-00002-of-00002.safetensors")        # never downloaded
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    mtpfactory.build_head(cfg, tmp_path)
    assert any("model-00002-of-00002.safetensors (1 tensors)" in r.message for r in caplog.records)

    weight_map["mtp.fc.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError) as e:
        mtpfactory.build_head(cfg, tmp_path)
    assert (e.value.field, e.value.value) == ("mtp.fc.weight", "model-00002-of-00002.safetensors")
    assert "lives in model-00002-of-00002.safetensors, which model.safetensors.index.json names but" in str(e.value)
    assert "Fix: download model-00002-of-00002.safetensors" in str(e.value)


def test_a_stale_index_names_the_tensor_and_its_shard(tmp_path):
    cfg = _moe_cfg()
    tensors = qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True)
    save_file({n: t.contiguous() for n, t in tensors.items() if n != "mtp.fc.weight"}, tmp_path / "a.safetensors")
    weight_map = dict.fromkeys(tensors, "a.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError) as e:
        mtpfactory.build_head(cfg, tmp_path)
    assert (e.value.field, e.value.value) == ("mtp.fc.weight", "a.safetensors") and "stale" in str(e.value)


def test_a_safetensors_file_the_index_does_not_list_is_named_in_a_warning(tmp_path, caplog):
    cfg = _moe_cfg()
    tensors = qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True)
    trunk = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    _save_sharded(trunk, tmp_path, 1)
    save_file({n: t.contiguous() for n, t in tensors.items() if n.startswith("mtp.")}, tmp_path / "mtp.safetensors")
    with pytest.raises(WeightsError, match="holds no mtp.\\* tensors \\(2 tensors") as e:
        mtpfactory.build_head(cfg, tmp_path)
    assert "dropped the MTP layer" in str(e.value)
    assert any("mtp.safetensors not listed in model.safetensors.index.json" in r.message for r in caplog.records)

def test_a_tied_checkpoint_directory_keeps_the_embedding_once(tmp_path):
    cfg = _moe_cfg("model.tie_word_embeddings=true")
    tensors = qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True)
    assert "lm_head.weight" not in tensors
    save_file({n: t.contiguous() for n, t in tensors.items()}, tmp_path / "model.safetensors")
    head = mtpfactory.build_head(cfg, tmp_path)
    assert head.lm_head.proj.weight.data_ptr() == head.embed.data_ptr()
    assert torch.equal(head.embed, tensors["model.embed_tokens.weight"].float())
    untied = _moe_cfg()
    with pytest.raises(WeightsError, match="lm_head.weight=None") as e:
        mtpfactory.build_head(untied, tmp_path)
    assert "set model.tie_word_embeddings=true" in str(e.value)


@pytest.mark.parametrize("vocab", [0, 100])
def test_the_lm_head_shares_the_callers_tensor_unless_the_vocab_is_cut(vocab):
    cfg = _moe_cfg(f"levers.mtp_vocab_size={vocab}")
    tensors = {n: t.float() for n, t in qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True).items()}
    weight = mtpfactory.build_head(cfg, tensors).lm_head.proj.weight
    assert torch.equal(weight, tensors["lm_head.weight"][: vocab or None])
    # a cut vocab is a copy of its rows, so the caller's full table can be freed
    assert (weight.data_ptr() == tensors["lm_head.weight"].data_ptr()) == (vocab == 0)


@pytest.mark.parametrize("config, field", [
    ({"rope_theta": 1e7, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25, "norm_topk_prob": True}, None),
    ({"rope_theta": 1e6}, "rope_theta"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"text_config": {"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.5}}}, "partial_rotary_factor"),
    ({"num_experts_per_tok": 10}, "num_experts_per_tok"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),     # the checkpoint carries lm_head.weight too
    # the multimodal releases write it at the top, beside text_config (it went unchecked there)
    ({"tie_word_embeddings": True, "text_config": {"rope_theta": 1e7}}, "tie_word_embeddings"),
    ({"text_config": None, "tie_word_embeddings": False}, None),
    ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "default"}}, None),
    ({"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [11, 11, 10],
                                          "mrope_interleaved": True}}}, None),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, None),
])
def test_config_json_fields_no_shape_shows_must_match_the_preset(tmp_path, config, field):
    cfg = _moe_cfg()
    save_file({n: t.contiguous() for n, t in qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True).items()},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    if field is None:
        mtpfactory.build_head(cfg, tmp_path)
        return
    with pytest.raises(ConfigError) as e:
        mtpfactory.build_head(cfg, tmp_path)
    assert e.value.field == f"model.{field}" and f"set model.{field}=" in str(e.value)


@pytest.mark.parametrize("config", [{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                                    {"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}},
                                    {"rope_scaling": {"type": "dynamic", "factor": 2.0}}])
def test_a_config_with_rope_scaling_is_refused(tmp_path, config):
    cfg = _moe_cfg()
    save_file({n: t.contiguous() for n, t in qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True).items()},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="config.json rope scaling='(yarn|dynamic)': the heads apply default RoPE"):
        mtpfactory.build_head(cfg, tmp_path)


def _moe_file(folder, name="model.safetensors", **changes):
    cfg = _moe_cfg()
    tensors = qwen_mtp_weights(cfg.model, "moe", seed=3, fused_experts=True) | changes
    save_file({n: t.contiguous() for n, t in tensors.items()}, folder / name)
    return cfg


@pytest.mark.parametrize("case", ["index not json", "index without weight_map", "index weight_map empty",
                                  "index weight_map a null", "index weight_map a number", "config not json",
                                  "config a list", "a config field a string", "a config field of 400 digits",
                                  "config rope_parameters a string", "config rope_scaling a string",
                                  "a corrupt file", "a pickle named .safetensors"])
def test_malformed_files_are_refused_naming_the_file(tmp_path, case):
    """Each is a WeightsError naming the file (a refusal row in a sweep), not a parser's own exception (a
    TypeError, an AttributeError, an OverflowError), nor a false one (an empty weight_map was "no
    *.safetensors files")."""
    cfg = _moe_file(tmp_path, "model-00001-of-00001.safetensors")
    bad = {"index not json": ("model.safetensors.index.json", "{"),
           "index without weight_map": ("model.safetensors.index.json", '{"metadata": {}}'),
           "index weight_map empty": ("model.safetensors.index.json", '{"weight_map": {}}'),
           "index weight_map a null": ("model.safetensors.index.json", '{"weight_map": {"mtp.fc.weight": null}}'),
           "index weight_map a number": ("model.safetensors.index.json", '{"weight_map": {"mtp.fc.weight": 1}}'),
           "a config field of 400 digits": ("config.json", '{"rope_theta": 1' + "0" * 400 + "}"),
           "config rope_parameters a string": ("config.json", '{"rope_parameters": "default"}'),
           "config rope_scaling a string": ("config.json", '{"rope_scaling": "linear"}'),
           "config not json": ("config.json", "rope_theta: 1e7"),
           "config a list": ("config.json", "[]"),
           "a config field a string": ("config.json", '{"rope_theta": "1e7"}'),
           "a corrupt file": ("extra.safetensors", "\xff" * 64),
           "a pickle named .safetensors": ("extra.safetensors", None)}[case]
    if bad[1] is None:
        torch.save({"x": torch.ones(2)}, tmp_path / bad[0])
    else:
        (tmp_path / bad[0]).write_text(bad[1])
    with pytest.raises(WeightsError) as e:
        mtpfactory.build_head(cfg, tmp_path)
    assert bad[0] in str(e.value) and "Fix: " in str(e.value) and "holds no *.safetensors" not in str(e.value)


def test_a_tensor_in_two_files_of_an_unindexed_directory_is_refused_naming_both(tmp_path):
    """Without an index nothing says which copy is the checkpoint's: a stale file must not win silently."""
    cfg = _moe_file(tmp_path, "model-00001-of-00001.safetensors")
    save_file({"mtp.fc.weight": torch.full((64, 128), 0.5)}, tmp_path / "mtp.safetensors")
    with pytest.raises(WeightsError, match=r"^mtp.fc.weight='in model-00001-of-00001.safetensors and "
                                           r"mtp.safetensors': one file a tensor"):
        mtpfactory.build_head(cfg, tmp_path)
