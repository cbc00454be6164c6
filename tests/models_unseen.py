"""Ranking models written as their papers and public code write them, which the rewrite pass
was not built on: each scores B candidates of U users (``idx[b]`` the user of candidate b), the
user side gathered to the candidates the usual way.

- ``DcnV2Ranker``: DCN-v2 (Wang et al. 2021), a user tower, then x0 = [user, candidate] through
  full-rank cross layers ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l`` beside a deep MLP, one logit.
- ``BstRanker``: Behavior Sequence Transformer (Chen et al. 2019), the user's history and the
  target item as one sequence [history, target] with position embeddings, one transformer
  layer (self-attention over the whole sequence, written out), then an MLP on the flattened output.
- ``MmoeRanker``: MMoE (Ma et al. 2018) with experts on the user features alone beside experts
  and per-task softmax gates on [user, candidate]; one tower per task.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from examples.common import MLP


def mlp(*sizes: int) -> nn.Sequential:
    return MLP(sizes)


class DcnV2Ranker(nn.Module):
    def __init__(self, user_in: int = 24, user_dim: int = 16, cand_dim: int = 16, cross_layers: int = 2):
        super().__init__()
        self.user_tower = mlp(user_in, 32, user_dim)
        d = user_dim + cand_dim
        self.cross = nn.ModuleList(nn.Linear(d, d) for _ in range(cross_layers))
        self.deep = mlp(d, 32, 16)
        self.head = nn.Linear(d + 16, 1)

    def forward(self, user_feat, cand_feat, idx):
        u = self.user_tower(user_feat)  # [U, user_dim]
        x0 = torch.cat([u[idx], cand_feat], dim=1)  # [B, d]
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.head(torch.cat([x, self.deep(x0)], dim=1))


class BstRanker(nn.Module):
    """History [U, L, E] per user, target [B, E] per candidate; E = heads * 64."""

    def __init__(self, E: int = 128, heads: int = 2, L: int = 6):
        super().__init__()
        self.heads = heads
        self.pos = nn.Parameter(torch.randn(L + 1, E) * 0.1)
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.ffn = mlp(E, 2 * E, E)
        self.out = mlp((L + 1) * E, 64, 1)

    def forward(self, history, target, idx):
        seq = torch.cat([history[idx], target.unsqueeze(1)], dim=1) + self.pos  # [B, L + 1, E]
        B, S, E = seq.shape
        split = lambda x: x.view(B, S, self.heads, E // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(seq)), split(self.k(seq)), split(self.v(seq))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(E // self.heads), dim=-1) @ v
        h = self.norm1(seq + self.o(att.transpose(1, 2).reshape(B, S, E)))
        h = self.norm2(h + self.ffn(h))
        return self.out(h.flatten(1))


class MmoeRanker(nn.Module):
    def __init__(self, user_dim: int = 20, cand_dim: int = 12, hidden: int = 16, user_experts: int = 2,
                 shared_experts: int = 2, tasks: int = 2):
        super().__init__()
        d = user_dim + cand_dim
        self.user_experts = nn.ModuleList(mlp(user_dim, 32, hidden) for _ in range(user_experts))
        self.shared_experts = nn.ModuleList(mlp(d, 32, hidden) for _ in range(shared_experts))
        self.gates = nn.ModuleList(nn.Linear(d, user_experts + shared_experts) for _ in range(tasks))
        self.towers = nn.ModuleList(mlp(hidden, 8, 1) for _ in range(tasks))

    def forward(self, user_feat, cand_feat, idx):
        u = user_feat[idx]  # [B, user_dim]
        x = torch.cat([u, cand_feat], dim=1)
        experts = torch.stack([e(u) for e in self.user_experts] + [e(x) for e in self.shared_experts], dim=1)
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            w = F.softmax(gate(x), dim=-1)  # [B, experts]
            outs.append(tower(torch.einsum("be,beh->bh", w, experts)))
        return torch.cat(outs, dim=1)


def make_inputs(name: str, B: int, U: int, seed: int, dtype=torch.bfloat16):
    """Fresh random inputs of a model: the user side [U, ...], the candidates [B, ...], idx [B]
    with every user present where B >= U."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, U, (B,), generator=g)
    idx[: min(B, U)] = torch.randperm(U, generator=g)[: min(B, U)]
    if name == "dcn_v2":
        user, cand = torch.randn(U, 24, generator=g), torch.randn(B, 16, generator=g)
    elif name == "bst":
        user, cand = torch.randn(U, 6, 128, generator=g), torch.randn(B, 128, generator=g)
    else:
        user, cand = torch.randn(U, 20, generator=g), torch.randn(B, 12, generator=g)
    return user.to(dtype), cand.to(dtype), idx


MODELS = {"dcn_v2": DcnV2Ranker, "bst": BstRanker, "mmoe": MmoeRanker}
