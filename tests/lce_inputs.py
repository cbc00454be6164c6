"""Random LCE problems shared by the CPU and GPU linear-compression tests and the op-contract suite."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch


class LceProblem(NamedTuple):
    """The op's five positional arguments, in order: ``lce(*problem)``."""

    w_cand: torch.Tensor  # [M, K_cand]
    w_user: torch.Tensor  # [M, K_user]
    e_cand: torch.Tensor  # [B, K_cand, N]
    e_user: torch.Tensor  # [U, K_user, N]
    idx: torch.Tensor  # [B]


def random_problem(B, U, M, N, K_user, K_cand, dtype, idx_dtype=torch.int32, order="sorted", seed=0,
                   device="cpu") -> LceProblem:
    """Fresh random operands on ``device`` (drawn there, from a generator of that device).

    ``order`` of idx: "sorted" (contiguous groups, every user used when B >= U), "shuffled"
    (the same groups in random order) or "random" (any order, users may repeat or go unused).
    The weights are scaled by 1/sqrt(K_user + K_cand), so outputs are of order 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = 1.0 / math.sqrt(K_user + K_cand)

    def randn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * s).to(dtype)

    w_cand = randn(M, K_cand, s=scale)
    w_user = randn(M, K_user, s=scale)
    e_cand = randn(B, K_cand, N)
    e_user = randn(U, K_user, N)
    if order == "sorted":
        idx = torch.arange(B, device=device) * U // max(B, 1)
    elif order == "shuffled":
        idx = (torch.arange(B, device=device) * U // max(B, 1))[torch.randperm(B, generator=g, device=device)]
    elif order == "random":
        idx = torch.randint(0, U, (B,), generator=g, device=device)
    else:
        raise ValueError(f"order must be 'sorted', 'shuffled' or 'random', got {order!r}")
    return LceProblem(w_cand, w_user, e_cand, e_user, idx.to(idx_dtype))


def users_for_ratio(B: int, ratio: int) -> int:
    """U for ``ratio`` candidates per user: ceil(B / ratio)."""
    return -(-B // ratio)
