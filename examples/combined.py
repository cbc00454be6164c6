"""The three blocks in one ranking request, at the published shapes: a Wukong LCE (M 433,
N 256, K_user 1184, K_cand 872), multi-seed target attention at L 1024 (S_q 64, H 2, D 128),
a DIN block over behaviour sequences of up to 1000 items (E 128, 2 heads of 64), and an MLP
2048-1024-256-1 on 1024 user features (dense user features and the DIN summary) and 1024
candidate features (the LCE projection, the multi-seed and DIN outputs, the item)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import din, multi_seed, wukong
from .common import MLP, key_lengths, sample_idx, split_linear


@dataclasses.dataclass(frozen=True)
class CombinedConfig:
    lce: wukong.WukongConfig = wukong.WukongConfig(mlp=(512,))  # flatten(LCE) -> 512 features
    seeds: multi_seed.MultiSeedConfig = multi_seed.MultiSeedConfig(E=128, mlp=(256,))
    din: din.DinConfig = din.DinConfig(L=1000, E=128, heads=2, F_cand=0, mlp=(1,))
    user_dense: int = 896  # + the DIN summary (128) = 1024 user features
    mlp: tuple = (1024, 256, 1)


TINY = CombinedConfig(lce=wukong.WukongConfig(M=5, N=8, K_user=6, K_cand=7, mlp=(6,)),
                      seeds=multi_seed.MultiSeedConfig(L=10, E=128, seeds=3, heads=2, head_dim=64, mlp=(5,)),
                      din=din.DinConfig(L=9, E=128, heads=2, F_cand=0, mlp=(1,)), user_dense=7, mlp=(8, 1))


def _features(cfg: CombinedConfig) -> tuple:
    user = cfg.user_dense + cfg.din.E
    cand = cfg.lce.mlp[-1] + cfg.seeds.mlp[0] + cfg.din.E + cfg.din.E
    return user, cand


class CombinedRanker(nn.Module):
    def __init__(self, cfg: CombinedConfig = CombinedConfig()):
        super().__init__()
        self.cfg = cfg
        self.lce = wukong.WukongBlock(cfg.lce)
        self.seeds = multi_seed.MultiSeedBlock(cfg.seeds)
        self.din = din.DinBlock(cfg.din)
        self.mlp = MLP((sum(_features(cfg)),) + tuple(cfg.mlp))

    def candidate_features(self, lce_user, seq, hist, hist_len, lce_cand, item, idx):
        lce_out = self.lce(lce_user, lce_cand, idx)  # [B, 512]
        ms = self.seeds.mlp(self.seeds.attend(seq, item, idx))  # [B, 256]
        o, summary = self.din.attend(hist, hist_len, item, idx)
        return torch.cat([lce_out, ms, o, item], dim=1), summary

    def forward(self, lce_user, seq, hist, hist_len, user_dense, lce_cand, item, idx):
        cand, summary = self.candidate_features(lce_user, seq, hist, hist_len, lce_cand, item, idx)
        user = torch.cat([user_dense[idx], summary], dim=1)
        return self.mlp(torch.cat([user, cand], dim=1))


class CombinedRankerIkbo(nn.Module):
    """``CombinedRanker`` by hand with the IKBO ops; shares the reference's parameters."""

    def __init__(self, ref: CombinedRanker):
        super().__init__()
        self.ref = ref
        self.lce = wukong.WukongBlockIkbo(ref.lce)
        self.seeds = multi_seed.MultiSeedBlockIkbo(ref.seeds)
        self.din = din.DinBlockIkbo(ref.din)

    def forward(self, lce_user, seq, hist, hist_len, user_dense, lce_cand, item, idx):
        lce_out = self.lce(lce_user, lce_cand, idx)
        ms = self.ref.seeds.mlp(self.seeds.attend(seq, item, idx))
        o, summary = self.din.attend(hist, hist_len, item, idx)  # summary [U, E]
        user = torch.cat([user_dense, summary], dim=1)  # at U rows
        mlp = self.ref.mlp
        x = split_linear(user, torch.cat([lce_out, ms, o, item], dim=1), idx, mlp[0], activation="relu")
        return mlp[2:](x)


def make_inputs(cfg: CombinedConfig, B: int, U: int, *, dtype=torch.float32, device="cpu", generator=None):
    """(lce_user, seq, hist, hist_len, user_dense, lce_cand, item, idx)."""
    g = generator
    r = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    c = cfg
    return (r(U, c.lce.K_user, c.lce.N), r(U, c.seeds.L, c.seeds.E), r(U, c.din.L, c.din.E),
            key_lengths(U, c.din.L, g).to(device), r(U, c.user_dense), r(B, c.lce.K_cand, c.lce.N),
            r(B, c.din.E), sample_idx(B, U, g).to(device))
