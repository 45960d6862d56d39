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


def test_each_tensor_is_read_from_disk_once(tmp_path, monkeypatch):
    cfg = mtpfactory.compose("+head=bf16_moe", "runtime.dtype=float32", "runtime.device=cpu")
    save_file({n: t.contiguous() for n, t in qwen_mtp_weights(cfg.model, "moe", seed=3).items()},
              tmp_path / "model.safetensors")
    reads = Counter()

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.st = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.st.keys()

        def get_tensor(self, name):
            reads[name] += 1
            return self.st.get_tensor(name)

    monkeypatch.setattr(checkpoint, "safe_open", CountingOpen)
    mtpfactory.build_head(cfg, tmp_path)
    assert reads and set(reads.values()) == {1}, reads.most_common(3)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    cfg = mtpfactory.compose("+head=dense")
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        mtpfactory.build_head(cfg, tmp_path)
    with pytest.raises(WeightsError, match="not a directory"):
        mtpfactory.build_head(cfg, tmp_path / "missing")


def test_weights_checkpoint_without_a_path_says_to_add_one():
    cfg = mtpfactory.compose("+head=dense", "weights=checkpoint")
    with pytest.raises(ConfigError) as e:
        mtpfactory.build_head(cfg)
    assert (e.value.field, e.value.value) == ("weights.path", None) and "add weights.path=DIR" in str(e.value)
