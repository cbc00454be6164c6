"""How the peers take the attention workload without copying K/V per candidate: FA4's page
table, FA varlen with each user's candidates packed as one query sequence, and (jagged) the
per-candidate padding the materializing peers gather."""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch

# FA4's sm90 forward loads pages by TMA only when a page is exactly its 128-key tile
# (D = 128); other page sizes take a slower cp.async path.
PAGE_SIZE = 128


class PageTable(NamedTuple):
    pages: torch.Tensor  # int32 [B, pages per user]: candidate b -> pages of user idx[b]
    seqused_k: Optional[torch.Tensor]  # int32 [B] = L when L is not a multiple of the page


def build_page_table(idx: torch.Tensor, L: int, page_size: int = PAGE_SIZE) -> PageTable:
    """Row b lists the pages of user idx[b] in K/V stored as [U * n, page_size, H, D]."""
    n = -(-L // page_size)
    pages = (idx.long()[:, None] * n + torch.arange(n, device=idx.device)[None, :]).to(torch.int32)
    seqused = None if L % page_size == 0 else torch.full((idx.numel(),), L, dtype=torch.int32,
                                                         device=idx.device)
    return PageTable(pages.contiguous(), seqused)


def to_pages(x: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """[U, L, H, D] -> [U * ceil(L / page), page, H, D]: a view when L is a multiple of the page,
    else a copy padded with zeros (the padded keys are masked, but must be finite)."""
    U, L, H, D = x.shape
    n = -(-L // page_size)
    if n * page_size != L:
        x = torch.cat([x, x.new_zeros(U, n * page_size - L, H, D)], dim=1)
    return x.reshape(U * n, page_size, H, D)


def run_paged(varlen_fn: Callable, q, k_pages, v_pages, table: PageTable, scale: float):
    """One candidate per batch entry, K/V through the page table. q [B, S_q, H, D]."""
    return varlen_fn(q, k_pages, v_pages, page_table=table.pages, seqused_k=table.seqused_k,
                     softmax_scale=scale)[0]


@dataclasses.dataclass
class Packing:
    order: Optional[torch.Tensor]  # int64 [B] grouping candidates by user; None if already sorted
    cu_seqlens_q: torch.Tensor  # int32 [U + 1]: prefix sums of count_u * S_q
    cu_seqlens_k: torch.Tensor  # int32 [U + 1]: prefix sums of L (jagged: kv_offsets)
    max_seqlen_q: int
    max_seqlen_k: int
    # Q broadcast (jagged): int64 [B], the user whose queries each candidate's sequence takes
    # (a per-candidate copy of Q, made in the timed call); sequences are then candidates
    q_rows: Optional[torch.Tensor] = None

    def to(self, device) -> "Packing":
        return Packing(*(t.to(device) if isinstance(t, torch.Tensor) else t
                         for t in vars(self).values()))


def build_varlen_packing(idx: torch.Tensor, num_users: int, S_q: int, L: int,
                         kv_offsets: Optional[torch.Tensor] = None) -> Packing:
    """Sequence u = the queries of all candidates of user u (in candidate order: count_u * S_q
    rows, dense, for any S_q) against K/V row u: L keys, or kv_offsets[u]:kv_offsets[u + 1] of the
    packed keys when ``kv_offsets`` [U + 1] is given (jagged; max_seqlen_k is then the longest)."""
    idx = idx.long()
    is_sorted = bool((idx[1:] >= idx[:-1]).all()) if idx.numel() > 1 else True
    counts = torch.bincount(idx, minlength=num_users)
    cu_q = torch.zeros(num_users + 1, dtype=torch.int32, device=idx.device)
    cu_q[1:] = torch.cumsum(counts * S_q, 0)
    if kv_offsets is None:
        cu_k, max_k = torch.arange(num_users + 1, dtype=torch.int32, device=idx.device) * L, L
    else:
        cu_k = kv_offsets.to(torch.int32)
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
    order = None if is_sorted else torch.argsort(idx, stable=True)
    return Packing(order, cu_q, cu_k, int(counts.max()) * S_q, max_k)


def build_candidate_packing(idx: torch.Tensor, kv_offsets: torch.Tensor, S_q: int) -> Packing:
    """Q broadcast, jagged K/V per candidate: sequence b = the S_q queries of user idx[b]
    (copied per candidate) against candidate b's keys kv_offsets[b]:kv_offsets[b + 1]."""
    cu_q = torch.arange(idx.numel() + 1, dtype=torch.int32, device=idx.device) * S_q
    cu_k = kv_offsets.to(torch.int32)
    return Packing(None, cu_q, cu_k, S_q, int((cu_k[1:] - cu_k[:-1]).max()), q_rows=idx.long())


def pack_queries(q: torch.Tensor, packing: Packing) -> torch.Tensor:
    """[B, S_q, H, D] -> [B * S_q, H, D] grouped by user (a view when idx is sorted); with
    ``q_rows``, [U, S_q, H, D] per user -> [B * S_q, H, D] per candidate (a copy)."""
    rows = packing.order if packing.q_rows is None else packing.q_rows
    q = q if rows is None else q.index_select(0, rows)
    return q.reshape(-1, *q.shape[2:])


def run_varlen(varlen_fn: Callable, q, k, v, packing: Packing, scale: float):
    """q [B, S_q, H, D] per candidate (or [U, S_q, H, D] with ``q_rows``); k, v [U, L, H, D]
    per user, passed as [U * L, H, D] views, or already packed [total keys, H, D] (jagged).
    Returns [B, S_q, H, D] in candidate order."""
    if k.dim() == 4:
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    o = varlen_fn(pack_queries(q, packing), k, v,
                  cu_seqlens_q=packing.cu_seqlens_q, cu_seqlens_k=packing.cu_seqlens_k,
                  max_seqlen_q=packing.max_seqlen_q, max_seqlen_k=packing.max_seqlen_k,
                  softmax_scale=scale)
    o = o[0] if isinstance(o, tuple) else o  # FA4 returns (out, lse), FA3 out alone
    o = o.view(-1, q.shape[1], *o.shape[1:])
    return o if packing.order is None else torch.empty_like(o).index_copy_(0, packing.order, o)


def padded_gather(kv_offsets: torch.Tensor, rows: torch.Tensor, max_len: int) -> tuple:
    """Per-candidate K/V padded to ``max_len`` keys, from packed rows: candidate b reads K/V row
    rows[b]. Returns (int64 [B, max_len]: the packed key at each position, the row's last key
    repeated past its length; bool [B, max_len]: the position is one of the row's keys)."""
    offsets = kv_offsets.long()
    start, n = offsets[rows], offsets[rows + 1] - offsets[rows]
    pos = torch.arange(max_len, device=offsets.device)[None, :]
    gather = start[:, None] + torch.minimum(pos, (n - 1).clamp(min=0)[:, None])
    return gather, pos < n[:, None]
