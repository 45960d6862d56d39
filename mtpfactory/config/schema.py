"""Typed schemas of the config tree (DESIGN 5), stored in Hydra's ConfigStore.

Types are checked when the config is composed; rules that span fields are checked when a head is built, by
its head builder's `check` (for the Qwen-style heads, `mtpfactory.heads.qwen_mtp.check_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    """Dimensions of the target model's MTP layer, in the family's Hugging Face `config.json` names."""

    family: str = MISSING  #: head family the preset belongs to (`qwen3_next`)
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    rope_theta: float = MISSING
    partial_rotary_factor: float = 0.25  #: share of head_dim rotated by RoPE (NeoX style)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False  #: no `lm_head.weight`: the LM head is the embedding table
    # Dense FFN (dense heads).
    intermediate_size: Optional[int] = None
    # MoE FFN (MoE heads).
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    shared_expert_intermediate_size: Optional[int] = None
    norm_topk_prob: Optional[bool] = None  #: renormalize the top-k routing weights to sum to 1


@dataclass
class HeadConfig:
    """The head variant and its components, each a registry name (`mtpfactory.register`)."""

    name: str = MISSING  #: the head option, also the name of its head builder
    ffn: str = MISSING
    attention: str = MISSING
    lm_head: str = MISSING
    norm: str = MISSING


@dataclass
class QuantConfig:
    mode: str = "bf16"  #: bf16 = unquantized (runtime.dtype); fp8 = W8A16 per row; nvfp4 = W4A16
    lm_head: str = "auto"  #: auto = follow `mode`; or bf16 (unquantized), fp8, nvfp4


@dataclass
class KVConfig:
    dtype: str = "auto"  #: auto (the head's default: runtime.dtype), bf16, fp8, fp32


@dataclass
class LeversConfig:
    """Levers (DESIGN 6); each is also read from the environment as MTPF_<NAME>."""

    mtp_vocab_size: int = 0  #: draft vocab: 0 = full, else min(n, vocab)
    drafter_prefill: bool = True  #: prefill rows through the batched path (with its scratch)
    experts_nvfp4: bool = False  #: store bf16_moe's experts NVFP4 (W4A16); refused on any other head
    kv_exact: bool = False  #: FP8 KV with per-token scales instead of unit scales (needs kv=fp8)
    gemv_split_work: bool = True  #: split-K GEMV variants for tall, skinny shapes (same results)


@dataclass
class RuntimeConfig:
    device: str = "auto"  #: auto = cuda when available, else cpu; or any torch device string
    backend: str = "auto"  #: auto (fast providers where they serve a call), triton (those only), native (references)
    dtype: str = "bfloat16"  #: compute and unquantized-weight dtype: bfloat16, float16 or float32
    max_seq_len: int = 4096  #: positions >= this are refused
    block_size: int = 16  #: KV block size (tokens)
    max_seqs: int = 8  #: live sequences the drafter holds at once
    main_kv_blocks: int = 0  #: the target's KV pool size in blocks (caps the drafter's pool); 0 = no cap
    prefill_chunk: int = 256  #: rows per batched prefill pass


@dataclass
class WeightsConfig:
    source: str = "synthetic"  #: synthetic (tensors generated from `seed`) or checkpoint (read from `path`)
    seed: int = 0
    path: Optional[str] = None  #: the checkpoint directory (weights=checkpoint)


@dataclass
class DemoConfig:
    """What `python -m mtpfactory` drafts after building the head."""

    sequences: int = 3  #: synthetic sequences prefilled (capped at runtime.max_seqs)
    prompt_len: int = 40  #: rows prefilled per sequence
    k: int = 4  #: draft tokens proposed per sequence


@dataclass
class Config:
    #: chosen with +head=NAME; unchosen, its fields are missing (a node, not None, so that `head.ffn=...` applies
    #: before a sweep's `+head=a,b` has chosen one)
    head: HeadConfig = field(default_factory=HeadConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    levers: LeversConfig = field(default_factory=LeversConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)


def store() -> None:
    ConfigStore.instance().store(name="mtpfactory_schema", node=Config)


store()
