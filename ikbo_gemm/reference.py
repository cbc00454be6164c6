"""PyTorch reference of IKBO linear compression: the definition the kernel is tested against.

    out[b] = w_cand @ e_cand[b] + (w_user @ e_user)[idx[b]]

Evaluated as the decomposition the kernel fuses: one user GEMM per user, one
candidate GEMM per candidate, a gather by idx, all in fp32; the two partial
sums are added in fp32 and rounded once to the input dtype. A candidate whose
index lies outside [0, U) (possible only with validation off) gets a NaN
output slice; no other candidate is affected. Runs on any device.
"""
from __future__ import annotations

from typing import Optional

import torch

from .checks import check_lce_inputs, check_schedule

# Candidates per chunk: bounds the fp32 copy of e_cand the reference makes.
_CHUNK_ELEMENTS = 1 << 26


def lce_reference(
    w_cand: torch.Tensor,
    w_user: torch.Tensor,
    e_cand: torch.Tensor,
    e_user: torch.Tensor,
    idx: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
    schedule: str = "fused",
) -> torch.Tensor:
    """Same signature and result as :func:`ikbo_gemm.lce`; ``schedule`` is checked and ignored."""
    B, U, M, N, K_cand, K_user = check_lce_inputs(w_cand, w_user, e_cand, e_user, idx, out, validate)
    check_schedule(schedule)
    f32 = torch.float32

    user = torch.matmul(w_user.to(f32), e_user.to(f32))  # [U, M, N], once per user
    idx = idx.long()
    valid = (idx >= 0) & (idx < U)
    safe = torch.where(valid, idx, torch.zeros_like(idx))

    result = torch.empty((B, M, N), dtype=e_cand.dtype, device=e_cand.device)
    w_c = w_cand.to(f32)
    chunk = max(1, _CHUNK_ELEMENTS // (K_cand * N + M * N))
    for start in range(0, B, chunk):
        sl = slice(start, min(B, start + chunk))
        acc = torch.matmul(w_c, e_cand[sl].to(f32))  # [b, M, N]
        acc += user.index_select(0, safe[sl])
        acc.masked_fill_(~valid[sl, None, None], float("nan"))
        result[sl] = acc  # the one rounding
    if out is not None:
        out.copy_(result)
        return out
    return result
