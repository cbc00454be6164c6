"""DIN/BST-style target attention: each candidate item is one query (S_q = 1) over its user's
behaviour sequence, multi-head; then an MLP on concat([user summary, attention output,
candidate features]).

Sequences are jagged (``hist_len[u]`` items of ``hist[u]`` count); as authors do today they
are padded to L and masked: a key-padding mask from the lengths, and a masked mean for the
user summary.

``DinBlock`` is written as authors write it: the user side gathered to the candidates first
(``hist[idx]``), the key/value projections on the gathered sequence, SDPA with the padding
mask, and one ``nn.Linear`` over the concat. ``DinBlockIkbo`` is the same model by hand:
the projections and the summary at U rows, ``ikbo_fa.attention`` with ``kv_lengths``, and
the MLP's first layer split into its user and candidate columns.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .common import MLP, key_lengths, sample_idx, split_linear


@dataclasses.dataclass(frozen=True)
class DinConfig:
    L: int = 1000  # padded behaviour-sequence length
    E: int = 128  # item embedding
    heads: int = 2
    F_cand: int = 128  # candidate features besides the item
    mlp: tuple = (1024, 256, 1)


TINY = DinConfig(L=9, E=128, heads=2, F_cand=6, mlp=(8, 1))


class DinBlock(nn.Module):
    def __init__(self, cfg: DinConfig = DinConfig()):
        super().__init__()
        self.cfg = cfg
        E = cfg.E
        self.q_proj = nn.Linear(E, E)
        self.k_proj = nn.Linear(E, E)
        self.v_proj = nn.Linear(E, E)
        self.mlp = MLP((3 * E + cfg.F_cand,) + tuple(cfg.mlp))

    def attend(self, hist, hist_len, item, idx):
        """Attention output [B, E] and the user summary [B, E] (masked mean of the history)."""
        B, H, E = item.shape[0], self.cfg.heads, self.cfg.E
        L = hist.shape[1]
        h = hist[idx]  # [B, L, E]
        valid = torch.arange(L, device=hist.device)[None, :] < hist_len[idx][:, None]  # [B, L]
        q = self.q_proj(item).view(B, 1, H, E // H).transpose(1, 2)
        k = self.k_proj(h).view(B, L, H, E // H).transpose(1, 2)
        v = self.v_proj(h).view(B, L, H, E // H).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        summary = (h * valid[..., None]).sum(1) / hist_len[idx][:, None].clamp(min=1)
        return o.transpose(1, 2).reshape(B, E), summary

    def forward(self, hist, hist_len, item, cand_feat, idx):
        o, summary = self.attend(hist, hist_len, item, idx)
        return self.mlp(torch.cat([summary, o, item, cand_feat], dim=1))


class DinBlockIkbo(nn.Module):
    """``DinBlock`` by hand with the IKBO ops; shares the reference's parameters."""

    def __init__(self, ref: DinBlock):
        super().__init__()
        self.ref = ref

    def attend(self, hist, hist_len, item, idx):
        import ikbo_fa

        ref, U, L = self.ref, hist.shape[0], hist.shape[1]
        B, H, E = item.shape[0], ref.cfg.heads, ref.cfg.E
        q = ref.q_proj(item).view(B, 1, H, E // H)
        k = ref.k_proj(hist).view(U, L, H, E // H)
        v = ref.v_proj(hist).view(U, L, H, E // H)
        o = ikbo_fa.attention(q, (k, v), idx, kv_lengths=hist_len)
        valid = torch.arange(L, device=hist.device)[None, :] < hist_len[:, None]  # [U, L]
        summary = (hist * valid[..., None]).sum(1) / hist_len[:, None].clamp(min=1)
        return o.reshape(B, E), summary

    def forward(self, hist, hist_len, item, cand_feat, idx):
        o, summary = self.attend(hist, hist_len, item, idx)
        mlp = self.ref.mlp
        x = split_linear(summary, torch.cat([o, item, cand_feat], dim=1), idx, mlp[0],
                         activation="relu" if len(mlp) > 1 else None)
        return mlp[2:](x)  # the layers after the first one and its ReLU


def make_inputs(cfg: DinConfig, B: int, U: int, *, dtype=torch.float32, device="cpu", generator=None):
    """(hist [U, L, E], hist_len [U], item [B, E], cand_feat [B, F_cand], idx [B])."""
    g = generator
    hist = torch.randn(U, cfg.L, cfg.E, generator=g).to(device, dtype)
    lengths = key_lengths(U, cfg.L, g).to(device)
    item = torch.randn(B, cfg.E, generator=g).to(device, dtype)
    feat = torch.randn(B, cfg.F_cand, generator=g).to(device, dtype)
    return hist, lengths, item, feat, sample_idx(B, U, g).to(device)
