"""Random problems of ``ikbo_gemm.linear`` for the op-contract suite and the torch.compile tests."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ikbo_gemm.reference import apply_activation


class LinearProblem(NamedTuple):
    """The op's six positional arguments, in order: ``linear(*problem)``."""

    x_cand: torch.Tensor  # [B, K_cand]
    x_user: torch.Tensor  # [U, K_user]
    idx: torch.Tensor  # [B]
    w_cand: torch.Tensor  # [N, K_cand]
    w_user: torch.Tensor  # [N, K_user]
    bias: Optional[torch.Tensor]  # [N]


def random_problem(B, U, N, K_user, K_cand, dtype, idx_dtype=torch.int32, seed=0, device="cpu",
                   bias=True) -> LinearProblem:
    """Fresh random operands on ``device`` (drawn there, from a generator of that device); idx
    gives each user about B / U candidates (every user one at least when B >= U), shuffled.
    The weights are scaled by 1/sqrt(K_user + K_cand), so outputs are of order 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = 1.0 / math.sqrt(K_user + K_cand)

    def randn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * s).to(dtype)

    idx = (torch.arange(B, device=device) * U // max(B, 1))[torch.randperm(B, generator=g, device=device)]
    return LinearProblem(randn(B, K_cand), randn(U, K_user), idx.to(idx_dtype), randn(N, K_cand, s=scale),
                         randn(N, K_user, s=scale), randn(N, s=0.5) if bias else None)


def fp32_linear(x_cand, x_user, idx, w_cand, w_user, bias=None, activation=None):
    """The layer in fp32, not rounded (every index in range)."""
    acc = x_cand.float() @ w_cand.float().T + (x_user.float() @ w_user.float().T)[idx.long()]
    if bias is not None:
        acc = acc + bias.float()
    return apply_activation(acc, activation)
