"""The draft LM head: the target's LM head, optionally cut to the first `mtp_vocab_size` rows."""

from __future__ import annotations

import torch
from torch import nn

from mtpfactory.components.linear import Linear, make_linear
from mtpfactory.components.norms import RMSNorm


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

    def after_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, y) for the head's final norm y = norm(x + residual), in one op where the format has one
        (`Linear.after_norm`)."""
        return self.proj.after_norm(norm, x, residual)


def draft_vocab(vocab: int, mtp_vocab_size: int) -> int:
    """0 = the full vocab, else min(n, vocab)."""
    return vocab if mtp_vocab_size == 0 else min(mtp_vocab_size, vocab)


def build_lm_head(ctx) -> LMHead:
    m = ctx.model
    v = draft_vocab(m.vocab_size, ctx.cfg.levers.mtp_vocab_size)
    name = "model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight"
    full = ctx.tensor(name, m.vocab_size, m.hidden_size)
    proj = make_linear(full[:v].clone(), ctx.fmt("lm_head"), ctx.dtype, name.removesuffix(".weight"),
                       ctx.cfg.levers.gemv_split_work)
    return LMHead(proj, m.vocab_size)
