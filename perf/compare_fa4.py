"""IKBO attention head to head with FlashAttention-4 and torch SDPA on one Hopper GPU.

    python -m perf.compare_fa4                      # the published configuration
    python -m perf.compare_fa4 --sweep ratio B S_q  # one-variable sweeps around it (L = 1024)
    python -m perf.compare_fa4 --sweep S_q_fine     # S_q 1 ... 128 at L 1024 and 8192
    python -m perf.compare_fa4 --L 1024 --order shuffled --broadcast q --dtype fp16
    python -m perf.compare_fa4 --jagged lognormal --L 8192   # K/V of per-user lengths <= L
    python -m perf.compare_fa4 --preset gr-cross    # generative-recommender cross attention
    python -m perf.compare_fa4 --sweep S_q_fine --H 1 2 4 8 --D 64 128 --dtype bf16 fp16
    python -m perf.compare_fa4 --S-q 1 --L 1024 2048 --variant _SPLIT_PAIR=0 _SPLIT_MIN_KEYS=1024

Workload (K/V broadcast): B candidates, U users, idx[b] = the user of candidate b;
q [B, S_q, H, D] per candidate, k, v [U, L, H, D] per user;
out[b] = softmax(scale * q[b] k[idx[b]]^T) v[idx[b]]. With ``--broadcast q`` the roles
swap: q [U, S_q, H, D] per user, k, v [B, L, H, D] per candidate.

Jagged K/V (``--jagged DIST``): every K/V row r (a user; a candidate with ``--broadcast q``)
has its own length len_r in [1, L], drawn with the run's seeded rng from the distribution
DIST (``LENGTHS``); k, v are packed as [sum len_r, H, D] and kv_offsets [rows + 1] int32
holds their prefix sums: ikbo gets ``attention(q, (k, v), idx, kv_offsets=, max_kv_len=)``,
FA4 varlen the same offsets as cu_seqlens_k, SDPA the K/V padded to the longest length with
a key mask. FLOPs are then 4 S_q H D x the sum over candidates of their key count.
``--preset gr-cross`` is one such shape (``PRESETS``).

Providers, all fed the same inputs, each checked against an fp32 reference before it is
timed (a wrong one is reported, never timed):
  ikbo                     ikbo_fa.attention on the inputs as they are
  fa4 materialized         FA4 (flash_attn.cute) on the broadcast side copied per candidate;
                           kernel alone
  fa4 materialize+kernel   the same, the copy timed too
  fa4 page table           FA4 with every candidate's page-table row pointing at its user's
                           K/V pages (no copy; K/V broadcast only)
  fa4 varlen packed        FA4 varlen with each user's candidates packed into one query
                           sequence against that user's K/V (no copy; K/V broadcast only).
                           Shuffled idx: the Q gather and O scatter are timed with it.
                           Jagged: cu_seqlens_k = kv_offsets; with Q broadcast one sequence
                           per candidate, the per-candidate Q copy timed with it
  sdpa materialized        torch SDPA on the materialized tensors, kernel alone (jagged: K/V
                           padded per candidate to the longest length, with a key mask)
  torch.compile materialize+sdpa
                           the copy and SDPA under torch.compile, compiled afresh for each
                           problem (static shapes, one graph, no Inductor disk cache)
  materialize              the broadcast copy on its own (no attention)
  ikbo, work list reused   ikbo_fa.attention with ``work_list=``: idx's grouping by user built
                           once (``ikbo_fa.work_list``), untimed, as FA4 varlen's packing is: what
                           each call of a model costs where several calls share one idx
                           (K/V broadcast only)
  ikbo SPEC                (``--variant SPEC``) ikbo with launch flags of ikbo_fa.attention set,
                           e.g. ``_SPLIT_PAIR=0``: choices other than the op's, timed in the
                           same run as the default
Index metadata (page table, cu_seqlens, the grouping permutation, the padding gather) is
built once, untimed, which favors the peers ("ikbo" groups idx in every timed call; "ikbo, work
list reused" is the like-for-like row). A provider whose materialized tensors would not
fit in 80% of the free memory is skipped; so are the page table and FA4's dense kernel on
jagged K/V (the varlen peer is FA4's way to take it).

Timing: every provider is checked first; those that pass are then timed (--timing):
  interleaved  in turns (each round calls every provider once), so drift in clocks or
               temperature during the run falls on all of them alike; each runs in short
               bursts, below the board's power limit. Median of CUDA-event timings of single
               calls after warm-up; CUDA-graph replays as well (also in turns) for calls
               shorter than --graph-below-ms (graph_ms)
  sustained    each alone, back to back, for --sustained-s after --sustained-warmup-s, as a
               serving GPU runs: the median ms per call of chunks of calls, with the power (W)
               and SM clock (MHz) seen meanwhile; fields ms_sustained, tflops_sustained,
               ikbo_speedup_sustained, ... (ratios within the mode)
  both         the two, interleaved first (the default: about 3.5 min on the defaults on an H200;
               sustained adds about 3 s per provider and point)
Calls cycle through copies of the inputs when they are small enough for L2 to keep them;
TFLOP/s = 4 B H S_q L D / t (jagged: 4 H S_q D sum_b len_b / t). Also recorded: a same-run cuBLAS
GEMM ceiling, host time per call on a tiny problem, first-call time (compile included), GPU,
clocks, driver, versions and git commit. Rows also carry S_q, jagged (the distribution or None),
total_keys, max_len (the longest row drawn), mean_len and gflop.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from perf import harness
from perf.harness import (  # noqa: F401  (user_counts, Skip: public here too)
    ContextLost, Skip, context_lost, make_idx, short_error, user_counts,
)

NAME = "compare_fa4"
DEVICE = "cuda"  # a CPU dry run of the whole script swaps it (tests)
PUBLISHED = {"B": 2048, "ratio": 64, "S_q": 64, "L": [512, 1024, 2048, 4096, 8192, 16384]}
SWEEP_L = 1024  # L of the ratio / B / S_q sweeps


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One variable (``var``: L, ratio, B or S_q) over ``values``, the others at the published
    point, at each L of ``L`` (``--L`` overrides it; unused when ``var`` is L)."""
    var: str
    values: tuple
    L: tuple = (SWEEP_L,)


SWEEPS = {
    "L": Sweep("L", (512, 1024, 2048, 4096, 8192, 16384)),
    "ratio": Sweep("ratio", (10, 32, 64, 128, 256, 1000)),
    "B": Sweep("B", (256, 512, 1024, 2048, 4096)),
    "S_q": Sweep("S_q", (32, 64, 128)),
    # decode-like to prefill-like query counts, odd ones included (17, 48, 100: partial tiles)
    "S_q_fine": Sweep("S_q", (1, 2, 4, 8, 16, 17, 32, 48, 64, 100, 128), L=(1024, 8192)),
}
# FA4's sm90 forward loads pages by TMA only when a page is exactly its 128-key tile
# (D = 128); other page sizes take a slower cp.async path.
PAGE_SIZE = 128
CHECK_SAMPLE = 32  # random candidates checked besides the first and the last


# --------------------------------------------------------------------------- key lengths (jagged)

def _uniform(n, L, rng):
    return rng.integers(1, L + 1, size=n)


def _lognormal(n, L, rng):
    return np.ceil(rng.lognormal(mean=math.log(L / 8), sigma=1.0, size=n))


def _exponential(n, L, rng):
    return np.ceil(rng.exponential(L / 4, size=n))


def _zipf(n, L, rng):
    cdf = np.cumsum(1.0 / np.arange(1, L + 1))
    return np.searchsorted(cdf / cdf[-1], rng.random(n), side="right") + 1


# name -> (draw(n, L, rng), what it draws); every draw is then clipped to [1, L]
LENGTHS = {
    "uniform": (_uniform, "uniform on [1, L]"),
    "lognormal": (_lognormal, "ceil(lognormal(median L/8, sigma 1)) clipped to [1, L]: a heavy tail, "
                              "about 2% at L"),
    "exponential": (_exponential, "ceil(exponential(mean L/4)) clipped to [1, L]"),
    "zipf": (_zipf, "P(len = k) proportional to 1/k on [1, L]: mostly short, median about sqrt(L)"),
}

# --preset name -> the arguments it sets (those given on the command line win)
PRESETS = {
    "gr-cross": {  # generative-recommender cross attention: 8 users x 1300 candidates, one query
        "description": "generative-recommender cross attention: 8 users x 1300 candidates (B 10400), "
                       "S_q 1, H 6, D 128, K/V histories of lognormal lengths up to 32768 keys",
        "B": [10400], "ratio": [1300], "S_q": [1], "H": [6], "D": [128], "L": [32768],
        "jagged": ["lognormal"],
    },
}


def draw_lengths(dist: str, n: int, L: int, rng) -> torch.Tensor:
    """int64 [n] key counts in [1, L] from the distribution ``dist`` of ``LENGTHS``."""
    if L < 1:
        raise ValueError(f"need L >= 1, got {L}")
    draw = LENGTHS[dist][0]
    return torch.from_numpy(np.clip(draw(n, L, rng), 1, L).astype(np.int64))


def kv_offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1]: 0 and the prefix sums of ``lengths`` (row r = packed rows offsets[r]:offsets[r + 1])."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths.long(), 0)
    if int(offsets[-1]) >= 2**31:
        raise ValueError(f"{int(offsets[-1])} keys in all: past int32 offsets")
    return offsets.to(torch.int32)


# --------------------------------------------------------------------------- workload

def attention_flops(B: int, H: int, S_q: int, L: int, D: int) -> int:
    """QK^T and PV: 2 GEMMs of 2 S_q L D FLOPs per candidate and head."""
    return 4 * B * H * S_q * L * D


def jagged_flops(cand_lengths, H: int, S_q: int, D: int) -> int:
    """The same with candidate b's own key count: 4 S_q H D sum_b len_b."""
    return 4 * H * S_q * D * int(torch.as_tensor(cand_lengths).long().sum())


@dataclasses.dataclass
class Problem:
    B: int
    ratio: int
    S_q: int
    L: int
    H: int
    D: int
    dtype: torch.dtype
    broadcast: str  # "kv": K/V per user; "q": Q per user
    order: str  # "sorted" or "shuffled"
    counts: list
    idx_cpu: torch.Tensor  # int32 [B]
    idx: torch.Tensor  # the same on the GPU
    scale: float
    cache: dict = dataclasses.field(default_factory=dict)  # shared derived tensors
    # jagged K/V (None: every K/V row has L keys): the length distribution's name, the key count
    # of each K/V row (U rows with K/V broadcast, B with Q broadcast; int64, CPU) and its offsets
    jagged: Optional[str] = None
    kv_lengths_cpu: Optional[torch.Tensor] = None
    kv_offsets_cpu: Optional[torch.Tensor] = None  # int32 [rows + 1]
    kv_offsets: Optional[torch.Tensor] = None  # the same on the GPU

    @property
    def U(self) -> int:
        return len(self.counts)

    @property
    def kv_rows(self) -> int:
        return self.U if self.broadcast == "kv" else self.B

    @property
    def cand_lengths(self) -> torch.Tensor:
        """int64 [B]: the keys each candidate attends to."""
        if self.jagged is None:
            return torch.full((self.B,), self.L, dtype=torch.long)
        return self.kv_lengths_cpu[self.idx_cpu.long()] if self.broadcast == "kv" else self.kv_lengths_cpu

    @property
    def total_keys(self) -> int:
        return self.kv_rows * self.L if self.jagged is None else int(self.kv_offsets_cpu[-1])

    @property
    def max_len(self) -> int:
        return self.L if self.jagged is None else int(self.kv_lengths_cpu.max())

    @property
    def flops(self) -> int:
        if self.jagged is None:
            return attention_flops(self.B, self.H, self.S_q, self.L, self.D)
        return jagged_flops(self.cand_lengths, self.H, self.S_q, self.D)

    def fields(self) -> dict:
        return {"B": self.B, "ratio": self.ratio, "U": self.U, "S_q": self.S_q, "L": self.L,
                "H": self.H, "D": self.D, "dtype": _dtype_name(self.dtype),
                "broadcast": self.broadcast, "order": self.order, "jagged": self.jagged,
                "total_keys": self.total_keys, "max_len": self.max_len,
                "mean_len": self.total_keys / self.kv_rows, "gflop": self.flops / 1e9}


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor  # [rows, L, H, D], or [total keys, H, D] packed when jagged
    v: torch.Tensor
    key_mask: Optional[torch.Tensor] = None  # jagged, padded per candidate: bool [B, max_len]

    def clone(self) -> "Inputs":
        return Inputs(self.q.clone(), self.k.clone(), self.v.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v))


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in harness.DTYPES.items()}[dtype]


def make_problem(B, ratio, S_q, L, H, D, dtype, broadcast, order, rng, device=None,
                 jagged: Optional[str] = None) -> Problem:
    """The candidates' users from ``rng`` and, when ``jagged`` names a distribution of ``LENGTHS``,
    then each K/V row's length (per user, or per candidate with ``broadcast`` "q")."""
    device = device or DEVICE
    counts = user_counts(B, ratio, rng)
    idx = make_idx(counts, order, rng)
    p = Problem(B, ratio, S_q, L, H, D, dtype, broadcast, order, counts, idx,
                idx.to(device), 1.0 / math.sqrt(D))
    if jagged is not None:
        p.jagged = jagged
        p.kv_lengths_cpu = draw_lengths(jagged, p.kv_rows, L, rng)
        p.kv_offsets_cpu = kv_offsets_of(p.kv_lengths_cpu)
        p.kv_offsets = p.kv_offsets_cpu.to(device)
    return p


def make_inputs(p: Problem, gen: torch.Generator, device=None) -> Inputs:
    nq = p.B if p.broadcast == "kv" else p.U
    kv_shape = (p.kv_rows, p.L) if p.jagged is None else (p.total_keys,)
    device = device or DEVICE

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(p.dtype)

    return Inputs(randn(nq, p.S_q, p.H, p.D), randn(*kv_shape, p.H, p.D), randn(*kv_shape, p.H, p.D))


def kv_row(p: Problem, inp: Inputs, r: int) -> tuple:
    """K and V of K/V row r: [L, H, D], or [len_r, H, D] (its own packed keys) when jagged."""
    if p.jagged is None:
        return inp.k[r], inp.v[r]
    start, end = int(p.kv_offsets_cpu[r]), int(p.kv_offsets_cpu[r + 1])
    return inp.k[start:end], inp.v[start:end]


# --------------------------------------------------------------------------- page table

@dataclasses.dataclass
class PageTable:
    pages: torch.Tensor  # int32 [B, pages per user]: candidate b -> pages of user idx[b]
    seqused_k: Optional[torch.Tensor]  # int32 [B] = L when L is not a multiple of the page
    page_size: int


def build_page_table(idx: torch.Tensor, L: int, page_size: int = PAGE_SIZE) -> PageTable:
    """Row b lists the pages of user idx[b] in K/V stored as [U * n, page_size, H, D]."""
    n = -(-L // page_size)
    pages = (idx.long()[:, None] * n + torch.arange(n, device=idx.device)[None, :]).to(torch.int32)
    seqused = None
    if L % page_size:
        seqused = torch.full((idx.numel(),), L, dtype=torch.int32, device=idx.device)
    return PageTable(pages.contiguous(), seqused, page_size)


def to_pages(x: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """[U, L, H, D] -> [U * ceil(L / page), page, H, D]: a view when L is a multiple of the page,
    else a copy padded with zeros (the padded keys are masked, but must be finite)."""
    U, L, H, D = x.shape
    n = -(-L // page_size)
    if n * page_size != L:
        padded = x.new_zeros(U, n * page_size, H, D)
        padded[:, :L] = x
        x = padded
    return x.reshape(U * n, page_size, H, D)


def run_paged(varlen_fn: Callable, q, k_pages, v_pages, table: PageTable, scale: float):
    """One candidate per batch entry, K/V through the page table. q [B, S_q, H, D]."""
    return varlen_fn(q, k_pages, v_pages, page_table=table.pages, seqused_k=table.seqused_k,
                     softmax_scale=scale)[0]


# --------------------------------------------------------------------------- varlen packing

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
        def move(t):
            return None if t is None else t.to(device)
        return dataclasses.replace(self, order=move(self.order), cu_seqlens_q=self.cu_seqlens_q.to(device),
                                   cu_seqlens_k=self.cu_seqlens_k.to(device), q_rows=move(self.q_rows))


def build_varlen_packing(idx: torch.Tensor, num_users: int, S_q: int, L: int,
                         kv_offsets: Optional[torch.Tensor] = None) -> Packing:
    """Sequence u = the queries of all candidates of user u (in candidate order: count_u * S_q
    rows, dense, for any S_q) against K/V row u: L keys, or kv_offsets[u]:kv_offsets[u + 1] of the
    packed keys when ``kv_offsets`` [U + 1] is given (jagged; max_seqlen_k is then the longest)."""
    idx = idx.long()
    is_sorted = bool((idx[1:] >= idx[:-1]).all()) if idx.numel() > 1 else True
    order = None if is_sorted else torch.argsort(idx, stable=True)
    counts = torch.bincount(idx, minlength=num_users)
    cu_q = torch.zeros(num_users + 1, dtype=torch.int32, device=idx.device)
    cu_q[1:] = torch.cumsum(counts * S_q, 0)
    if kv_offsets is None:
        cu_k, max_k = torch.arange(num_users + 1, dtype=torch.int32, device=idx.device) * L, L
    else:
        cu_k = kv_offsets.to(torch.int32)
        max_k = int((cu_k[1:] - cu_k[:-1]).max())
    return Packing(order, cu_q, cu_k, int(counts.max()) * S_q, max_k)


def build_candidate_packing(idx: torch.Tensor, kv_offsets: torch.Tensor, S_q: int) -> Packing:
    """Q broadcast, jagged K/V per candidate: sequence b = the S_q queries of user idx[b]
    (copied per candidate) against candidate b's keys kv_offsets[b]:kv_offsets[b + 1]."""
    B = idx.numel()
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=idx.device) * S_q
    cu_k = kv_offsets.to(torch.int32)
    return Packing(None, cu_q, cu_k, S_q, int((cu_k[1:] - cu_k[:-1]).max()), q_rows=idx.long())


def pack_queries(q: torch.Tensor, packing: Packing) -> torch.Tensor:
    """[B, S_q, H, D] -> [B * S_q, H, D] grouped by user (a view when idx is sorted); with
    ``q_rows``, [U, S_q, H, D] per user -> [B * S_q, H, D] per candidate (a copy)."""
    if packing.q_rows is not None:
        q = q.index_select(0, packing.q_rows)
    elif packing.order is not None:
        q = q.index_select(0, packing.order)
    return q.reshape(-1, *q.shape[2:])


def unpack_outputs(o: torch.Tensor, packing: Packing, B: int, S_q: int) -> torch.Tensor:
    """[B * S_q, H, D] grouped by user -> [B, S_q, H, D] in candidate order."""
    o = o.view(B, S_q, *o.shape[1:])
    if packing.order is None:
        return o
    return torch.empty_like(o).index_copy_(0, packing.order, o)


def run_varlen(varlen_fn: Callable, q, k, v, packing: Packing, scale: float):
    """q [B, S_q, H, D] per candidate (or [U, S_q, H, D] with ``q_rows``); k, v [U, L, H, D]
    per user, passed as [U * L, H, D] views, or already packed [total keys, H, D] (jagged)."""
    if k.dim() == 4:
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    o = varlen_fn(pack_queries(q, packing), k, v,
                  cu_seqlens_q=packing.cu_seqlens_q, cu_seqlens_k=packing.cu_seqlens_k,
                  max_seqlen_q=packing.max_seqlen_q, max_seqlen_k=packing.max_seqlen_k,
                  softmax_scale=scale)[0]
    S_q = q.shape[1]
    return unpack_outputs(o, packing, o.shape[0] // S_q, S_q)


# --------------------------------------------------------------------------- padding (jagged)

def padded_gather(kv_offsets: torch.Tensor, rows: torch.Tensor, max_len: int) -> tuple:
    """Per-candidate K/V padded to ``max_len`` keys, from packed rows: candidate b reads K/V row
    rows[b]. Returns (int64 [B, max_len]: the packed key at each position, the row's last key
    repeated past its length; bool [B, max_len]: the position is one of the row's keys)."""
    offsets = kv_offsets.long()
    start, n = offsets[rows], offsets[rows + 1] - offsets[rows]
    pos = torch.arange(max_len, device=offsets.device)[None, :]
    mask = pos < n[:, None]
    gather = start[:, None] + torch.minimum(pos, (n - 1).clamp(min=0)[:, None])
    return gather, mask


# --------------------------------------------------------------------------- reference check

def check_candidates(B: int, rng, n: int = CHECK_SAMPLE) -> torch.Tensor:
    """The first and the last candidate plus a random sample, sorted (int64, CPU)."""
    picked = set(rng.choice(B, size=min(n, B), replace=False).tolist()) | {0, B - 1}
    return torch.tensor(sorted(picked), dtype=torch.long)


def reference_outputs(p: Problem, inp: Inputs, cand: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """fp32 attention of the candidates ``cand`` [n] -> [n, S_q, H, D], one user group at a time
    (the shared side converted to fp32 once per user, at most ``chunk`` candidates at once).
    Jagged K/V: each candidate over its own keys (``kv_row``); with Q broadcast, one at a time."""
    out = torch.empty(len(cand), p.S_q, p.H, p.D, dtype=torch.float32, device=inp.q.device)
    users = p.idx_cpu.long()[cand]
    if p.broadcast == "q" and p.jagged is not None:
        chunk = 1  # every candidate has its own key count
    for u in torch.unique(users).tolist():
        where = torch.nonzero(users == u).flatten()
        if p.broadcast == "kv":
            k_u, v_u = (t.float() for t in kv_row(p, inp, u))
        else:
            q_u = inp.q[u].float()
        for part in torch.split(where, chunk):
            c = cand[part].to(inp.q.device)
            if p.broadcast == "kv":
                q, k, v = inp.q[c].float(), k_u.expand(len(c), *k_u.shape), v_u.expand(len(c), *v_u.shape)
            elif p.jagged is None:
                q, k, v = q_u.expand(len(c), *q_u.shape), inp.k[c].float(), inp.v[c].float()
            else:
                q = q_u[None]
                k, v = (t.float()[None] for t in kv_row(p, inp, int(c[0])))
            s = torch.einsum("nshd,nlhd->nhsl", q, k) * p.scale
            out[part.to(out.device)] = torch.einsum("nhsl,nlhd->nshd", torch.softmax(s, dim=-1), v)
    return out


# --------------------------------------------------------------------------- providers


@dataclasses.dataclass
class Provider:
    name: str
    setup: Callable[[Problem, Inputs], Any]  # -> state; raises Skip
    run: Callable[[Problem, Any, Inputs], Optional[torch.Tensor]]  # -> out [B, S_q, H, D]
    needs: str = ""  # "fa4" or "ikbo": skipped when that library is missing
    attention: bool = True  # False: not an attention (no check, no TFLOP/s)


class Libraries:
    fa4 = None  # flash_attn.cute module
    fa4_note: Optional[str] = None
    ikbo = None  # ikbo_fa module
    ikbo_note: Optional[str] = None


LIBS = Libraries()


def load_fa4() -> None:
    try:
        import flash_attn.cute as fa4
        LIBS.fa4 = fa4
    except Exception as e:
        LIBS.fa4_note = (f"flash-attn-4 not importable ({type(e).__name__}: {e}); FA4 providers "
                         f"skipped; `{harness.INSTALL_HINT}`")


def load_ikbo() -> None:
    LIBS.ikbo, LIBS.ikbo_note = harness.import_op("ikbo_fa", "attention")


def materialized_bytes(p: Problem) -> int:
    """Bytes of the per-candidate copy the materializing providers make: the broadcast side, or
    (jagged) K/V padded to the longest length with its gather index (int64) and key mask (bool),
    and Q too with Q broadcast."""
    row = p.H * p.D * torch.empty((), dtype=p.dtype).element_size()  # one key (or query) row
    if p.jagged is None:
        return p.B * row * (2 * p.L if p.broadcast == "kv" else p.S_q)
    q_copy = p.B * p.S_q * row if p.broadcast == "q" else 0
    return p.B * p.max_len * (2 * row + 8 + 1) + q_copy


def _check_room(p: Problem, inp: Inputs) -> None:
    """Raise Skip unless the materialized tensors fit in 80% of the free memory."""
    need = materialized_bytes(p)
    if inp.q.is_cuda:
        free, _ = torch.cuda.mem_get_info(inp.q.device)
        if need > 0.8 * free:
            raise Skip(f"materialized tensors need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")


def _padding(p: Problem) -> tuple:
    """Jagged: (gather [B, max_len], key mask [B, max_len]) on the device, built once per problem."""
    if "padding" not in p.cache:
        rows = p.idx.long() if p.broadcast == "kv" else torch.arange(p.B, device=p.idx.device)
        p.cache["padding"] = padded_gather(p.kv_offsets, rows, p.max_len)
    return p.cache["padding"]


def _materialized(p: Problem, inp: Inputs) -> Inputs:
    """Per-candidate q, k, v: the broadcast side copied with idx (built once per problem); jagged,
    K/V padded to the longest length, with the key mask."""
    if "materialized" not in p.cache:
        _check_room(p, inp)
        idx = p.idx.long()
        if p.jagged is not None:
            gather, mask = _padding(p)
            q = inp.q if p.broadcast == "kv" else inp.q[idx]
            p.cache["materialized"] = Inputs(q, inp.k[gather], inp.v[gather], key_mask=mask)
        elif p.broadcast == "kv":
            p.cache["materialized"] = Inputs(inp.q, inp.k[idx], inp.v[idx])
        else:
            p.cache["materialized"] = Inputs(inp.q[idx], inp.k, inp.v)
    return p.cache["materialized"]


def _materialize_into(p: Problem, buf: Inputs, inp: Inputs) -> Inputs:
    """The timed copy: broadcast side of ``inp`` gathered into the buffers of ``buf`` (jagged:
    the padded K/V, and Q with Q broadcast)."""
    if p.jagged is not None:
        gather = _padding(p)[0].flatten()
        torch.index_select(inp.k, 0, gather, out=buf.k.view(-1, *inp.k.shape[1:]))
        torch.index_select(inp.v, 0, gather, out=buf.v.view(-1, *inp.v.shape[1:]))
        q = inp.q if p.broadcast == "kv" else torch.index_select(inp.q, 0, p.idx, out=buf.q)
        return Inputs(q, buf.k, buf.v, key_mask=buf.key_mask)
    if p.broadcast == "kv":
        torch.index_select(inp.k, 0, p.idx, out=buf.k)
        torch.index_select(inp.v, 0, p.idx, out=buf.v)
        return Inputs(inp.q, buf.k, buf.v)
    torch.index_select(inp.q, 0, p.idx, out=buf.q)
    return Inputs(buf.q, inp.k, inp.v)


def _dense_args(p: Problem, st: Inputs, inp: Inputs) -> Inputs:
    """Kernel-only providers: the candidate side from ``inp`` (rotated), the copy from ``st``
    (jagged with Q broadcast: all from ``st``, both sides being copies)."""
    if p.jagged is not None:
        return dataclasses.replace(st, q=inp.q) if p.broadcast == "kv" else st
    return Inputs(inp.q, st.k, st.v) if p.broadcast == "kv" else Inputs(st.q, inp.k, inp.v)


def _kv_only(p: Problem, what: str) -> None:
    if p.broadcast != "kv":
        raise Skip(f"{what} applies to K/V broadcast only")


def _dense_only(p: Problem, what: str) -> None:
    if p.jagged is not None:
        raise Skip(f"{what} takes no per-candidate key lengths here (jagged K/V: see fa4 varlen packed)")


def _fa4_materialized_setup(p: Problem, inp: Inputs) -> Inputs:
    _dense_only(p, "FA4's dense kernel")
    return _materialized(p, inp)


def _fa4_dense(x: Inputs, scale: float):
    return LIBS.fa4.flash_attn_func(x.q, x.k, x.v, softmax_scale=scale)[0]


def _sdpa(x: Inputs, scale: float):
    """SDPA on [B, S, H, D] tensors; a key mask [B, L] (jagged, padded) hides the padding."""
    mask = None if x.key_mask is None else x.key_mask[:, None, None, :]
    o = torch.nn.functional.scaled_dot_product_attention(
        x.q.transpose(1, 2), x.k.transpose(1, 2), x.v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def materialize_sdpa(broadcast: str, scale: float) -> Callable:
    """The copy and SDPA on plain tensors (q, k, v, idx) -> [B, S_q, H, D], for torch.compile.
    Jagged: also (gather, key mask) of ``padded_gather``; k, v are then packed [keys, H, D]."""
    def run(q, k, v, idx, gather=None, key_mask=None):
        mask = None
        if gather is not None:
            B, n = gather.shape
            k = k.index_select(0, gather.flatten()).view(B, n, *k.shape[1:])
            v = v.index_select(0, gather.flatten()).view(B, n, *v.shape[1:])
            mask = key_mask[:, None, None, :]
            if broadcast == "q":
                q = q.index_select(0, idx)
        elif broadcast == "kv":
            k, v = k.index_select(0, idx), v.index_select(0, idx)
        else:
            q = q.index_select(0, idx)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        return o.transpose(1, 2)
    return run


def _compiled_sdpa_setup(p: Problem, inp: Inputs):
    _check_room(p, inp)  # each call makes the copy
    padding = _padding(p) if p.jagged is not None else ()
    return harness.torch_compiled(materialize_sdpa(p.broadcast, p.scale)), padding


def _compiled_sdpa_run(p: Problem, st, inp: Inputs):
    fn, padding = st
    return fn(inp.q, inp.k, inp.v, p.idx, *padding)


def _paged_setup(p: Problem, inp: Inputs):
    _kv_only(p, "the page table")
    _dense_only(p, "the page table")
    table = build_page_table(p.idx, p.L)
    pages = None if p.L % PAGE_SIZE == 0 else (to_pages(inp.k), to_pages(inp.v))  # padded copy
    return table, pages


def _paged_run(p: Problem, st, inp: Inputs):
    table, pages = st
    kp, vp = pages if pages is not None else (to_pages(inp.k), to_pages(inp.v))
    return run_paged(LIBS.fa4.flash_attn_varlen_func, inp.q, kp, vp, table, p.scale)


def _varlen_setup(p: Problem, inp: Inputs):
    if p.jagged is not None and p.broadcast == "q":
        return build_candidate_packing(p.idx_cpu, p.kv_offsets_cpu, p.S_q).to(inp.q.device)
    _kv_only(p, "varlen packing")
    return build_varlen_packing(p.idx_cpu, p.U, p.S_q, p.L, kv_offsets=p.kv_offsets_cpu).to(inp.q.device)


def _ikbo_setup(p: Problem, inp: Inputs):
    if p.jagged is not None:
        try:
            params = inspect.signature(LIBS.ikbo.attention).parameters
        except (TypeError, ValueError):  # no signature to read: let the call tell
            return None
        if "kv_offsets" not in params:
            raise Skip("ikbo_fa.attention takes no kv_offsets yet (jagged K/V)")
    return None


def _ikbo_run(p: Problem, st, inp: Inputs):
    jagged = {} if p.jagged is None else {"kv_offsets": p.kv_offsets, "max_kv_len": p.max_len}
    return LIBS.ikbo.attention(inp.q, (inp.k, inp.v), p.idx, scale=p.scale, broadcast=p.broadcast, **jagged)


def _ikbo_reused_setup(p: Problem, inp: Inputs):
    """The work list of p's idx, built once and untimed, as FA4 varlen's packing is."""
    _ikbo_setup(p, inp)
    if not hasattr(LIBS.ikbo, "work_list"):
        raise Skip("ikbo_fa has no work_list")
    if p.broadcast != "kv":
        raise Skip("K/V broadcast only: a work list groups the candidates by user")
    jagged = {} if p.jagged is None else {"kv_offsets": p.kv_offsets, "max_kv_len": p.max_len}
    return LIBS.ikbo.work_list(p.idx, p.U, p.S_q, **jagged)


def _ikbo_reused_run(p: Problem, wl, inp: Inputs):
    jagged = {} if p.jagged is None else {"kv_offsets": p.kv_offsets, "max_kv_len": p.max_len}
    return LIBS.ikbo.attention(inp.q, (inp.k, inp.v), p.idx, scale=p.scale, broadcast=p.broadcast, work_list=wl,
                               **jagged)


def parse_variant(spec: str) -> dict:
    """``NAME=VALUE[,NAME=VALUE...]`` -> launch flags of ikbo_fa.attention and their values (flags
    the op reads when it builds a plan, e.g. ``_SPLIT_PAIR=0``); an unknown name raises ValueError."""
    import importlib

    mod = importlib.import_module("ikbo_fa.attention")
    flags = {}
    for pair in spec.split(","):
        name, _, value = pair.strip().partition("=")
        if not name.startswith("_") or not hasattr(mod, name) or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"variant {spec!r}: {pair!r} is not NAME=INTEGER for a flag of ikbo_fa.attention")
        flags[name] = type(getattr(mod, name))(int(value))
    return flags


def with_flags(flags: dict, fn: Callable):
    """fn() with ikbo_fa.attention's launch flags set (restored after; the op keys its plans by them)."""
    import importlib

    mod = importlib.import_module("ikbo_fa.attention")
    old = {name: getattr(mod, name) for name in flags}
    for name, value in flags.items():
        setattr(mod, name, value)
    try:
        return fn()
    finally:
        for name, value in old.items():
            setattr(mod, name, value)


def variant_provider(spec: str) -> Provider:
    """ikbo with launch flags set (``parse_variant``), named ``ikbo SPEC``: an A/B of the op's
    choices in the same run as the default and the peers."""
    flags = parse_variant(spec)
    return Provider(f"ikbo {spec}", _ikbo_setup, lambda p, st, i: with_flags(flags, lambda: _ikbo_run(p, st, i)),
                    needs="ikbo")


def display_index(name: str) -> int:
    """A provider's place in tables: DISPLAY_ORDER, variants of ikbo right after ikbo."""
    if name.startswith("ikbo "):
        return DISPLAY_ORDER.index("ikbo")
    return DISPLAY_ORDER.index(name)


def providers() -> list:
    """In check order: peers first, ikbo last (a failure there cannot spoil the peers' checks)."""
    return [
        Provider("materialize", lambda p, i: _materialized(p, i),
                 lambda p, st, i: _materialize_into(p, st, i), attention=False),
        Provider("fa4 varlen packed", _varlen_setup,
                 lambda p, st, i: run_varlen(LIBS.fa4.flash_attn_varlen_func, i.q, i.k, i.v, st, p.scale),
                 needs="fa4"),
        Provider("fa4 page table", _paged_setup, _paged_run, needs="fa4"),
        Provider("fa4 materialized", _fa4_materialized_setup,
                 lambda p, st, i: _fa4_dense(_dense_args(p, st, i), p.scale), needs="fa4"),
        Provider("fa4 materialize+kernel", _fa4_materialized_setup,
                 lambda p, st, i: _fa4_dense(_materialize_into(p, st, i), p.scale), needs="fa4"),
        Provider("sdpa materialized", lambda p, i: _materialized(p, i),
                 lambda p, st, i: _sdpa(_dense_args(p, st, i), p.scale)),
        Provider("torch.compile materialize+sdpa", _compiled_sdpa_setup, _compiled_sdpa_run),
        Provider("ikbo", _ikbo_setup, _ikbo_run, needs="ikbo"),
        Provider("ikbo, work list reused", _ikbo_reused_setup, _ikbo_reused_run, needs="ikbo"),
    ]


DISPLAY_ORDER = ["ikbo", "ikbo, work list reused", "fa4 varlen packed", "fa4 page table", "fa4 materialized",
                 "fa4 materialize+kernel", "sdpa materialized", "torch.compile materialize+sdpa", "materialize"]


def _missing_library(prov: Provider) -> Optional[str]:
    if prov.needs == "fa4" and LIBS.fa4 is None:
        return "flash-attn-4 missing"
    if prov.needs == "ikbo" and LIBS.ikbo is None:
        return LIBS.ikbo_note or "ikbo_fa.attention missing"
    return None


# --------------------------------------------------------------------------- one configuration


def run_problem(p: Problem, inp: Inputs, provs: list, args, ceiling: float, rng) -> list:
    """Check every provider, then time those that passed in turns; one row per provider.

    Raises ContextLost (carrying the rows so far) after a sticky CUDA error."""
    cand = check_candidates(p.B, rng)
    ref = reference_outputs(p, inp, cand)
    n_rot = harness.rotation_count(inp.nbytes(), harness.l2_bytes())
    sets = [inp] + [inp.clone() for _ in range(n_rot - 1)]

    def rel_error_of(prov, out):
        if not prov.attention:
            return None
        if out is None or tuple(out.shape) != (p.B, p.S_q, p.H, p.D):
            return math.inf
        return harness.rel_error(out[cand.to(out.device)].float(), ref)

    harness.reset_compiled()
    rows, timed = harness.check_providers(provs, p, inp, fields=p.fields(), rel_error_of=rel_error_of,
                                          tol=args.tol, skip_note=_missing_library, device=DEVICE)
    timed = harness.time_checked(timed, rows, rotate=sets, device=DEVICE, **harness.timing_options(args))
    modes = harness.timing_modes(args.timing)
    if "interleaved" in modes and "graph" not in modes:  # graph replays of the short calls, in
        # turns, beside the plain ones (the graph mode replays every call: "ms_graph")
        short = {n: fn for n, (row, fn) in timed.items() if row["ms"] < args.graph_below_ms}
        for name, ms in harness.bench_graph_interleaved(short, rep=args.rep, rotate=sets).items():
            timed[name][0]["graph_ms"] = ms
            if ms is None:
                timed[name][0]["note"] = "CUDA graph capture failed"
    timed.clear()
    attention = {prov.name for prov in provs if prov.attention}
    for s in harness.mode_suffixes(args.timing):  # ratios within each timing mode
        ikbo_ms = next((r.get("ms" + s) for r in rows if r["provider"] == "ikbo"), None)
        for r in rows:
            ms = r.get("ms" + s)
            if not ms or r["provider"] not in attention:
                continue
            r["tflops" + s] = harness.tflops(p.flops, ms)
            r["pct_cublas" + s] = 100.0 * r["tflops" + s] / ceiling
            if ikbo_ms and r["provider"] != "ikbo":
                r["ikbo_speedup" + s] = ms / ikbo_ms
    rows.sort(key=lambda r: display_index(r["provider"]))
    p.cache.clear()
    return rows


def host_overheads(args, provs: list, dtype: torch.dtype, broadcast: str,
                   jagged: Optional[str] = None, H: int = 2, D: int = 128) -> dict:
    """CPU microseconds per call on a tiny problem (B = 4, ratio 2, L = 128; jagged lengths <= 128)
    with H heads of dimension D."""
    harness.reset_compiled()
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    p = make_problem(4, 2, args.S_q[0] if args.S_q else PUBLISHED["S_q"], 128, H, D,
                     dtype, broadcast, "sorted", rng, jagged=jagged)
    inp = make_inputs(p, gen)
    result = {}
    for prov in provs:
        if _missing_library(prov):
            continue
        try:
            st = prov.setup(p, inp)
            result[prov.name] = harness.host_overhead_us(lambda: prov.run(p, st, inp), iters=100)
        except Exception as e:
            if context_lost(DEVICE):
                raise ContextLost(f"{prov.name}: {short_error(e)}", []) from e
            result[prov.name] = None
    return result


# --------------------------------------------------------------------------- configurations

def build_configs(args) -> tuple[list, dict]:
    """Unique configurations in run order, and sweep label -> its configuration keys
    (B, ratio, S_q, L, dtype, broadcast, order, jagged, H, D). A label starts with the sweep's
    name (``SWEEPS``), then " at L=..." when the sweep runs at several L, then (dtype, broadcast,
    order[, jagged distribution][, H=.. D=..]); H and D appear only when several of either are
    given, so that a run of one H and one D keeps its labels."""
    def first(name, default):
        vals = getattr(args, name)
        return vals[0] if vals else default

    keys, sweeps = [], {}
    if not args.sweep:
        grid = [getattr(args, n) or ([PUBLISHED[n]] if n != "L" else PUBLISHED["L"])
                for n in ("L", "ratio", "B", "S_q")]
        points = [dict(zip(("L", "ratio", "B", "S_q"), v)) for v in itertools.product(*grid)]
        varied = [n for n, g in zip(("L", "ratio", "B", "S_q"), grid) if len(g) > 1] or ["L"]
        named = {varied[0]: points}
    else:
        named = {}
        for name in args.sweep:
            sweep = SWEEPS[name]
            values = getattr(args, sweep.var) or sweep.values
            at_L = [None] if sweep.var == "L" else (args.L or list(sweep.L))
            for L in at_L:
                base = {"L": L, "ratio": first("ratio", PUBLISHED["ratio"]),
                        "B": first("B", PUBLISHED["B"]), "S_q": first("S_q", PUBLISHED["S_q"])}
                label = name if len(at_L) == 1 else f"{name} at L={L}"
                named[label] = [{**base, sweep.var: v} for v in values]
    jagged = args.jagged or [None]
    shapes = len(args.H) > 1 or len(args.D) > 1
    for name, points in named.items():
        for point in points:
            for dtype, order, bc, jag, H, D in itertools.product(args.dtype, args.order, args.broadcast, jagged,
                                                                 args.H, args.D):
                key = (point["B"], point["ratio"], point["S_q"], point["L"], dtype, bc, order, jag, H, D)
                label = (f"{name} ({dtype}, {bc}, {order}{'' if jag is None else ', jagged ' + jag}"
                         f"{f', H={H} D={D}' if shapes else ''})")
                if key not in sweeps.setdefault(label, []):
                    sweeps[label].append(key)
                if key not in keys:
                    keys.append(key)
    return keys, sweeps


def sweep_var(label: str) -> str:
    """The row field a sweep label of ``build_configs`` varies."""
    name = label.split()[0]
    return SWEEPS[name].var if name in SWEEPS else name


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="compare_fa4.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", nargs="+", choices=sorted(SWEEPS),
                    help="one-variable sweeps around the published point, each at its L (1024; "
                         "S_q_fine: 1024 and 8192) or at every --L; without it, the product of the "
                         "lists below")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="a named shape (gr-cross: B 10400 = 8 users x 1300, S_q 1, H 6, D 128, "
                         "lognormal lengths <= 32768); options given as well win")
    ap.add_argument("--L", type=int, nargs="+",
                    help="keys per user (default 512 ... 16384); with --jagged, the longest")
    ap.add_argument("--ratio", type=int, nargs="+", help="candidates per user (default 64, +-1)")
    ap.add_argument("--B", type=int, nargs="+", help="candidates (default 2048)")
    ap.add_argument("--S-q", dest="S_q", type=int, nargs="+", help="queries per candidate (default 64)")
    ap.add_argument("--jagged", nargs="+", choices=sorted(LENGTHS), metavar="DIST",
                    help="K/V rows of lengths in [1, L] drawn from DIST, packed with kv_offsets: "
                         + "; ".join(f"{k}: {v[1]}" for k, v in LENGTHS.items()).replace("%", "%%"))
    ap.add_argument("--H", type=int, nargs="+", help="heads (default 2); several: each point at each")
    ap.add_argument("--D", type=int, nargs="+", help="head dimension (default 128); several: each point at each")
    ap.add_argument("--dtype", nargs="+", choices=sorted(harness.DTYPES), default=["bf16"])
    ap.add_argument("--broadcast", nargs="+", choices=["kv", "q"], default=["kv"],
                    help="kv: K/V per user (default); q: Q per user, K/V per candidate")
    ap.add_argument("--order", nargs="+", choices=["sorted", "shuffled"], default=["sorted"],
                    help="candidates grouped by user, or shuffled")
    ap.add_argument("--providers", nargs="+", metavar="NAME",
                    help=f"subset of: {', '.join(DISPLAY_ORDER)}")
    ap.add_argument("--variant", nargs="+", default=[], metavar="NAME=VALUE[,...]",
                    help="also time ikbo with launch flags of ikbo_fa.attention set, one provider "
                         "'ikbo SPEC' per SPEC (e.g. _SPLIT_PAIR=0 _SPLIT_PAIR=0,_SPLIT_MIN_KEYS=1024); "
                         "its ikbo_speedup is its time over the default's")
    ap.add_argument("--tol", type=float, default=1e-2, help="max relative error against fp32")
    ap.add_argument("--graph-below-ms", type=float, default=1.0,
                    help="also time CUDA-graph replays of calls faster than this")
    ap.add_argument("--no-plot", action="store_true")
    harness.add_common_args(ap)
    harness.add_timing_args(ap, default="both")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset] if args.preset else {}
    for name, default in (("B", None), ("ratio", None), ("S_q", None), ("L", None), ("jagged", None),
                          ("H", [2]), ("D", [128])):
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    if args.providers:
        unknown = sorted(set(args.providers) - set(DISPLAY_ORDER))
        if unknown:
            ap.error(f"unknown provider(s) {unknown}; choose from {DISPLAY_ORDER}")
    return args


def run_settings(args) -> dict:
    """What the JSON's "settings" records besides the timing: H and D (lists), the preset and the
    length distributions."""
    settings = {"tol": args.tol, "page_size": PAGE_SIZE, "graph_below_ms": args.graph_below_ms,
                "H": args.H, "D": args.D, "preset": None, "jagged": None}
    if args.preset:
        settings["preset"] = {"name": args.preset, **PRESETS[args.preset]}
    if args.jagged:
        settings["jagged"] = {name: LENGTHS[name][1] for name in args.jagged}
    return settings


# --------------------------------------------------------------------------- output

TABLE_COLUMNS = ["provider", "status", "rel_err", "first_call_s"]
PLOT_COLUMNS = 8  # sweeps side by side in the PNG; more wrap onto further rows
TIMED_COLUMNS = ["ms", "graph_ms", "tflops", "pct_cublas", "ikbo_speedup"]  # per timing mode


def problem_title(p: Problem) -> str:
    f = p.fields()
    keys = (f"L={f['L']}" if p.jagged is None else
            f"L<={f['L']} jagged={p.jagged} max_len={f['max_len']} mean_len={f['mean_len']:.0f}")
    return (f"B={f['B']} ratio={f['ratio']} (U={f['U']}) S_q={f['S_q']} {keys} keys={f['total_keys']} "
            f"H={f['H']} D={f['D']} {f['dtype']} broadcast={f['broadcast']} {f['order']}  "
            f"[{p.flops / 1e9:.1f} GFLOP; ikbo_speedup = peer ms / ikbo ms, in the same timing]")


def print_problem(p: Problem, rows: list, timing: str) -> None:
    harness.print_rows(problem_title(p), rows, TABLE_COLUMNS, TIMED_COLUMNS, timing)


def summary(rows: list, sweeps: dict, mode: str = "interleaved") -> None:
    s = harness.SUFFIX[mode]
    print(f"\nTFLOP/s (eager, {mode}):")
    for name, keys in sweeps.items():
        x = sweep_var(name)
        jagged = "jagged" in name
        table = []
        for key in keys:
            sel = [r for r in rows if _key(r) == key]
            line = {x: sel[0][x] if sel else None}
            if jagged and sel:
                line.update(total_keys=sel[0]["total_keys"], max_len=sel[0]["max_len"])
            for r in sel:
                if r["provider"] != "materialize":
                    line[r["provider"]] = r.get("tflops" + s) if r["status"] == "ok" else r["status"]
                else:
                    line["materialize ms"] = r.get("ms" + s)
            table.append(line)
        cols = [x] + (["total_keys", "max_len"] if jagged else [])
        names = sorted({r["provider"] for r in rows}, key=lambda n: (display_index(n), n))
        cols += [c for c in names if c != "materialize" and any(c in t for t in table)]
        if any("materialize ms" in t for t in table):
            cols.append("materialize ms")
        print(f"sweep {name}")
        harness.print_table(table, cols)


def _key(r: dict) -> tuple:
    return (r["B"], r["ratio"], r["S_q"], r["L"], r["dtype"], r["broadcast"], r["order"], r.get("jagged"), r["H"],
            r["D"])


def plot(rows: list, sweeps: dict, ceilings: dict, path: Path, mode: str = "interleaved") -> Optional[str]:
    """TFLOP/s against the swept variable, one line per provider, and ikbo's speedup below, in the
    timing ``mode``."""
    s = harness.SUFFIX[mode]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped"
    # A sweep per column, wrapped after PLOT_COLUMNS (an H x D x dtype product makes dozens)
    cols = min(len(sweeps), PLOT_COLUMNS)
    grid_rows = -(-len(sweeps) // cols)
    fig, axes = plt.subplots(2 * grid_rows, cols, figsize=(6 * cols, 8 * grid_rows), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] * grid_rows})
    for i in range(len(sweeps), grid_rows * cols):
        row, col = divmod(i, cols)
        axes[2 * row][col].set_visible(False)
        axes[2 * row + 1][col].set_visible(False)
    for i, (name, keys) in enumerate(sweeps.items()):
        x_name = sweep_var(name)
        row, col = divmod(i, cols)
        top, bottom = axes[2 * row][col], axes[2 * row + 1][col]
        bottom.sharex(top)
        top.tick_params(labelbottom=False)
        xs = sorted({r[x_name] for k in keys for r in rows if _key(r) == k})
        for color, prov in enumerate(DISPLAY_ORDER):  # one color per provider in both panels
            sel = [r for k in keys for r in rows if _key(r) == k and r["provider"] == prov]
            pts = [(r[x_name], r["tflops" + s]) for r in sel if r.get("tflops" + s)]
            if pts:
                top.plot(*zip(*pts), marker="o", label=prov, color=f"C{color}",
                         linewidth=2.5 if prov == "ikbo" else 1.2)
            sp = [(r[x_name], r["ikbo_speedup" + s]) for r in sel if r.get("ikbo_speedup" + s)]
            if sp:
                bottom.plot(*zip(*sp), marker="o", label=f"vs {prov}", color=f"C{color}")
        dtype = name.split("(")[1].split(",")[0]
        if dtype in ceilings:
            top.axhline(ceilings[dtype], color="gray", linestyle="--", label=f"cuBLAS {dtype} GEMM")
        top.set_title(f"{name}, {mode}")
        top.set_ylabel("TFLOP/s")
        top.grid(alpha=0.3)
        top.legend(fontsize=8)
        bottom.axhline(1.0, color="gray", linewidth=0.8)
        bottom.set_ylabel("ikbo speedup (peer ms / ikbo ms)")
        bottom.set_xlabel(x_name)
        bottom.grid(alpha=0.3)
        if bottom.lines[1:]:
            bottom.legend(fontsize=8)
        for ax in (top, bottom):
            if xs and min(xs) > 0 and max(xs) >= 16 * min(xs):
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main

@torch.no_grad()  # inference: no autograd bookkeeping in any provider
def main(argv=None) -> int:
    args = parse_args(argv)
    harness.start_benchmark(NAME)
    load_fa4()
    load_ikbo()
    for note in (LIBS.fa4_note, LIBS.ikbo_note):
        if note:
            print(f"{NAME}: {note}", flush=True)
    provs = [pr for pr in providers() if not args.providers or pr.name in args.providers]
    if LIBS.ikbo is not None:
        provs += [variant_provider(spec) for spec in args.variant]
    keys, sweeps = build_configs(args)
    env = harness.environment()
    harness.print_environment(env, ("nvidia-cutlass-dsl", "flash-attn-4"))
    ceilings = harness.ceilings_tflops(k[4] for k in keys)
    bandwidth = harness.copy_bandwidth_tbps()
    print(f"device copy bandwidth: {bandwidth:.2f} TB/s", flush=True)

    stamp = harness.utc_stamp()
    payload = {"benchmark": NAME, "argv": sys.argv[1:] if argv is None else list(argv),
               "environment": env, "ceiling_tflops": ceilings, "copy_tbps": bandwidth,
               "settings": {**harness.timing_settings(args), **run_settings(args)},
               "notes": [n for n in (LIBS.fa4_note, LIBS.ikbo_note) if n], "rows": []}
    start = time.perf_counter()
    try:
        for (B, ratio, S_q, L, dt, bc, order, jagged, H, D) in keys:
            rng = np.random.default_rng(args.seed)
            gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
            p = make_problem(B, ratio, S_q, L, H, D, harness.DTYPES[dt], bc, order, rng, jagged=jagged)
            inp = make_inputs(p, gen)
            rows = run_problem(p, inp, provs, args, ceilings[dt], rng)
            print_problem(p, rows, args.timing)
            payload["rows"] += rows
            harness.write_results(NAME, payload, args.out_dir, stamp)  # partial results survive a crash
            del inp, p
            torch.cuda.empty_cache()
        first = keys[0]
        payload["host_overhead_us"] = host_overheads(args, provs, harness.DTYPES[first[4]], first[5],
                                                     first[7], first[8], first[9])
    except ContextLost as e:
        harness.note_lost_context(NAME, payload, e)
    payload["seconds"] = time.perf_counter() - start
    if payload.get("host_overhead_us"):
        jagged = f", jagged {keys[0][7]}" if keys[0][7] else ""
        shape = f", H={keys[0][8]} D={keys[0][9]}" if len(args.H) > 1 or len(args.D) > 1 else ""
        print(f"\nhost time per call, tiny problem (B=4, ratio 2, L=128{jagged}{shape}):")
        harness.print_table([{"provider": k, "us": v} for k, v in payload["host_overhead_us"].items()],
                            ["provider", "us"])
    done = {_key(r) for r in payload["rows"]}
    sweeps = {n: [k for k in ks if k in done] for n, ks in sweeps.items()}
    sweeps = {n: ks for n, ks in sweeps.items() if ks}
    for mode in harness.timing_modes(args.timing) if sweeps else []:
        summary(payload["rows"], sweeps, mode)
    json_path = harness.write_results(NAME, payload, args.out_dir, stamp)
    print(f"\nresults: {json_path}")
    if not args.no_plot and sweeps:
        png, latest = harness.result_paths(NAME, ".png", args.out_dir, stamp)
        note = plot(payload["rows"], sweeps, ceilings, png, harness.timing_modes(args.timing)[0])
        if note:
            print(f"{NAME}: {note}")
        else:
            latest.write_bytes(png.read_bytes())
            print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
