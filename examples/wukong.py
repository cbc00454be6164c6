"""A Wukong-style ranking block: user and candidate feature embeddings stacked along the
embedding axis (K), a linear compression over that axis (LCE), then an MLP on the result.

    e[b] = concat(user_emb[idx[b]], cand_emb[b])   [K_user + K_cand, N]
    y[b] = W @ e[b]                                [M, N]   (Wukong's LinearCompressBlock)
    out  = MLP(flatten(y))                          [B, 1]

``WukongBlock`` is written as authors write it (the gather, the concat, ``nn.Linear`` over
the transposed embeddings); ``WukongBlockIkbo`` is the same model by hand with
``ikbo_gemm.lce`` (the concat never exists, the user GEMM runs once per user).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .common import MLP, sample_idx


@dataclasses.dataclass(frozen=True)
class WukongConfig:
    M: int = 433  # compressed embeddings
    N: int = 256  # embedding dimension
    K_user: int = 1184
    K_cand: int = 872
    mlp: tuple = (256, 1)  # after the projection of flatten(y) to mlp[0]


TINY = WukongConfig(M=5, N=8, K_user=6, K_cand=7, mlp=(4, 1))


class WukongBlock(nn.Module):
    def __init__(self, cfg: WukongConfig = WukongConfig()):
        super().__init__()
        self.cfg = cfg
        self.compress = nn.Linear(cfg.K_user + cfg.K_cand, cfg.M, bias=False)
        self.top = MLP((cfg.M * cfg.N,) + tuple(cfg.mlp))

    def lce(self, user_emb, cand_emb, idx):
        e = torch.cat([user_emb[idx], cand_emb], dim=1)  # [B, K, N]
        return self.compress(e.transpose(1, 2)).transpose(1, 2)  # [B, M, N]

    def forward(self, user_emb, cand_emb, idx):
        return self.top(self.lce(user_emb, cand_emb, idx).flatten(1))


class WukongBlockIkbo(nn.Module):
    """``WukongBlock`` by hand with ``ikbo_gemm.lce``; shares the reference's parameters."""

    def __init__(self, ref: WukongBlock):
        super().__init__()
        self.ref = ref
        w = ref.compress.weight.detach()
        self.register_buffer("w_user", w[:, :ref.cfg.K_user].contiguous(), persistent=False)
        self.register_buffer("w_cand", w[:, ref.cfg.K_user:].contiguous(), persistent=False)

    def lce(self, user_emb, cand_emb, idx):
        import ikbo_gemm

        return ikbo_gemm.lce(self.w_cand, self.w_user, cand_emb, user_emb, idx)

    def forward(self, user_emb, cand_emb, idx):
        return self.ref.top(self.lce(user_emb, cand_emb, idx).flatten(1))


def make_inputs(cfg: WukongConfig, B: int, U: int, *, dtype=torch.float32, device="cpu", generator=None):
    """(user_emb [U, K_user, N], cand_emb [B, K_cand, N], idx [B])."""
    g = generator
    user = torch.randn(U, cfg.K_user, cfg.N, generator=g).to(device, dtype)
    cand = torch.randn(B, cfg.K_cand, cfg.N, generator=g).to(device, dtype)
    return user, cand, sample_idx(B, U, g).to(device)
