"""Static configurations of the attention kernel: the compile key and the shipped set.

A configuration is everything that changes the generated code; a problem picks its own
(``kernel_config``) and the op compiles it at first use (``fwd_compile.compile_config``, through
``cute_kernels.kernel_cache``). Nothing here imports the kernels.
"""
from __future__ import annotations

import dataclasses
import math

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
# Keys per block of the main loop: 128, or 192 at D 64 where no split divides the keys (the
# host's split arithmetic counts blocks of 128); the op takes 192 over long padded K/V only
# (AttentionPolicy.d64_wide_min_keys).
KEY_BLOCKS = (128, 192)
# Query rows per tile: 128 on two consumer warpgroups, or 192 on three (D 64, KV broadcast): at D 64
# a 64-row block's MMA is short beside its softmax, and a third warpgroup keeps the tensor cores
# busy while two run their softmax.
TILE_M_CHOICES = (128, 192)
DIRECTIONS = ("kv", "q")
# Split-KV: the most CTAs one row's keys go over (the merge kernel unrolls its loads to it).
MAX_SPLITS = 8
# K/V blocks per CTA the forward kernel prefetches into L2 at most (one lane of warp 0 each).
MAX_PREFETCH_BLOCKS = 32
# whole_rows_out: the split-0 lse word of a row written to out directly (a NaN no arithmetic makes).
WHOLE_ROW = 0x7FA00001


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
    # KV broadcast: each row's keys over the two CTAs of a cluster (CTA r over split r of
    # split_keys keys), their partial outputs merged in distributed shared memory, with no
    # workspace and no second launch. The op takes it for two splits where
    # AttentionPolicy.split_pair says so.
    split_pair: bool = False
    # Ordered tiles (KV broadcast over histories of their own lengths) handed out by a counter in
    # global memory, longest first, each to the first CTA free to take it, instead of the static
    # strided walk (AttentionPolicy.dynamic_walk; not with split_pair, whose two CTAs share tiles).
    dynamic_walk: bool = False
    # split_kv: a row whose keys fit one split is written to out (and lse) directly, and its
    # split-0 lse in the workspace holds WHOLE_ROW, which tells the merge to leave the row alone:
    # no workspace round trip for it.
    whole_rows_out: bool = False
    # KV broadcast over histories of their own lengths: the tiles longest first (the work list's
    # perm). False keeps the groups in user order, as over padded K/V: for rows too short for
    # their order to matter, where ordering them would cost the work list more than it balances.
    longest_first: bool = True
    # Keys per block of the main loop (KEY_BLOCKS): 192 only at D 64 without a key split. At D 64
    # a 128-key block carries half the MMA work of D 128 for the same per-block bookkeeping.
    key_block: int = 128
    # split_kv over padded K/V in the grid's last round only: the tiles that fill whole rounds of
    # the persistent grid (back to a user's first tile) run whole, out and lse written directly
    # and the rows marked WHOLE_ROW for the merge; the remaining ones split ``n_splits`` ways.
    # Where the tiles do not fill one round, every tile splits, as with split_kv alone.
    tail_split: bool = False
    # Query rows per tile (TILE_M_CHOICES), 64 per consumer warpgroup: 192 only at D 64 in KV broadcast
    # with 128-key blocks (three consumer warpgroups have 160 registers a thread, not 240) and no
    # split pair (its exchange pairs the two warpgroups of two CTAs).
    tile_m: int = 128

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
        if self.whole_rows_out and not self.split_kv:
            raise ValueError("AttentionConfig: whole_rows_out needs split_kv")
        if self.jagged and self.has_kv_lengths:
            raise ValueError("AttentionConfig: jagged (kv_offsets) and has_kv_lengths exclude each other")
        if self.split_pair and (self.direction != "kv" or self.split_kv):
            raise ValueError("AttentionConfig: split_pair needs direction 'kv' and excludes split_kv")
        if not self.longest_first and not (self.direction == "kv" and self.own_lengths):
            raise ValueError("AttentionConfig: longest_first=False (user order) applies to direction 'kv' with "
                             "kv_lengths or jagged K/V only")
        if self.key_block not in KEY_BLOCKS:
            raise ValueError(f"AttentionConfig.key_block must be one of {KEY_BLOCKS}, got {self.key_block!r}")
        if self.key_block != 128 and (self.head_dim != 64 or self.split_kv or self.split_pair):
            raise ValueError(f"AttentionConfig: key_block {self.key_block} needs head_dim 64 and no key split "
                             "(split_kv, split_pair)")
        if self.tile_m not in TILE_M_CHOICES:
            raise ValueError(f"AttentionConfig.tile_m must be one of {TILE_M_CHOICES}, got {self.tile_m!r}")
        if self.tile_m != 128 and (self.head_dim != 64 or self.direction != "kv" or self.key_block != 128
                                   or self.split_pair):
            raise ValueError(f"AttentionConfig: tile_m {self.tile_m} needs head_dim 64, direction 'kv', key_block "
                             "128 and no split_pair")
        if self.tail_split and not (self.split_kv and self.whole_rows_out and not self.own_lengths):
            raise ValueError("AttentionConfig: tail_split needs split_kv and whole_rows_out over padded K/V (no "
                             "kv_lengths, not jagged)")
        if self.dynamic_walk and (not self.ordered or self.split_pair):
            raise ValueError("AttentionConfig: dynamic_walk needs ordered tiles (direction 'kv' with kv_lengths or "
                             "jagged) and excludes split_pair")

    @property
    def ordered(self) -> bool:
        """KV broadcast over histories of their own lengths, ``longest_first``: the tiles run
        longest first (the work list's perm; worklist.kv_tile_order)."""
        return self.direction == "kv" and self.own_lengths and self.longest_first

    @property
    def own_lengths(self) -> bool:
        """Each K/V row has a length of its own (kv_lengths or jagged), known only on the device."""
        return self.jagged or self.has_kv_lengths

    def __str__(self) -> str:
        flags = "".join(f for f, on in (("-len", self.has_kv_lengths), ("-jagged", self.jagged),
                                          ("-lse", self.return_lse), ("-serial", not self.overlap),
                                          ("-split", self.split_kv), ("-pair", self.split_pair),
                                          ("-dyn", self.dynamic_walk), ("-whole", self.whole_rows_out),
                                          ("-tail", self.tail_split),
                                          ("-userorder", not self.longest_first)) if on)
        if self.key_block != 128:
            flags += f"-n{self.key_block}"
        if self.tile_m != 128:
            flags += f"-m{self.tile_m}"
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
                  split_pair: bool = False, dynamic_walk: bool = False,
                  whole_rows_out: bool = False, longest_first: bool = True,
                  d64_key_block: int = 128, tail_split: bool = False, d64_tile_m: int = 128) -> AttentionConfig:
    """The configuration the op compiles for a problem (``dynamic_walk``: where the tiles are ordered
    and not split in pairs; ``whole_rows_out``: where the keys are split over a workspace and
    rows may have fewer keys than a split holds; ``longest_first``: whether rows of their own
    lengths run longest first; ``d64_key_block``: the key block at D 64 over padded K/V where no
    split divides the keys; ``tail_split``: split_kv over padded K/V in the last round only;
    ``d64_tile_m``: the query rows of a tile at D 64 in KV broadcast without a split pair, whose
    192 takes 128-key blocks)."""
    own = direction == "kv" and (jagged or has_kv_lengths)
    tile_m = d64_tile_m if head_dim == 64 and direction == "kv" and not split_pair else 128
    tail = tail_split and split_kv and direction == "kv" and not own
    cfg = AttentionConfig(dtype, head_dim, s_q, direction, has_kv_lengths, return_lse or split_kv, jagged=jagged,
                          split_kv=split_kv, split_pair=split_pair, tail_split=tail,
                          whole_rows_out=(whole_rows_out and split_kv and own) or tail,
                          longest_first=longest_first or not own,
                          key_block=d64_key_block if head_dim == 64 and tile_m == 128 and not (
                              split_kv or split_pair or jagged or has_kv_lengths) else 128, tile_m=tile_m)
    return dataclasses.replace(cfg, dynamic_walk=True) if dynamic_walk and cfg.ordered and not split_pair else cfg


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
        # the serial main loop on jagged histories; Q broadcast with kv_lengths
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, False, jagged=True, overlap=False),
        AttentionConfig(torch.float16, 64, 64, "q", True, True),
        # a row's keys over the two CTAs of a cluster: S_q 1 with lse, kv_lengths, jagged
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, True, split_pair=True),
        AttentionConfig(torch.float16, 64, 17, "kv", True, False, split_pair=True),
        AttentionConfig(torch.bfloat16, 128, 1, "kv", False, False, jagged=True, split_pair=True),
        # ordered tiles from a counter: jagged, split over a workspace, and with kv_lengths
        AttentionConfig(torch.bfloat16, 128, 4, "kv", False, False, jagged=True, dynamic_walk=True),
        AttentionConfig(torch.bfloat16, 128, 2, "kv", False, True, jagged=True, split_kv=True, dynamic_walk=True),
        AttentionConfig(torch.float16, 64, 17, "kv", True, True, split_kv=True, dynamic_walk=True),
        # ... rows of one split written to out directly: jagged S_q 4, kv_lengths S_q 17 (static walk)
        AttentionConfig(torch.bfloat16, 128, 4, "kv", False, True, jagged=True, split_kv=True, dynamic_walk=True,
                        whole_rows_out=True),
        AttentionConfig(torch.float16, 64, 17, "kv", True, True, split_kv=True, whole_rows_out=True),
        # short rows in user order: jagged S_q 1 and 4, kv_lengths S_q 17
        AttentionConfig(torch.bfloat16, 64, 1, "kv", False, False, jagged=True, longest_first=False),
        AttentionConfig(torch.bfloat16, 64, 4, "kv", False, False, jagged=True, longest_first=False),
        AttentionConfig(torch.float16, 64, 17, "kv", True, True, longest_first=False),
        # 192-key blocks at D 64 over padded K/V: both directions, one row per candidate with lse
        AttentionConfig(torch.bfloat16, 64, 64, "kv", False, False, key_block=192),
        AttentionConfig(torch.float16, 64, 1, "kv", False, True, key_block=192),
        AttentionConfig(torch.bfloat16, 64, 17, "q", False, True, key_block=192),
        # the last round's tiles split, the others whole: S_q 16 (boxes of 16 rows), one row per
        # candidate at D 64
        AttentionConfig(torch.bfloat16, 128, 16, "kv", False, True, split_kv=True, whole_rows_out=True,
                        tail_split=True),
        AttentionConfig(torch.float16, 64, 1, "kv", False, True, split_kv=True, whole_rows_out=True,
                        tail_split=True),
        # 192-row tiles on three consumer warpgroups (D 64, KV broadcast): S_q 16 and 64 (boxes of
        # 16 rows; one box per warpgroup), the last round split at S_q 4, kv_lengths in a dynamic
        # walk, jagged one row per candidate
        AttentionConfig(torch.bfloat16, 64, 16, "kv", False, False, tile_m=192),
        AttentionConfig(torch.float16, 64, 64, "kv", False, True, tile_m=192),
        AttentionConfig(torch.bfloat16, 64, 4, "kv", False, True, split_kv=True, whole_rows_out=True,
                        tail_split=True, tile_m=192),
        AttentionConfig(torch.bfloat16, 64, 17, "kv", True, True, split_kv=True, dynamic_walk=True, tile_m=192),
        AttentionConfig(torch.bfloat16, 64, 1, "kv", False, False, jagged=True, tile_m=192),
        # ... S_q 32: six 32-row boxes a tile, loaded in two groups of three
        AttentionConfig(torch.bfloat16, 64, 32, "kv", False, False, tile_m=192),
    ]
)
