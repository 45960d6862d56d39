"""The Qwen-style MTP head (Qwen3-Next, Qwen3.5), DESIGN 2.1:

    x = fc(cat([norm_e(embed[x_{p+1}]), norm_h(h_p)]))         # embedding first
    r = x; x = r + attn(input_layernorm(x)); r = x
    out = norm(r + ffn(post_attention_layernorm(x)))         # the chained hidden
    logits = lm_head(out)

Two tiers (STYLE): `QwenMTPHead` takes its parts already built; the head builders `dense` and `bf16_moe`
check the config, pick the components by registry name and fill in the dimensions.
"""

from __future__ import annotations

import math
import os

import torch
from omegaconf import DictConfig
from torch import nn

from mtpfactory import kernels as K
from mtpfactory import ops, registry
from mtpfactory.build import BuildContext, allocated, runtime_dtype
from mtpfactory.components.cache import PagedKVCache, PoolSpec, drafter_pool_blocks
from mtpfactory.components.ffn import build_moe, build_swiglu
from mtpfactory.components.linear import Linear
from mtpfactory.components.lm_head import LMHead
from mtpfactory.components.norms import fusable
from mtpfactory.errors import ConfigError, WeightsError
from mtpfactory.heads.base import DraftHead, PrefillScratch
from mtpfactory.heads.spec import HeadBuilder
from mtpfactory.kernels.linear import MAX_M
from mtpfactory.weights.source import MTP_PREFIXES


MTP, LAYER = "mtp.", "mtp.layers.0."
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
# How each projection role is stored, by FFN form (head `dense`, head `bf16_moe`) and quant (DESIGN 2.2); roles
# not listed are unquantized, and a quant not listed for a form is refused. The LM head follows
# `quant.lm_head` (auto: the quant).
FORMATS = {
    "dense": {"bf16": {}, "fp8": dict.fromkeys(("fc", "q", "o", "k", "v", "ffn"), "fp8"),
              "nvfp4": dict.fromkeys(("q", "o", "ffn"), "nvfp4")},
    "moe": {"bf16": {}},
}
SWITCHED_ON = ("1", "true", "yes", "on")  # the environment words that turn a switch lever on
LM_HEAD_FORMATS = {"bf16": "unq", "fp8": "fp8", "nvfp4": "nvfp4"}
FFN_FIELDS = {
    "dense": ("intermediate_size",),
    "moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "norm_topk_prob"),
}


class QwenMTPHead(DraftHead):
    def __init__(self, *, embed: torch.Tensor, norm_embedding: nn.Module, norm_hidden: nn.Module, fc: Linear,
                 input_layernorm: nn.Module, attention: nn.Module, post_attention_layernorm: nn.Module,
                 ffn: nn.Module, norm: nn.Module, lm_head: LMHead, **common) -> None:
        super().__init__(**common)
        self.embed = nn.Parameter(embed, requires_grad=False)  # [vocab, H]
        self.norm_embedding, self.norm_hidden, self.fc = norm_embedding, norm_hidden, fc
        self.input_layernorm, self.attention = input_layernorm, attention
        self.post_attention_layernorm, self.ffn, self.norm, self.lm_head = post_attention_layernorm, ffn, norm, lm_head

    def _fc_in(self, tokens: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        ne, nh = self.norm_embedding, self.norm_hidden
        if fusable(ne) and fusable(nh) and (ne.eps, ne.zero_centred) == (nh.eps, nh.zero_centred):
            # the built-in norms: the gather, both norms and the concatenation in one op
            x = K.embed_norm_cat(tokens, self.embed, ne.weight, hidden, nh.weight, ne.eps, ne.zero_centred, out=out)
        else:
            x = torch.cat([ne(K.embedding(tokens, self.embed)), nh(hidden)], dim=-1, out=out)
        return self.fc(x)  # [N, 2H] -> [N, H]

    def _write_rows(self, tokens, hidden, positions, slots) -> None:
        x = self._fc_in(tokens, hidden, out=self.prefill_scratch.concat[: tokens.shape[0]])
        self.attention.write_kv(self.input_layernorm(x), positions, slots)

    def _forward(self, tokens, hidden, positions, slots, block_tables, context_lens):
        r = self._fc_in(tokens, hidden)
        a = self.attention(self.input_layernorm(r), positions, slots, block_tables, context_lens)
        x, r = self.post_attention_layernorm(a, residual=r)
        return self.lm_head.after_norm(self.norm, self.ffn(x), r)   # (logits, the chained hidden)


def kv_dtype(cfg: DictConfig) -> torch.dtype:
    """The KV cache dtype: `kv=auto` is the runtime dtype for the Qwen-style heads."""
    if cfg.kv.dtype == "auto":
        return runtime_dtype(cfg)
    if cfg.kv.dtype not in KV_DTYPES:
        raise ConfigError("kv", cfg.kv.dtype, f"allowed: auto, {', '.join(KV_DTYPES)}", "choose kv=auto")
    return KV_DTYPES[cfg.kv.dtype]


def pool_spec(cfg: DictConfig) -> PoolSpec:
    r, m = cfg.runtime, cfg.model
    blocks = drafter_pool_blocks(r.max_seq_len, r.block_size, r.max_seqs, r.main_kv_blocks)
    return PoolSpec(blocks, r.block_size, m.num_key_value_heads, m.head_dim, kv_dtype(cfg),
                    token_scales=cfg.levers.kv_exact)


def formats(cfg: DictConfig, form: str) -> dict[str, str]:
    """How each projection role of the head is stored under its quant and levers (DESIGN 2.2)."""
    q = cfg.quant
    f = dict(FORMATS[form][q.mode])
    f["lm_head"] = LM_HEAD_FORMATS[q.mode if q.lm_head == "auto" else q.lm_head]
    if cfg.levers.experts_nvfp4:
        f["experts"] = "nvfp4"
    return f


def check_config(cfg: DictConfig, form: str) -> None:
    """The rules that span fields (DESIGN 2.2, 5, 7) for a Qwen-style head with FFN `form`."""
    m, r, name = cfg.model, cfg.runtime, cfg.head.name
    if m.family != "qwen3_next":
        raise ConfigError("model.family", m.family, f"head {name} builds Qwen-style MTP heads (qwen3_next)",
                          "choose a qwen3_next model preset, e.g. model=qwen3_next_tiny")
    allowed = FORMATS[form]
    if cfg.quant.mode not in allowed:
        rule = f"head {name} allows quant={'|'.join(allowed)}"
        if form == "moe":   # DESIGN 2.2: a MoE head's quant is its form; the other forms are other heads
            rule += (" (the unquantized MoE head: FP8 experts are DESIGN's per_expert_moe and native_fp8_moe heads, "
                     "NVFP4 ones its nvfp4_moe head, none of them built yet)")
        raise ConfigError("quant", cfg.quant.mode, rule,
                          "use quant=bf16; for NVFP4 experts on this head add levers.experts_nvfp4=true"
                          if form == "moe" else f"use quant={'|'.join(allowed)}")
    if cfg.quant.lm_head != "auto" and cfg.quant.lm_head not in LM_HEAD_FORMATS:
        raise ConfigError("quant.lm_head", cfg.quant.lm_head, f"allowed: auto, {', '.join(LM_HEAD_FORMATS)}",
                          "use quant.lm_head=auto to follow quant")
    if cfg.levers.experts_nvfp4 and (form != "moe" or cfg.quant.mode != "bf16"):
        # Decided from the config, before any weight is read: say what the head builds, not what weights hold.
        builds = ("dense FFN: yes, experts: none (neither BF16 nor FP8)" if form == "dense"
                  else f"{form} experts under quant={cfg.quant.mode}")
        raise ConfigError("levers.experts_nvfp4", True, f"stores the BF16 experts of head bf16_moe (quant=bf16) as "
                          f"NVFP4; head {name} (quant={cfg.quant.mode}) builds {builds}",
                          f"drop the lever (levers.experts_nvfp4=false{_from_env('experts_nvfp4', True)}); for MoE "
                          "weights with BF16 experts use +head=bf16_moe quant=bf16")
    if cfg.levers.kv_exact and cfg.kv.dtype != "fp8":
        raise ConfigError("levers.kv_exact", True, f"per-token KV scales need kv=fp8 (this run: kv={cfg.kv.dtype})",
                          f"add kv=fp8, or drop the lever{_from_env('kv_exact', True)}")
    _check_ffn_component(cfg, form)
    for kind in ("attention", "lm_head", "norm"):   # named before any weight is read, or kv_reserve_bytes counts
        registry.get(kind, cfg.head[kind])          # the pool of a head that cannot be built
    lacking = [f for f in FFN_FIELDS[form] if m.get(f) is None]
    if lacking:
        preset = "qwen3_next_tiny" if form == "moe" else "qwen3_5_dense_tiny"
        raise ConfigError(f"model.{lacking[0]}", None,
                          f"head {name} has a {form} FFN and needs model fields {', '.join(lacking)}",
                          f"set them, or choose a preset that has them (model={preset})")
    sizes = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "max_position_embeddings", *(f for f in FFN_FIELDS[form] if f != "norm_topk_prob"))
    for f in sizes:
        if m[f] < 1:
            raise ConfigError(f"model.{f}", m[f], "must be >= 1", "fix the model preset (or the override)")
    if form == "moe" and m.num_experts_per_tok > m.num_experts:
        raise ConfigError("model.num_experts_per_tok", m.num_experts_per_tok, f"at most num_experts="
                          f"{m.num_experts}: each token is routed to that many of them", "fix the model preset")
    for f in ("rms_norm_eps", "rope_theta"):
        if not 0 < m[f] < math.inf:
            raise ConfigError(f"model.{f}", m[f], "a positive finite number", "fix the model preset")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError("model.num_key_value_heads", m.num_key_value_heads,
                          f"must divide num_attention_heads={m.num_attention_heads}", "fix the model preset")
    rd = int(m.head_dim * m.partial_rotary_factor)
    if rd % 2 or not 0 < rd <= m.head_dim:
        raise ConfigError("model.partial_rotary_factor", m.partial_rotary_factor,
                          f"head_dim * factor must be an even count in (0, head_dim={m.head_dim}]", "use 0.25")
    positive = {"runtime.block_size": r.block_size, "runtime.max_seqs": r.max_seqs,
                "runtime.prefill_chunk": r.prefill_chunk, "runtime.max_seq_len": r.max_seq_len}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(key, value, "must be >= 1", "use the default from conf/runtime/default.yaml")
    if r.max_seq_len > m.max_position_embeddings:
        raise ConfigError("runtime.max_seq_len", r.max_seq_len,
                          f"at most model.max_position_embeddings={m.max_position_embeddings}",
                          f"set runtime.max_seq_len<={m.max_position_embeddings}")
    if r.main_kv_blocks < 0:
        raise ConfigError("runtime.main_kv_blocks", r.main_kv_blocks, "must be >= 0", "use 0 (no cap)")
    if cfg.levers.mtp_vocab_size < 0:
        raise ConfigError("levers.mtp_vocab_size", cfg.levers.mtp_vocab_size, "must be >= 0",
                          f"use 0 (the full vocab){_from_env('mtp_vocab_size', cfg.levers.mtp_vocab_size)}")
    kv_dtype(cfg)
    runtime_dtype(cfg)
    ops.check_backend(r.backend)
    if r.backend == "triton":   # one batched step, or one prefill pass, is one call of each projection
        rows = {"runtime.max_seqs": r.max_seqs, **({"runtime.prefill_chunk": r.prefill_chunk}
                                                     if cfg.levers.drafter_prefill else {})}
        for key, value in rows.items():
            if value > MAX_M:
                raise ConfigError(key, value, f"at most {MAX_M} under runtime.backend=triton: a batched step "
                                  "(max_seqs rows) or prefill pass (prefill_chunk rows) is one call of each "
                                  f"projection, and the Triton linear kernels take up to {MAX_M} rows",
                                  f"set {key}={MAX_M}, or use runtime.backend=auto (the reference serves more rows)")


def _from_env(lever: str, value: object) -> str:
    """", or unset MTPF_LEVER='...' if ...": where the lever's variable reads as its `value`, the value may have
    come from it (the command line wins over it, DESIGN 6, and the resolved config no longer tells which set it)."""
    variable = f"MTPF_{lever.upper()}"
    env = os.environ.get(variable)
    if env is None:
        return ""
    reads = env.strip().lower() in SWITCHED_ON if isinstance(value, bool) else env.strip() == str(value)
    return f", or unset {variable}={env!r} if the command line does not set levers.{lever}" if reads else ""


def _check_ffn_component(cfg: DictConfig, form: str) -> None:
    """A built-in FFN component of the other form (head.ffn=moe on the dense head) would read model fields and
    weights the head does not have: refused naming head.ffn. A component of the user's own is trusted."""
    builtin = {build_swiglu: ("dense", "swiglu", "dense"), build_moe: ("moe", "moe", "bf16_moe")}
    chosen = registry.get("ffn", cfg.head.ffn)   # by definition, not identity: a reloaded module's is the same
    its = next((v for fn, v in builtin.items() if registry.same_definition(fn, chosen)), None)
    if its is not None and its[0] != form:
        ours = next(v for v in builtin.values() if v[0] == form)
        raise ConfigError("head.ffn", cfg.head.ffn, f"builds a {its[0]} FFN; head {cfg.head.name} has a {form} "
                          "FFN (its model fields and weights are those of one)",
                          f"use head.ffn={ours[1]}, or +head={its[2]} for a {its[0]} FFN")


def check_ffn_form(ctx: BuildContext, form: str) -> None:
    """A head has exactly one FFN form; refuse weights that carry the other (DESIGN 2.2)."""
    w, name = ctx.weights, ctx.cfg.head.name
    if not w.mtp_names():
        raise WeightsError("weights", w.origin, f"holds no mtp.* tensors ({len(w)} tensors; none under "
                           f"{', '.join(MTP_PREFIXES)}): this export dropped the MTP layer, or its index does not "
                           "list the file that holds it", f"use a checkpoint that keeps it (head {name} builds from "
                           "the MTP layer), or list that file's tensors in the index's weight_map")
    dense = w.has(LAYER + "mlp.gate_proj.weight")
    moe = w.has(LAYER + "mlp.gate.weight")
    fp8 = _fp8_experts(w)
    found = f"the weights carry: dense FFN {dense}, MoE router {moe}, FP8 experts {fp8}"
    if not ((form == "dense" and dense) or (form == "moe" and moe)):
        fix = "check the checkpoint's MTP tensors"
        if dense:
            fix = "use +head=dense"
        elif moe:
            fix = "use +head=bf16_moe" + (" with the BF16 release of the checkpoint (its experts are FP8; DESIGN's "
                                          "FP8-expert head, native_fp8_moe, is not built yet)" if fp8 else "")
        raise WeightsError("head", name, f"head {name} (quant={ctx.cfg.quant.mode}) needs a {form} FFN, but {found}",
                           fix)
    if fp8:
        raise WeightsError("head", name, f"head {name} (quant={ctx.cfg.quant.mode}) reads BF16 experts, but {found}"
                           + (" (levers.experts_nvfp4 needs BF16 experts)" if ctx.cfg.levers.experts_nvfp4 else ""),
                           "use the BF16 release of the checkpoint (DESIGN's FP8-expert head, native_fp8_moe, "
                           "is not built yet)")


def _fp8_experts(w) -> bool:
    """Whether the checkpoint's MTP experts are stored FP8: e4m3/e5m2 codes (per expert or fused) or the scales
    that go with them (a block-128 `weight_scale_inv`, or a per-tensor `weight_scale`)."""
    experts = LAYER + "mlp.experts."
    names = [experts + "0.gate_proj.weight", experts + "gate_up_proj"]
    scales = [experts + "0.gate_proj." + s for s in ("weight_scale_inv", "weight_scale")]
    return any(w.dtype(n) in (torch.float8_e4m3fn, torch.float8_e5m2) for n in names) or any(map(w.has, scales))


def _embedding(ctx: BuildContext, lm_head: LMHead) -> torch.Tensor:
    """The embedding table [vocab, H]. With tied embeddings an unquantized full-vocab LM head holds this very
    table: the head keeps it once (a second read from a checkpoint directory would be a second copy)."""
    m, proj = ctx.model, lm_head.proj
    if m.tie_word_embeddings and proj.fmt == "unq" and proj.out_features == m.vocab_size:
        return proj.weight.data
    return ctx.tensor("model.embed_tokens.weight", m.vocab_size, m.hidden_size)


def _build(ctx: BuildContext, form: str) -> QwenMTPHead:
    cfg, m = ctx.cfg, ctx.model
    check_ffn_form(ctx, form)
    ctx.formats = formats(cfg, form)
    h, nq, hd, eps = m.hidden_size, m.num_attention_heads, m.head_dim, m.rms_norm_eps
    norm = registry.get("norm", cfg.head.norm)
    spec = pool_spec(cfg)
    r = cfg.runtime
    cache = allocated(lambda: PagedKVCache(spec, r.max_seq_len, r.max_seqs, ctx.device), "runtime.max_seqs",
                      r.max_seqs, spec.nbytes, ctx.device, f"the KV pool is {spec.num_blocks} blocks of "
                      f"runtime.block_size={r.block_size} tokens (runtime.max_seqs x runtime.max_seq_len); lower "
                      "runtime.max_seqs or runtime.max_seq_len, or cap it with runtime.main_kv_blocks")
    attention = registry.get("attention", cfg.head.attention)(
        ctx, LAYER + "self_attn.", q_norm=norm(ctx, LAYER + "self_attn.q_norm.weight", hd, eps),
        k_norm=norm(ctx, LAYER + "self_attn.k_norm.weight", hd, eps), cache=cache)
    ffn = registry.get("ffn", cfg.head.ffn)(ctx, LAYER + "mlp.")
    lm_head = registry.get("lm_head", cfg.head.lm_head)(ctx)
    chunk = cfg.runtime.prefill_chunk
    scratch = (PrefillScratch(chunk, allocated(lambda: torch.empty(chunk, 2 * h, dtype=ctx.dtype, device=ctx.device),
                                               "runtime.prefill_chunk", chunk, chunk * 2 * h * ctx.dtype.itemsize,
                                               ctx.device, "lower runtime.prefill_chunk (default 256)"))
               if cfg.levers.drafter_prefill else None)
    experts = getattr(ffn, "num_experts", 0)
    quant = cfg.quant.mode
    if form == "dense" and quant == "nvfp4":
        quant += " (weight-only NVFP4: q, o, dense FFN)"
    elif quant == "bf16" and ctx.dtype != torch.bfloat16:   # bf16 is the mode's name: unquantized, in runtime.dtype
        quant += f" (unquantized {cfg.runtime.dtype})"
    if experts and ctx.fmt("experts") != "unq":
        quant += f", experts {ctx.fmt('experts')}"
    kv = str(spec.dtype).removeprefix("torch.") + (" per-token scales" if spec.token_scales else "")
    summary = (f"MTP head {cfg.head.name}: quant={quant}, fc=[{h},{2 * h}], attn Q=[{nq * hd * 2},{h}], "
               f"ffn={cfg.head.ffn}, {experts} experts, vocab={lm_head.draft_vocab}/{m.vocab_size} "
               f"(LM head {ctx.fmt('lm_head')} {_megabytes(lm_head.nbytes)} MB), kv={kv}, "
               f"pool={spec.num_blocks} blocks")
    head = QwenMTPHead(
        embed=_embedding(ctx, lm_head),
        norm_embedding=norm(ctx, MTP + "pre_fc_norm_embedding.weight", h, eps),
        norm_hidden=norm(ctx, MTP + "pre_fc_norm_hidden.weight", h, eps),
        fc=ctx.linear(MTP + "fc", h, 2 * h, "fc"),
        input_layernorm=norm(ctx, LAYER + "input_layernorm.weight", h, eps), attention=attention,
        post_attention_layernorm=norm(ctx, LAYER + "post_attention_layernorm.weight", h, eps), ffn=ffn,
        norm=norm(ctx, MTP + "norm.weight", h, eps), lm_head=lm_head,
        cache=cache, hidden_size=h, vocab_size=m.vocab_size, dtype=ctx.dtype, device=ctx.device,
        backend=cfg.runtime.backend, prefill_scratch=scratch, summary=summary)
    return head


def _megabytes(nbytes: int) -> str:
    """MB to a tenth, or to three places under one (a tiny preset's LM heads would all read 0.0)."""
    mb = nbytes / 2**20
    return f"{mb:.1f}" if mb >= 1 else f"{mb:.3f}"


dense = HeadBuilder(ffn_form="dense", check=lambda cfg: check_config(cfg, "dense"),
                    build=lambda ctx: _build(ctx, "dense"), pool_spec=pool_spec)
bf16_moe = HeadBuilder(ffn_form="moe", check=lambda cfg: check_config(cfg, "moe"),
                       build=lambda ctx: _build(ctx, "moe"), pool_spec=pool_spec)
