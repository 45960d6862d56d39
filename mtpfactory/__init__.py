"""mtpfactory: build MTP (multi-token-prediction) speculative-decoding draft heads from Hydra configs.

    import mtpfactory
    cfg = mtpfactory.compose("+head=bf16_moe", "runtime.max_seqs=4")
    head = mtpfactory.build_head(cfg)          # synthetic weights, or pass a mapping of checkpoint tensors
    head.prefill(seq_id, tokens, hidden, positions)
    logits, hidden_out = head.step(seq_ids, tokens, hidden, positions)
"""

from __future__ import annotations

import logging

import os
from collections.abc import Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from mtpfactory import ops
from mtpfactory.config import compose, list_heads
from mtpfactory.errors import (ConfigError, InputError, KVPoolExhaustedError, MtpfError, UnknownNameError,
                               WeightsError)
from mtpfactory.heads.base import DraftHead
from mtpfactory.registry import register

__all__ = ["ConfigError", "DraftHead", "InputError", "KVPoolExhaustedError", "MtpfError", "UnknownNameError",
           "WeightsError", "build_head", "compose", "kv_reserve_bytes", "list_heads", "register"]


log = logging.getLogger(__name__)

def _head_builder(cfg: DictConfig):
    from mtpfactory import registry

    if cfg.get("head") is None or OmegaConf.is_missing(cfg.head, "name"):
        raise ConfigError("head", None, f"no head chosen; heads: {', '.join(list_heads())}",
                          "compose with +head=NAME")
    return registry.get("head", cfg.head.name)


def build_head(cfg: DictConfig, weights: Mapping[str, torch.Tensor] | str | os.PathLike | None = None) -> DraftHead:
    """Build the head `cfg` describes. `weights`: None for what `cfg.weights` says (synthetic from
    `weights.seed`, or the checkpoint at `weights.path`), a mapping of checkpoint-named tensors (DESIGN 2.1
    names), or a checkpoint directory."""
    from mtpfactory.build import BuildContext, runtime_device, runtime_dtype, weights_seed
    from mtpfactory.weights.checkpoint import SafetensorsCheckpoint
    from mtpfactory.weights.source import TensorSource
    from mtpfactory.weights.synthetic import qwen_mtp_weights

    builder = _head_builder(cfg)
    builder.check(cfg)
    if weights is None and cfg.weights.source == "checkpoint":
        if not cfg.weights.path:
            raise ConfigError("weights.path", cfg.weights.path, "weights=checkpoint reads the checkpoint directory "
                              "weights.path", "add weights.path=DIR, or pass the directory to build_head")
        weights = cfg.weights.path
    if weights is None and cfg.weights.source == "synthetic" and cfg.weights.path is not None:
        raise ConfigError("weights.path", cfg.weights.path, "read only with weights=checkpoint (these are "
                          "weights=synthetic: the path would go unread)",
                          "add weights=checkpoint, or drop weights.path")
    if weights is None:
        if cfg.weights.source != "synthetic":
            raise ConfigError("weights.source", cfg.weights.source, "allowed: synthetic, checkpoint",
                              "use weights=synthetic, or weights=checkpoint weights.path=DIR")
        weights, origin = qwen_mtp_weights(cfg.model, builder.ffn_form, weights_seed(cfg)), "synthetic weights"
    elif isinstance(weights, (str, os.PathLike)):
        weights = SafetensorsCheckpoint(weights)
        weights.check_model_config(cfg.model)
        origin = f"the checkpoint at {weights.path}"
    elif isinstance(weights, Mapping):
        origin = "the weights passed to build_head"
    else:
        raise ConfigError("weights", type(weights).__name__,
                          "a mapping of checkpoint names to tensors, a checkpoint directory, or None",
                          "pass a dict of tensors or the checkpoint's directory")
    ctx = BuildContext(cfg, TensorSource(weights, origin, mapped=isinstance(weights, SafetensorsCheckpoint)),
                       runtime_dtype(cfg), runtime_device(cfg))
    # Quantizing at build time runs the same ops as the forward: under the configured backend, on the head's GPU.
    with ops.running(cfg.runtime.backend, ctx.device):
        head = builder.build(ctx)
    ctx.weights.finish()                 # after every builder: a missing tensor never stays the zeros it reads as
    log.info(head.summary())             # only for a head that was built whole
    return head


def kv_reserve_bytes(cfg: DictConfig) -> int:
    """Bytes the drafter's KV pool takes for `cfg`, computed without building the head (the same
    pool-sizing function the head uses)."""
    builder = _head_builder(cfg)
    builder.check(cfg)
    return builder.pool_spec(cfg).nbytes
