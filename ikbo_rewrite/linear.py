"""linear: a linear over ``cat([x_user[idx], x_cand], dim=1)`` [B, K] becomes
``ikbo_gemm.linear`` (when that op exists), with a following bias and activation folded
into its epilogue where the linear is their only input."""
from __future__ import annotations


def available() -> bool:
    import ikbo_gemm  # noqa: F401  (registers the ops)
    import torch

    return hasattr(torch.ops.ikbo_gemm, "linear")


def rewrite_linear(ctx) -> None:
    from .linear_rewrite import rewrite

    rewrite(ctx, available())
