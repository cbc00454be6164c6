"""PyTorch reference of IKBO attention: the definition the kernel is tested against.

Semantics shared with the kernel (see ``ikbo_fa.attention``):
- KV broadcast: Q_b = q[b], K_b = k[idx[b]], V_b = v[idx[b]].
- Q broadcast:  Q_b = q[idx[b]], K_b = k[b], V_b = v[b].
- ``kv_lengths`` has one entry per K/V batch row; only the first
  ``clamp(kv_lengths[r], 0, L)`` keys of row r take part. A length of 0 gives
  an output of 0 and a log-sum-exp of -inf.
- Jagged K/V (``kv_offsets`` [R + 1], k / v [total_L, H_kv, D]): row r's keys are
  k[start_r : start_r + n_r] with start_r = clamp(off[r], 0, total_L),
  end_r = clamp(off[r + 1], start_r, total_L), n_r = end_r - start_r, and
  n_r = min(n_r, max_kv_len) where the hint is given (offsets that validation would
  refuse still read only inside k / v).
- A candidate whose index is out of range (possible only with validation off)
  gets NaN output and NaN log-sum-exp; no other candidate is affected.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .checks import Problem, check_given_work_list, resolve_problem
from .worklist import WorkList

# Candidates per chunk: bounds the memory of the gathered K/V (the reference
# materializes each chunk's K/V in fp32).
_CHUNK_ELEMENTS = 1 << 26


def attention_reference(
    q: torch.Tensor,
    kv,
    idx: torch.Tensor,
    *,
    scale: Optional[float] = None,
    kv_lengths: Optional[torch.Tensor] = None,
    kv_offsets: Optional[torch.Tensor] = None,
    max_kv_len: Optional[int] = None,
    broadcast: Optional[str] = None,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
    work_list: Optional[WorkList] = None,
    policy=None,
):
    """Same signature and result as :func:`ikbo_fa.attention`, evaluated with PyTorch (any device);
    it also takes float32 and any head dimension D. A ``work_list`` is checked as the op checks
    it; the result does not depend on it. ``policy`` (the op's launch choices) is ignored."""
    p = resolve_problem(q, kv, idx, scale=scale, kv_lengths=kv_lengths, kv_offsets=kv_offsets,
                        max_kv_len=max_kv_len, broadcast=broadcast, out=out, validate=validate,
                        op="attention_reference", return_lse=return_lse)
    if work_list is not None:
        check_given_work_list(work_list, p, validate)
    return evaluate(p, return_lse, out)


def evaluate(p: Problem, return_lse: bool, out: Optional[torch.Tensor]):
    """A checked problem's result as the op returns it: out (in q's dtype, written into ``out``
    where given) and, with ``return_lse``, the fp32 log-sum-exp."""
    o, lse = reference_forward(p, torch.float32)
    o = o.to(p.q.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


def jagged_rows(kv_offsets: torch.Tensor, total_kv: int, max_kv_len: Optional[int] = None):
    """(start, length) of each jagged row [R] (int64): the offsets clamped into k / v, so that
    unvalidated offsets read nothing outside them, and lengths cut at ``max_kv_len``."""
    off = kv_offsets.long()
    start = off[:-1].clamp(0, total_kv)
    end = torch.minimum(torch.maximum(off[1:], start), torch.full_like(start, total_kv))
    length = end - start
    if max_kv_len is not None:
        length = length.clamp(max=max_kv_len)
    return start, length


def reference_forward(p: Problem, compute_dtype: torch.dtype):
    """Attention of a resolved problem in ``compute_dtype``: (out [B, S_q, H, D], lse [B, H, S_q] fp32)."""
    B, S_q, H, D = p.batch, p.s_q, p.heads, p.head_dim
    group = H // p.kv_heads
    device = p.q.device
    idx = p.idx.long()
    n_side = p.kv_batch if p.direction == "kv" else p.q.shape[0]
    valid = (idx >= 0) & (idx < n_side)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    ar = torch.arange(B, device=device)
    q_rows, kv_rows = (ar, safe) if p.direction == "kv" else (safe, ar)
    if p.jagged:
        starts, lengths = jagged_rows(p.kv_offsets, p.total_kv, p.kv_len)
        starts, lengths = starts[kv_rows], lengths[kv_rows]
        # Keys gathered per candidate: no row is longer than the hint or than k itself (a bound
        # known without reading the offsets back).
        L = min(p.kv_len, p.total_kv)
    else:
        L = p.kv_len
        if p.kv_lengths is not None:
            lengths = p.kv_lengths.long().clamp(0, L)[kv_rows]
        else:
            lengths = torch.full((B,), L, dtype=torch.long, device=device)

    out = torch.zeros(B, S_q, H, D, dtype=compute_dtype, device=device)
    lse = torch.full((B, H, S_q), float("-inf"), dtype=torch.float32, device=device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, L * H * D))
    for start in range(0, B if L > 0 else 0, chunk):  # L = 0: every row is empty
        sl = slice(start, min(B, start + chunk))
        qb = p.q[q_rows[sl]].to(compute_dtype)  # [b, S_q, H, D]
        if p.jagged:
            # Key j of a candidate is k[start + j]; positions past the row (masked below) are
            # clamped into k so that the gather stays in bounds.
            pos = (starts[sl, None] + torch.arange(L, device=device)).clamp(max=p.total_kv - 1)  # [b, L]
            kb, vb = p.k[pos], p.v[pos]  # [b, L, H_kv, D]
        else:
            kb, vb = p.k[kv_rows[sl]], p.v[kv_rows[sl]]
        kb = kb.to(compute_dtype).repeat_interleave(group, dim=2)  # [b, L, H, D]
        vb = vb.to(compute_dtype).repeat_interleave(group, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", qb, kb) * p.scale
        key_ok = torch.arange(L, device=device)[None, :] < lengths[sl, None]  # [b, L]
        s = s.masked_fill(~key_ok[:, None, None, :], float("-inf"))
        # Keys past the length take no part, even when their values are not finite.
        vb = vb.masked_fill(~key_ok[:, :, None, None], 0.0)
        m = s.amax(dim=-1, keepdim=True)  # -inf for an empty row
        m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
        e = torch.exp(s - m_safe)
        denom = e.sum(dim=-1, keepdim=True)
        pr = e / torch.where(denom == 0, torch.ones_like(denom), denom)
        out[sl] = torch.einsum("bhqk,bkhd->bqhd", pr, vb)
        lse[sl] = (m_safe + torch.log(denom)).squeeze(-1).float()
    bad = ~valid
    out[bad] = float("nan")
    lse[bad] = float("nan")
    return out, lse


def naive_attention(q, k, v, scale: float, lengths=None):
    """Textbook attention on materialized tensors (tests): q [B, S_q, H, D], k/v [B, L, H_kv, D].

    Computes in the inputs' dtype; returns (out, lse).
    """
    B, S_q, H, D = q.shape
    group = H // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    out = torch.zeros_like(q)
    lse = torch.full((B, H, S_q), float("-inf"), dtype=q.dtype, device=q.device)
    for b in range(B):
        n = k.shape[1] if lengths is None else int(lengths[b])
        if n == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[b], k[b, :n]) * scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v[b, :n])
    return out, lse


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
