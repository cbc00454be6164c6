"""Multi-seed target attention (the IKBO study's configuration: S_q 64 seeds per candidate,
H 2, D 128): every candidate's seed queries attend to its user's sequence of L items.

    q[b]    = seeds + q_proj(item[b])                 [S_q, H, D]
    k, v    = k_proj(seq[idx[b]]), v_proj(seq[idx[b]]) [L, H, D]
    out[b]  = MLP(mean over seeds of softmax(q k^T / sqrt(D)) v)

``MultiSeedBlock`` is written as authors write it (the sequence gathered to the candidates,
projections, SDPA); ``MultiSeedBlockIkbo`` projects once per user and calls
``ikbo_fa.attention``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .common import MLP, sample_idx


@dataclasses.dataclass(frozen=True)
class MultiSeedConfig:
    L: int = 1024
    E: int = 256  # sequence item embedding
    seeds: int = 64  # S_q
    heads: int = 2
    head_dim: int = 128
    mlp: tuple = (256, 1)


TINY = MultiSeedConfig(L=10, E=8, seeds=3, heads=2, head_dim=64, mlp=(4, 1))


class MultiSeedBlock(nn.Module):
    def __init__(self, cfg: MultiSeedConfig = MultiSeedConfig()):
        super().__init__()
        self.cfg = cfg
        HD = cfg.heads * cfg.head_dim
        self.seeds = nn.Parameter(torch.randn(cfg.seeds, HD) * 0.5)
        self.q_proj = nn.Linear(cfg.E, HD)
        self.k_proj = nn.Linear(cfg.E, HD)
        self.v_proj = nn.Linear(cfg.E, HD)
        self.mlp = MLP((HD,) + tuple(cfg.mlp))

    def attend(self, seq, item, idx):
        """[B, H * D]: the seeds' attention outputs, averaged."""
        c = self.cfg
        B, L, H, D = item.shape[0], seq.shape[1], c.heads, c.head_dim
        s = seq.index_select(0, idx)  # [B, L, E]
        q = (self.seeds + self.q_proj(item)[:, None]).view(B, c.seeds, H, D).transpose(1, 2)
        k = self.k_proj(s).view(B, L, H, D).transpose(1, 2)
        v = self.v_proj(s).view(B, L, H, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)  # [B, H, S_q, D]
        return o.transpose(1, 2).reshape(B, c.seeds, H * D).mean(1)

    def forward(self, seq, item, idx):
        return self.mlp(self.attend(seq, item, idx))


class MultiSeedBlockIkbo(nn.Module):
    """``MultiSeedBlock`` by hand with ``ikbo_fa.attention``; shares the reference's parameters."""

    def __init__(self, ref: MultiSeedBlock):
        super().__init__()
        self.ref = ref

    def attend(self, seq, item, idx):
        import ikbo_fa

        ref, c = self.ref, self.ref.cfg
        B, U, L = item.shape[0], seq.shape[0], seq.shape[1]
        q = (ref.seeds + ref.q_proj(item)[:, None]).view(B, c.seeds, c.heads, c.head_dim)
        k = ref.k_proj(seq).view(U, L, c.heads, c.head_dim)
        v = ref.v_proj(seq).view(U, L, c.heads, c.head_dim)
        o = ikbo_fa.attention(q, (k, v), idx)  # [B, S_q, H, D]
        return o.reshape(B, c.seeds, c.heads * c.head_dim).mean(1)

    def forward(self, seq, item, idx):
        return self.ref.mlp(self.attend(seq, item, idx))


def make_inputs(cfg: MultiSeedConfig, B: int, U: int, *, dtype=torch.float32, device="cpu", generator=None):
    """(seq [U, L, E], item [B, E], idx [B])."""
    g = generator
    seq = torch.randn(U, cfg.L, cfg.E, generator=g).to(device, dtype)
    item = torch.randn(B, cfg.E, generator=g).to(device, dtype)
    return seq, item, sample_idx(B, U, g).to(device)
