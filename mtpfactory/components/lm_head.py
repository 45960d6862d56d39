"""The draft LM head: the target's LM head, optionally cut to the first `mtp_vocab_size` rows."""

from __future__ import annotations

import logging

import torch
from torch import nn

from mtpfactory.components.linear import Linear, make_linear
from mtpfactory.errors import WeightsError

log = logging.getLogger(__name__)


class LMHead(nn.Module):
    def __init__(self, proj: Linear, full_vocab: int) -> None:
        super().__init__()
        self.proj, self.full_vocab = proj, full_vocab

    @property
    def draft_vocab(self) -> int:
        return self.proj.out_features

    @property
    def nbytes(self) -> int:
        return self.proj.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, draft_vocab]
        return self.proj(x)

    def after_norm(self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, y) for the head's final norm y = norm(x + residual), in one op where the format has one
        (`Linear.after_norm`)."""
        return self.proj.after_norm(norm, x, residual)


def draft_vocab(vocab: int, mtp_vocab_size: int) -> int:
    """0 = the full vocab, else min(n, vocab)."""
    return vocab if mtp_vocab_size == 0 else min(mtp_vocab_size, vocab)


def build_lm_head(ctx) -> LMHead:
    m, w = ctx.model, ctx.weights
    v = draft_vocab(m.vocab_size, ctx.cfg.levers.mtp_vocab_size)
    if m.tie_word_embeddings and w.has("lm_head.weight"):
        log.warning("lm_head.weight is in %s, but model.tie_word_embeddings=true: the draft LM head is the "
                    "embedding; set model.tie_word_embeddings=false if the checkpoint's config.json says so", w.origin)
    if not m.tie_word_embeddings and not w.has("lm_head.weight") and w.has("model.embed_tokens.weight"):
        raise WeightsError("lm_head.weight", None, f"missing from {w.origin}, and model.tie_word_embeddings=false",
                           "if the checkpoint ties its LM head to the embedding (config.json tie_word_embeddings: "
                           "true), set model.tie_word_embeddings=true; else the checkpoint must carry lm_head.weight")
    name = "model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight"
    full = ctx.tensor(name, m.vocab_size, m.hidden_size)
    # At the full vocab the head uses the tensor it was given (with tied embeddings, the embedding itself);
    # a cut vocab is copied so that the full table can be freed.
    weight = full if v == m.vocab_size else full[:v].clone()
    proj = make_linear(weight, ctx.fmt("lm_head"), ctx.dtype, name.removesuffix(".weight"),
                       ctx.cfg.levers.gemv_split_work)
    return LMHead(proj, m.vocab_size)
