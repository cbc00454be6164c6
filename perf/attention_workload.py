"""The attention benchmarks' workload: who each candidate's user is, the key count of each K/V
row (jagged), the random inputs, their FLOPs and the fp32 reference of a sample of candidates.

K/V broadcast: B candidates, U users, idx[b] = the user of candidate b; q [B, S_q, H, D] per
candidate, k, v [U, L, H, D] per user; out[b] = softmax(scale * q[b] k[idx[b]]^T) v[idx[b]].
``broadcast`` "q" swaps the roles: q [U, S_q, H, D] per user, k, v [B, L, H, D] per candidate.
Jagged K/V: every K/V row r has its own length len_r in [1, L] (``LENGTHS``), packed as
[sum len_r, H, D] with kv_offsets [rows + 1] int32.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch

from perf.harness import DTYPES, make_idx, user_counts

CHECK_SAMPLE = 32  # random candidates checked besides the first and the last


def _zipf(n, L, rng, median):
    cdf = np.cumsum(1.0 / np.arange(1, L + 1))
    return np.searchsorted(cdf / cdf[-1], rng.random(n), side="right") + 1


# name -> (draw(n, L, rng, median), what it draws); every draw is then clipped to [1, L]
LENGTHS = {
    "uniform": (lambda n, L, rng, median: rng.integers(1, L + 1, size=n), "uniform on [1, L]"),
    "lognormal": (lambda n, L, rng, median: np.ceil(rng.lognormal(math.log(median or L / 8), 1, n)),
                  "ceil(lognormal(median L/8, sigma 1)) clipped to [1, L]: a heavy tail, about 2% "
                  "at L; lognormal:M has median M"),
    "exponential": (lambda n, L, rng, median: np.ceil(rng.exponential(L / 4, size=n)),
                    "ceil(exponential(mean L/4)) clipped to [1, L]"),
    "zipf": (_zipf, "P(len = k) proportional to 1/k on [1, L]: mostly short, median about sqrt(L)"),
    "equal": (lambda n, L, rng, median: np.full(n, L),
              "every row L keys, as kv_offsets: the padded layout's keys, jagged"),
}


def length_spec(spec: str) -> tuple[str, Optional[float]]:
    """``NAME`` or ``lognormal:MEDIAN`` -> (name, median or None); ValueError naming the choices."""
    name, sep, median = spec.partition(":")
    if name not in LENGTHS or (sep and name != "lognormal"):
        raise ValueError(f"length distribution {spec!r}: choose from {sorted(LENGTHS)} (lognormal:MEDIAN too)")
    if not sep:
        return name, None
    try:
        value = float(median)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"length distribution {spec!r}: the median must be a positive number")
    return name, value


def draw_lengths(dist: str, n: int, L: int, rng) -> torch.Tensor:
    """int64 [n] key counts in [1, L] from the distribution ``dist`` (``length_spec``)."""
    if L < 1:
        raise ValueError(f"need L >= 1, got {L}")
    name, median = length_spec(dist)
    return torch.from_numpy(np.clip(LENGTHS[name][0](n, L, rng, median), 1, L).astype(np.int64))


def kv_offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [n + 1]: 0 and the prefix sums of ``lengths`` (row r = packed rows offsets[r]:offsets[r + 1])."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths.long(), 0)
    if int(offsets[-1]) >= 2**31:
        raise ValueError(f"{int(offsets[-1])} keys in all: past int32 offsets")
    return offsets.to(torch.int32)


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
                "H": self.H, "D": self.D, "dtype": {v: k for k, v in DTYPES.items()}[self.dtype],
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


def make_problem(B, ratio, S_q, L, H, D, dtype, broadcast, order, rng, device="cuda",
                 jagged: Optional[str] = None) -> Problem:
    """The candidates' users from ``rng`` and, when ``jagged`` names a distribution of ``LENGTHS``,
    then each K/V row's length (per user, or per candidate with ``broadcast`` "q")."""
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


def make_inputs(p: Problem, gen: torch.Generator, device="cuda") -> Inputs:
    nq = p.B if p.broadcast == "kv" else p.U
    kv_shape = (p.kv_rows, p.L) if p.jagged is None else (p.total_keys,)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(p.dtype)

    return Inputs(randn(nq, p.S_q, p.H, p.D), randn(*kv_shape, p.H, p.D), randn(*kv_shape, p.H, p.D))


def kv_row(p: Problem, inp: Inputs, r: int) -> tuple:
    """K and V of K/V row r: [L, H, D], or [len_r, H, D] (its own packed keys) when jagged."""
    if p.jagged is None:
        return inp.k[r], inp.v[r]
    start, end = int(p.kv_offsets_cpu[r]), int(p.kv_offsets_cpu[r + 1])
    return inp.k[start:end], inp.v[start:end]


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
