"""Static configurations of the attention kernel: the compile key, the shipped set, and the compile.

A configuration is everything that changes the generated code; a problem picks its own
(``kernel_config``) and the op compiles it at first use (``cute_kernels.kernel_cache``).
"""
from __future__ import annotations

import dataclasses
import math

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
DIRECTIONS = ("kv", "q")
# Split-KV: the most CTAs one row's keys go over (the merge kernel unrolls its loads to it).
MAX_SPLITS = 8


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Everything that changes the generated code (the compile key)."""

    dtype: torch.dtype  # torch.float16 | torch.bfloat16
    head_dim: int  # 64 | 128
    s_q: int  # query rows per candidate (any >= 1)
    direction: str  # "kv": K/V looked up by idx; "q": Q looked up by idx
    has_kv_lengths: bool
    return_lse: bool
    # Issue S of block j before P V of block j-1, the two consumer warpgroups taking turns
    # (False: one block at a time, no turns; a diagnostic configuration, never picked by the op).
    overlap: bool = True
    # K/V rows packed as [total_L, H_kv, D], row r's keys at kv_offsets[r] : kv_offsets[r + 1].
    jagged: bool = False
    # A user's keys split over several CTAs (KV broadcast): each writes its partial output and
    # log-sum-exp per split into a workspace of n_splits x H heads, which the op merges.
    split_kv: bool = False
    # KV broadcast: the producer finds a tile's user with every lane of its warp
    # (cute_kernels.scheduler.warp_search, 32 entries of tile_start a load) instead of a binary
    # search (one entry a load). The op picks it where ikbo_fa.attention._LANE_SEARCH says so.
    lane_search: bool = False
    # KV broadcast: a tile whose query rows all lie in the first 64 (a user of few rows, a user's
    # last tile) runs on consumer warpgroup 0 alone; warpgroup 1 passes its K/V stages on without
    # a GEMM. The op picks it where ikbo_fa.attention._SOLO_TILES says so.
    solo: bool = False
    # Score columns of every 8 a thread exponentiates with a polynomial on the FMA units instead
    # of the multi-function unit (ikbo_fa.softmax.exp2_poly), which caps the softmax at D = 64.
    # The op takes it from ikbo_fa.attention._POLY_EXP2.
    poly_exp2: int = 0
    # KV broadcast: the dtype of idx (torch.int32 / torch.int64) where the forward kernel groups
    # the candidates by user itself, each CTA in a prologue (IkboAttentionFwdSm90.group_candidates),
    # instead of waiting for the work-list kernel; None: the work list groups them. The op takes
    # it where ikbo_fa.attention._GROUP_IN_KERNEL says so and the problem fits.
    group_idx: object = None
    # KV broadcast: each row's keys over the two CTAs of a cluster (CTA r over split r of
    # split_keys keys), their partial outputs merged in distributed shared memory, with no
    # workspace and no second launch. The op takes it for two splits where
    # ikbo_fa.attention._SPLIT_PAIR says so.
    split_pair: bool = False

    def __post_init__(self):
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"AttentionConfig.dtype must be torch.float16 or torch.bfloat16, got {self.dtype}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"AttentionConfig.head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {self.head_dim}")
        if not isinstance(self.s_q, int) or self.s_q < 1:
            raise ValueError(f"AttentionConfig.s_q must be an int >= 1, got {self.s_q!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"AttentionConfig.direction must be 'kv' or 'q', got {self.direction!r}")
        if self.split_kv and (self.direction != "kv" or not self.return_lse):
            raise ValueError("AttentionConfig: split_kv needs direction 'kv' and return_lse (the merge reads the lse)")
        if self.jagged and self.has_kv_lengths:
            raise ValueError("AttentionConfig: jagged (kv_offsets) and has_kv_lengths exclude each other")
        if self.lane_search and self.direction != "kv":
            raise ValueError("AttentionConfig: lane_search needs direction 'kv' (Q broadcast searches nothing)")
        if not isinstance(self.poly_exp2, int) or not 0 <= self.poly_exp2 <= 8:
            raise ValueError(f"AttentionConfig.poly_exp2 must be an int in [0, 8], got {self.poly_exp2!r}")
        if self.group_idx not in (None, torch.int32, torch.int64):
            raise ValueError(f"AttentionConfig.group_idx must be None, torch.int32 or torch.int64, got {self.group_idx!r}")
        if self.group_idx is not None and (self.direction != "kv" or self.ordered):
            raise ValueError("AttentionConfig: group_idx needs direction 'kv' without kv_lengths or jagged K/V "
                             "(their tiles run in the work list's longest-first order)")
        if self.split_pair and (self.direction != "kv" or self.split_kv):
            raise ValueError("AttentionConfig: split_pair needs direction 'kv' and excludes split_kv")
        if self.solo and self.direction != "kv":
            raise ValueError("AttentionConfig: solo needs direction 'kv' (a Q-broadcast tile fills both warpgroups)")

    @property
    def ordered(self) -> bool:
        """KV broadcast over histories of their own lengths: the tiles run longest first (the
        work list's perm; worklist.kv_tile_order)."""
        return self.direction == "kv" and (self.jagged or self.has_kv_lengths)

    def __str__(self) -> str:
        flags = "".join(f for f, on in (("-len", self.has_kv_lengths), ("-jagged", self.jagged),
                                          ("-lse", self.return_lse), ("-serial", not self.overlap),
                                          ("-split", self.split_kv), ("-lanes", self.lane_search),
                                          ("-solo", self.solo), ("-pair", self.split_pair)) if on)
        flags += f"-poly{self.poly_exp2}" if self.poly_exp2 else ""
        flags += f"-group{self.group_idx.itemsize * 8}" if self.group_idx is not None else ""
        return f"{str(self.dtype)[6:]}-d{self.head_dim}-sq{self.s_q}-{self.direction}{flags}"


def box_rows(s_q: int) -> int:
    """KV broadcast packs a user's query rows densely (candidate after candidate, S_q rows
    each) and moves them in TMA boxes of this many rows: it divides S_q, so a box never spans
    two candidates, and 64, so a box never spans two consumer warpgroups or two tiles."""
    return math.gcd(s_q, 64)


def row_packing(s_q: int):
    """Q broadcast: rows of the 128-row CTA tile given to each candidate (one per tile).

    Returns (slot_rows R, slots per consumer warpgroup, 128-row chunks per candidate).
    S_q <= 64: candidates share a warpgroup's 64 rows in slots of R = next power of two >= S_q
    (at least 8) rows; S_q > 64: a candidate spans 64-row slots over ceil(S_q / 128) tiles.
    """
    if s_q <= 64:
        r = max(8, 1 << (s_q - 1).bit_length())
        return r, 64 // r, 1
    return 64, 1, (s_q + 127) // 128


def kernel_config(dtype: torch.dtype, head_dim: int, s_q: int, direction: str, has_kv_lengths: bool,
                  return_lse: bool, jagged: bool = False, split_kv: bool = False,
                  lane_search: bool = False, solo: bool = False, poly_exp2: int = 0,
                  group_idx=None, split_pair: bool = False) -> AttentionConfig:
    """The configuration the op compiles for a problem."""
    kv = direction == "kv"
    return AttentionConfig(dtype, head_dim, s_q, direction, has_kv_lengths, return_lse or split_kv, jagged=jagged,
                           split_kv=split_kv, lane_search=lane_search and kv, solo=solo and kv, poly_exp2=poly_exp2,
                           group_idx=group_idx, split_pair=split_pair)


SHIPPED_CONFIGS = tuple(
    [AttentionConfig(dtype, d, 64, "kv", False, False) for dtype in (torch.bfloat16, torch.float16) for d in (64, 128)]
    + [
        AttentionConfig(torch.bfloat16, 128, 64, "kv", True, True),
        AttentionConfig(torch.bfloat16, 128, 32, "kv", False, False),
        AttentionConfig(torch.bfloat16, 128, 128, "kv", False, False),
        AttentionConfig(torch.bfloat16, 128, 64, "q", False, False),
        AttentionConfig(torch.bfloat16, 128, 64, "kv", True, True, overlap=False),
        # dense packing: one row per candidate, an odd S_q, and a candidate over two tiles
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True),
        AttentionConfig(torch.float16, 64, 17, "kv", False, False),
        AttentionConfig(torch.bfloat16, 128, 100, "kv", True, False),
        # boxes of 8 and 16 rows: the producer's Q slots in unrolled groups of four
        AttentionConfig(torch.bfloat16, 128, 8, "kv", False, True),
        AttentionConfig(torch.float16, 64, 48, "kv", False, False),
        # jagged histories, both directions
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, False, jagged=True),
        AttentionConfig(torch.bfloat16, 128, 64, "q", False, True, jagged=True),
        # a user's keys over several CTAs: plain, with kv_lengths, jagged
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, split_kv=True),
        AttentionConfig(torch.float16, 64, 17, "kv", True, True, split_kv=True),
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, jagged=True, split_kv=True),
        # the tile's user found by all lanes of the producer warp: plain split, longest first
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, split_kv=True, lane_search=True),
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, False, jagged=True, lane_search=True),
        # tiles of at most 64 rows on one consumer warpgroup: plain, kv_lengths (the V tail), serial
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, split_kv=True, solo=True),
        AttentionConfig(torch.float16, 64, 17, "kv", True, True, solo=True),
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, False, jagged=True, overlap=False, solo=True),
        # exp2 of 3 score columns in 8 on the FMA units: D 64 at the published shape, both directions
        AttentionConfig(torch.bfloat16, 64, 64, "kv", False, False, poly_exp2=3),
        AttentionConfig(torch.float16, 64, 64, "q", True, True, poly_exp2=3),
        # candidates grouped by each CTA itself: one row per candidate split, int64 idx; S_q 17
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, split_kv=True, group_idx=torch.int64),
        AttentionConfig(torch.float16, 64, 17, "kv", False, False, group_idx=torch.int32),
        # a row's keys over the two CTAs of a cluster: S_q 1 with lse, kv_lengths, jagged
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, split_pair=True),
        AttentionConfig(torch.float16, 64, 17, "kv", True, False, split_pair=True),
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, False, jagged=True, split_pair=True),
        # every variant at once
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, lane_search=True, solo=True, group_idx=torch.int32,
                        split_pair=True, poly_exp2=3),
    ]
)


def compile_config(cfg: AttentionConfig, *, keep_ptx: bool = False, ptxas_report: bool = False):
    """Compile one configuration for sm_90a from fake tensors (no GPU needed) -> CompiledKernel."""
    from cutlass import Float32, Int32

    from cute_kernels.compile import compile_kernel
    from cute_kernels.interop import cutlass_dtype, fake_stream, fake_tensor

    from .fwd_sm90 import IkboAttentionFwdSm90

    dt = cutlass_dtype(cfg.dtype)
    d = cfg.head_dim
    # Sizes B, H, L, ... are symbolic; strides are multiples of 8 elements (16 B).
    q = fake_tensor(dt, (None, cfg.s_q, None, d), divisibility=8)
    k = fake_tensor(dt, (None, None, None, d), divisibility=8)
    v = fake_tensor(dt, (None, None, None, d), divisibility=8)
    o = fake_tensor(dt, (None, cfg.s_q, None, d), divisibility=8)
    lse = fake_tensor(Float32, (None, None, cfg.s_q), align=4) if cfg.return_lse else None
    cand = fake_tensor(Int32, (None,), align=4)
    starts = fake_tensor(Int32, (None,), align=4) if cfg.direction == "kv" else None
    tiles = fake_tensor(Int32, (None,), align=4) if cfg.direction == "kv" else None
    kv_len = fake_tensor(Int32, (None,), align=4) if cfg.has_kv_lengths else None
    grouped = fake_tensor(Int32, (1,), align=4) if cfg.direction == "kv" else None
    offsets = fake_tensor(Int32, (None,), align=4) if cfg.jagged else None
    perm = fake_tensor(Int32, (None,), align=4) if cfg.ordered else None
    idx = fake_tensor(cutlass_dtype(cfg.group_idx), (None,), align=cfg.group_idx.itemsize) if cfg.group_idx else None
    kernel = IkboAttentionFwdSm90(cfg)
    return compile_kernel(kernel, q, k, v, o, lse, cand, starts, tiles, kv_len, grouped, offsets, perm, idx,
                          Float32(1.0), Float32(1.0), Int32(1), Int32(0), Int32(0), Int32(1), Int32(0), fake_stream(),
                          keep_ptx=keep_ptx, ptxas_report=ptxas_report)
