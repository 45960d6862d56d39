"""The Qwen-style MTP heads (`bf16_moe`, `dense`) against an outside oracle built from transformers' own
Qwen3-Next modules (DESIGN 2.1):

    e = norm_e(embed[tok]); h = norm_h(hid); x = fc(cat([e, h]))
    y = Qwen3NextDecoderLayer(x, rope, causal mask); out = mtp.norm(y); logits = lm_head(out)

The oracle is loaded with the very tensors the head is built from (`qwen_mtp_weights`), every checkpoint
name accounted for and the decoder layer loaded with `strict=True`, so a tensor the head silently skipped
or misread shows up as a mismatch. Row p of a sequence carries (token_p, hidden_p) at position p (DESIGN 5).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mtpfactory
from mtpfactory.weights.synthetic import qwen_mtp_weights

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig  # noqa: E402

MTP, LAYER = "mtp.", "mtp.layers.0."
SEED = 1234

# float32 head vs float32 oracle: the same maths in a different op order (paged attention over blocks,
# MoE accumulated expert by expert, fused residual norms) -- only rounding differs, measured <= 4.9e-7;
# 1e-4 leaves a wide margin yet catches any wrong tensor, rotation, mask or routing (errors >= 1e-2).
F32_TOL = 1e-4
# bfloat16 head vs float32 oracle: bf16 carries 8 mantissa bits (~4e-3 relative per rounding) and every
# layer rounds its output; the measured logit error is 5.8e-3 (see test_bf16_moe_against_fp32_oracle), so
# 2e-2 admits bf16 rounding while still catching a broken bf16 path (which lands at O(1)).
BF16_TOL = 2e-2

# name -> (head option, fused expert tensors in the checkpoint)
HEADS = {"moe_per_expert": ("bf16_moe", False), "moe_fused": ("bf16_moe", True), "dense": ("dense", False)}
# the prefill path: batched with one chunk, batched in chunks of 16 rows, row by row through decode
PREFILL = {"batched": ["levers.drafter_prefill=true"],
           "batched_chunk16": ["levers.drafter_prefill=true", "runtime.prefill_chunk=16"],
           "row_by_row": ["levers.drafter_prefill=false"]}
LENGTHS = {3: 37, 7: 50}  # seq id -> prefill rows; both span more than two KV blocks of 16
SCHEDULE = [(3,), (7,), (3, 7), (7, 3), (3,)]  # step calls, interleaved, two of them with B=2


# --- helpers -----------------------------------------------------------------------------------------
def compose(head: str, dtype: str = "float32", *extra: str):
    """The head's config on CPU in `dtype`; a short max_seq_len keeps the KV pool small."""
    return mtpfactory.compose(f"+head={head}", f"runtime.dtype={dtype}", "runtime.device=cpu",
                              "runtime.max_seq_len=256", *extra)


def checkpoint(cfg, fused: bool) -> dict[str, torch.Tensor]:
    """The synthetic checkpoint (BF16, checkpoint names) the head of `cfg` is built from."""
    form = "dense" if cfg.head.name == "dense" else "moe"
    return qwen_mtp_weights(cfg.model, form, SEED, fused_experts=fused)


def to_f32(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in weights.items()}


def hf_config(m, dense: bool) -> Qwen3NextConfig:
    """A one-layer full-attention Qwen3NextConfig with the model preset's dimensions (float32; eager attention
    and eager experts, i.e. transformers' plain reference loops).
    RoPE goes in through `rope_parameters` in transformers 5; `mlp_only_layers=[0]` makes the dense layer."""
    moe = {} if dense else dict(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                                moe_intermediate_size=m.moe_intermediate_size,
                                shared_expert_intermediate_size=m.shared_expert_intermediate_size,
                                norm_topk_prob=m.norm_topk_prob)
    return Qwen3NextConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=1, layer_types=["full_attention"],
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
        head_dim=m.head_dim, intermediate_size=m.intermediate_size or 1, rms_norm_eps=m.rms_norm_eps,
        max_position_embeddings=m.max_position_embeddings, tie_word_embeddings=m.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta),
                         "partial_rotary_factor": float(m.partial_rotary_factor)},
        mlp_only_layers=[0] if dense else [], attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32, **moe)


def layer_state_dict(weights: dict[str, torch.Tensor], num_experts: int | None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under `mtp.layers.0.` renamed onto Qwen3NextDecoderLayer's state dict; per-expert
    tensors are fused into experts.gate_up_proj [E, 2I, H] (gate rows first) and experts.down_proj [E, H, I]."""
    sd = {k[len(LAYER):]: v for k, v in weights.items() if k.startswith(LAYER) and ".experts." not in k}
    ex = LAYER + "mlp.experts."
    if ex + "gate_up_proj" in weights:
        sd["mlp.experts.gate_up_proj"] = weights[ex + "gate_up_proj"]
        sd["mlp.experts.down_proj"] = weights[ex + "down_proj"]
    elif num_experts:
        sd["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([weights[f"{ex}{e}.gate_proj.weight"], weights[f"{ex}{e}.up_proj.weight"]])
            for e in range(num_experts)])
        sd["mlp.experts.down_proj"] = torch.stack([weights[f"{ex}{e}.down_proj.weight"] for e in range(num_experts)])
    return sd


def rms_norm(config: Qwen3NextConfig, weight: torch.Tensor) -> nn.Module:
    """transformers' zero-centred Qwen3NextRMSNorm loaded with `weight`."""
    norm = hf.Qwen3NextRMSNorm(weight.numel(), eps=config.rms_norm_eps)
    norm.load_state_dict({"weight": weight}, strict=True)
    return norm


def linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear loaded with `weight` [out, in]."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.load_state_dict({"weight": weight}, strict=True)
    return lin


class Oracle:
    """The MTP head written with transformers' modules, float32, full-sequence (no cache): rows 0..T-1 of a
    sequence in, the logits and the chained hidden `out` of every row back."""

    def __init__(self, model_cfg, weights: dict[str, torch.Tensor]) -> None:
        w = to_f32(weights)
        dense = LAYER + "mlp.gate_proj.weight" in w
        self.config = c = hf_config(model_cfg, dense)
        self.embed = w["model.embed_tokens.weight"]
        self.norm_e = rms_norm(c, w[MTP + "pre_fc_norm_embedding.weight"])
        self.norm_h = rms_norm(c, w[MTP + "pre_fc_norm_hidden.weight"])
        self.fc = linear(w[MTP + "fc.weight"])
        self.layer = hf.Qwen3NextDecoderLayer(c, layer_idx=0).eval()
        self.layer.load_state_dict(layer_state_dict(w, None if dense else model_cfg.num_experts), strict=True)
        assert isinstance(self.layer.mlp, hf.Qwen3NextMLP if dense else hf.Qwen3NextSparseMoeBlock)
        self.rotary = hf.Qwen3NextRotaryEmbedding(c)
        self.norm = rms_norm(c, w[MTP + "norm.weight"])
        lm = "model.embed_tokens.weight" if model_cfg.tie_word_embeddings else "lm_head.weight"
        self.lm_head = linear(w[lm])
        # every tensor of the checkpoint went into the oracle: nothing the head reads is left untested
        used = {"model.embed_tokens.weight", lm, *(MTP + n for n in ("pre_fc_norm_embedding.weight",
                "pre_fc_norm_hidden.weight", "fc.weight", "norm.weight"))} | {k for k in w if k.startswith(LAYER)}
        assert used == set(w), sorted(set(w) ^ used)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T], hidden [T, H] (rows 0..T-1 at positions 0..T-1) -> (logits [T, V], out [T, H])."""
        t = tokens.shape[0]
        e = self.norm_e(self.embed[tokens])
        x = self.fc(torch.cat([e, self.norm_h(hidden.float())], dim=-1))[None]  # [1, T, H]
        position_ids = torch.arange(t)[None]
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]  # additive [1, 1, T, T]
        y = self.layer(x, position_embeddings=self.rotary(x, position_ids), attention_mask=causal,
                       position_ids=position_ids)
        out = self.norm(y)[0]
        return self.lm_head(out), out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def sequences(model_cfg, extra_rows: int, dtype: torch.dtype = torch.float32):
    """Per sequence id: tokens [T + extra_rows] random in the vocab and hidden [T + extra_rows, H] ~ N(0, 1)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return {i: (torch.randint(0, model_cfg.vocab_size, (n + extra_rows,), generator=g),
                torch.randn(n + extra_rows, model_cfg.hidden_size, generator=g).to(dtype))
            for i, n in LENGTHS.items()}


def prefill_all(head, seqs) -> dict[int, int]:
    """Prefill rows 0..T-1 of every sequence; returns each sequence's next position."""
    for i, (tok, hid) in seqs.items():
        n = LENGTHS[i]
        head.prefill(i, tok[:n], hid[:n], torch.arange(n))
    return dict(LENGTHS)


def run_schedule(head, oracle, seqs) -> tuple[float, float]:
    """Step the sequences per SCHEDULE; after each step compare each stepped row with the oracle's last
    row over that sequence's whole history. Returns the worst (logits, hidden_out) relative errors."""
    pos = prefill_all(head, seqs)
    worst_l = worst_h = 0.0
    for ids in SCHEDULE:
        p = torch.tensor([pos[i] for i in ids])
        tok = torch.stack([seqs[i][0][pos[i]] for i in ids])
        hid = torch.stack([seqs[i][1][pos[i]] for i in ids])
        logits, hidden_out = head.step(torch.tensor(ids), tok, hid, p)
        assert logits.shape == (len(ids), oracle.config.vocab_size)
        for r, i in enumerate(ids):
            pos[i] += 1
            ref_logits, ref_out = oracle(seqs[i][0][: pos[i]], seqs[i][1][: pos[i]])
            el, eh = rel_err(logits[r], ref_logits[-1]), rel_err(hidden_out[r], ref_out[-1])
            worst_l, worst_h = max(worst_l, el), max(worst_h, eh)
    return worst_l, worst_h


# --- 1, 2: prefill, then interleaved single and batched steps, against the oracle ---------------------------
@pytest.mark.parametrize("prefill", list(PREFILL))
@pytest.mark.parametrize("variant", list(HEADS))
def test_steps_match_oracle(variant, prefill):
    name, fused = HEADS[variant]
    cfg = compose(name, "float32", *PREFILL[prefill])
    weights = to_f32(checkpoint(cfg, fused))
    head = mtpfactory.build_head(cfg, weights)
    assert (head.prefill_scratch is None) == (prefill == "row_by_row")  # the lever took effect
    oracle = Oracle(cfg.model, weights)
    seqs = sequences(cfg.model, extra_rows=len(SCHEDULE))
    el, eh = run_schedule(head, oracle, seqs)
    print(f"\n[oracle fp32] {variant}/{prefill}: logits rel err {el:.2e}, hidden_out rel err {eh:.2e}")
    assert el < F32_TOL, f"logits rel err {el:.3e}"
    assert eh < F32_TOL, f"hidden_out rel err {eh:.3e}"
    # the two sequences' blocks are disjoint and cover their written ranges
    blocks = {i: head.cache.seqs[i].blocks for i in LENGTHS}
    assert not set(blocks[3]) & set(blocks[7])
    for i, n in LENGTHS.items():
        rows = n + sum(i in ids for ids in SCHEDULE)
        assert head.cache.seqs[i].end == rows and len(blocks[i]) == -(-rows // cfg.runtime.block_size)


# --- 3: propose(k) is k chained steps ----------------------------------------------------------------
@pytest.mark.parametrize("variant", ["moe_per_expert", "dense"])
def test_propose_equals_chained_steps(variant):
    name, fused = HEADS[variant]
    cfg = compose(name, "float32")
    weights = to_f32(checkpoint(cfg, fused))
    proposer, stepper = mtpfactory.build_head(cfg, weights), mtpfactory.build_head(cfg, weights)
    seqs = sequences(cfg.model, extra_rows=1)
    pos = prefill_all(proposer, seqs)
    prefill_all(stepper, seqs)
    ids = torch.tensor(list(LENGTHS))
    tok = torch.stack([seqs[i][0][pos[i]] for i in LENGTHS])
    hid = torch.stack([seqs[i][1][pos[i]] for i in LENGTHS])
    p = torch.tensor([pos[i] for i in LENGTHS])
    k = 4

    drafts = proposer.propose(ids, tok, hid, p, k=k)

    chained = []
    for _ in range(k):
        logits, hid = stepper.step(ids, tok, hid, p)
        tok = torch.argmax(logits, dim=-1)
        chained.append(tok)
        p = p + 1
    assert drafts.dtype == torch.int64 and drafts.shape == (len(ids), k)
    assert torch.equal(drafts, torch.stack(chained, dim=1))
    # same state, same blocks, and bit-identical K/V over every block in use
    for i in LENGTHS:
        sa, sb = proposer.cache.seqs[i], stepper.cache.seqs[i]
        assert (sa.start, sa.end, sa.blocks) == (sb.start, sb.end, sb.blocks) == (sa.start, LENGTHS[i] + k, sa.blocks)
    used = torch.tensor(sorted(b for i in LENGTHS for b in proposer.cache.seqs[i].blocks))
    assert torch.equal(proposer.cache.k[used], stepper.cache.k[used])
    assert torch.equal(proposer.cache.v[used], stepper.cache.v[used])


# --- 4: the bfloat16 MoE head against the float32 oracle ---------------------------------------------------
def test_bf16_moe_against_fp32_oracle():
    cfg = compose("bf16_moe", "bfloat16")
    weights = checkpoint(cfg, fused=False)  # BF16 as generated; the head stores them as they are
    head = mtpfactory.build_head(cfg, weights)
    assert head.dtype == torch.bfloat16 and head.cache.k.dtype == torch.bfloat16  # kv=auto follows runtime
    oracle = Oracle(cfg.model, weights)  # the same BF16 values, computed in float32
    # bf16 inputs for the head; the oracle sees exactly the same values in float32
    seqs = sequences(cfg.model, extra_rows=len(SCHEDULE), dtype=torch.bfloat16)
    el, eh = run_schedule(head, oracle, seqs)
    # measured (torch 2.13 CPU, transformers 5.24, seed 1234): logits 5.8e-3, hidden_out 5.2e-3
    print(f"\n[oracle bf16 head vs fp32] logits rel err {el:.2e}, hidden_out rel err {eh:.2e}")
    assert el < BF16_TOL, f"logits rel err {el:.3e}"
    assert eh < BF16_TOL, f"hidden_out rel err {eh:.3e}"


# --- 5: what the presets leave at one value: tied embeddings, top-k weights not renormalized ---------------
@pytest.mark.parametrize("variant, override", [("dense", "model.tie_word_embeddings=true"),
                                               ("moe_fused", "model.tie_word_embeddings=true"),
                                               ("moe_per_expert", "model.norm_topk_prob=false")])
def test_model_variants_match_oracle(variant, override):
    name, fused = HEADS[variant]
    cfg = compose(name, "float32", override)
    weights = to_f32(checkpoint(cfg, fused))
    assert ("lm_head.weight" in weights) != cfg.model.tie_word_embeddings
    head = mtpfactory.build_head(cfg, weights)
    el, eh = run_schedule(head, Oracle(cfg.model, weights), sequences(cfg.model, extra_rows=len(SCHEDULE)))
    print(f"\n[oracle fp32] {variant}/{override}: logits rel err {el:.2e}, hidden_out rel err {eh:.2e}")
    assert el < F32_TOL, f"logits rel err {el:.3e}"
    assert eh < F32_TOL, f"hidden_out rel err {eh:.3e}"


# --- 6: tied embeddings: the draft LM head is the embedding, whatever else the checkpoint carries -----------
@pytest.mark.parametrize("case", ["lm_head_too", "cut_vocab"])
def test_tied_head_drafts_from_the_embedding(case):
    """With model.tie_word_embeddings the LM head is the embedding even where the checkpoint also carries an
    lm_head.weight (a warning names it), and a draft vocab cut by levers.mtp_vocab_size cuts the LM head only:
    every token still embeds from the full table. Logits are the oracle's (over the first 100 ids when cut)."""
    extra = ("levers.mtp_vocab_size=100",) if case == "cut_vocab" else ()
    cfg = compose("dense", "float32", "model.tie_word_embeddings=true", *extra)
    weights = to_f32(checkpoint(cfg, False))
    given = dict(weights)
    if case == "lm_head_too":
        given["lm_head.weight"] = torch.randn(cfg.model.vocab_size, cfg.model.hidden_size,
                                              generator=torch.Generator().manual_seed(SEED + 2))
    head = mtpfactory.build_head(cfg, given)
    oracle = Oracle(cfg.model, weights)
    v = head.lm_head.draft_vocab
    assert v == (100 if case == "cut_vocab" else cfg.model.vocab_size)
    (tok, hid), n = sequences(cfg.model, extra_rows=1)[7], LENGTHS[7]
    if case == "cut_vocab":
        assert int(tok[: n + 1].max()) >= v  # some rows embed ids past the draft vocab
    head.prefill(7, tok[:n], hid[:n], torch.arange(n))
    logits, hidden_out = head.step(torch.tensor([7]), tok[n:n + 1], hid[n:n + 1], torch.tensor([n]))
    ref_logits, ref_out = oracle(tok[: n + 1], hid[: n + 1])
    assert rel_err(logits[0], ref_logits[-1, :v]) < F32_TOL and rel_err(hidden_out[0], ref_out[-1]) < F32_TOL
