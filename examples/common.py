"""Pieces the reference models share: the MLP as authors write it, the hand-written IKBO
linear over a [user part | candidate part] concat, and request sampling."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


def MLP(sizes: Sequence[int]) -> nn.Sequential:  # noqa: N802  (reads as a layer)
    """Linear layers with ReLU between them (none after the last)."""
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def split_linear(x_user: torch.Tensor, x_cand: torch.Tensor, idx: torch.Tensor, layer: nn.Linear,
                 activation: Optional[str] = None) -> torch.Tensor:
    """``act(layer(cat([x_user[idx], x_cand], 1)))`` without the gathered copy: the user
    columns of the weight run at U rows. Uses ``ikbo_gemm.linear`` where it exists, else the
    torch decomposition (user GEMM at U rows, gather, candidate GEMM, add)."""
    import ikbo_gemm

    k_user = x_user.shape[1]
    w_user, w_cand = layer.weight[:, :k_user], layer.weight[:, k_user:]
    if hasattr(ikbo_gemm, "linear"):
        return ikbo_gemm.linear(x_cand, x_user, idx, w_cand.contiguous(), w_user.contiguous(), layer.bias,
                                activation=activation)
    y = (x_user @ w_user.T)[idx] + torch.addmm(layer.bias, x_cand, w_cand.T)
    return {None: lambda t: t, "relu": torch.relu}[activation](y)


def sample_idx(B: int, U: int, generator: Optional[torch.Generator] = None, shuffled: bool = True) -> torch.Tensor:
    """int64 [B] candidate -> user index in which every user of [0, U) appears (B >= U)."""
    if B < U:
        raise ValueError(f"need B >= U, got B={B}, U={U}")
    idx = torch.cat([torch.arange(U), torch.randint(0, U, (B - U,), generator=generator)])
    if shuffled:
        idx = idx[torch.randperm(B, generator=generator)]
    else:
        idx = idx.sort().values
    return idx


def key_lengths(U: int, L: int, generator: Optional[torch.Generator] = None, min_len: int = 1) -> torch.Tensor:
    """int64 [U] behaviour-sequence lengths in [min_len, L] (one user at L)."""
    lengths = torch.randint(min_len, L + 1, (U,), generator=generator)
    lengths[0] = L
    return lengths
