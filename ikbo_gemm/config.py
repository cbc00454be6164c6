"""Static configurations of the package's kernels: the compile keys, the shipped sets and the
picks (the compile step is ``ikbo_gemm.compile``). LCE: LceConfig and the tiling of a problem
(LceGeometry, shared by the host plan and the kernel); linear: LinearConfig."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class LceConfig:
    """Everything that changes the generated code."""

    dtype: torch.dtype
    idx_dtype: torch.dtype
    tile_w: int  # rows of w (output rows) per tile
    cluster_n: int  # CTAs on neighbouring column slices sharing each w tile (TMA multicast)
    cluster_b: int  # ... and on neighbouring batches
    tile_n: int = 64  # output columns per tile (one or two wgmma atoms of 64)
    # FP8 operands (dtype float8_e4m3fn): the output's dtype, bf16 or fp16; 16-bit operands: None.
    out_dtype: Optional[torch.dtype] = None
    # FP8: each k-block summed from zero and added into the fp32 accumulator (as LinearConfig's):
    # two partial fragments beside it, so at most PROMOTE_OUTPUTS a consumer.
    promote: bool = False

    def __post_init__(self):
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"LceConfig.dtype must be torch.float16 or torch.bfloat16 (or torch.float8_e4m3fn "
                             f"with an out_dtype), got {self.dtype}")
        if not isinstance(self.promote, bool):
            raise TypeError(f"LceConfig.promote must be a bool, got {self.promote!r}")
        if self.promote and (self.dtype != torch.float8_e4m3fn or self.tile_n * self.tile_w > PROMOTE_OUTPUTS):
            raise ValueError(f"LceConfig: promote needs FP8 operands and at most {PROMOTE_OUTPUTS} outputs a tile "
                             f"(two partial fragments beside the accumulator); got {self.dtype}, "
                             f"{self.tile_n} x {self.tile_w}")
        if (self.out_dtype in (torch.float16, torch.bfloat16)) != (self.dtype == torch.float8_e4m3fn):
            raise ValueError(f"LceConfig.out_dtype must be torch.bfloat16 or torch.float16 with FP8 operands, "
                             f"else None; got {self.out_dtype} with {self.dtype}")
        if self.idx_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"LceConfig.idx_dtype must be torch.int32 or torch.int64, got {self.idx_dtype}")
        if self.tile_n not in (64, 128):
            raise ValueError(f"LceConfig.tile_n must be 64 or 128, got {self.tile_n}")
        if self.tile_w % 8 or not 64 <= self.tile_w <= 256:
            raise ValueError(f"LceConfig.tile_w must be a multiple of 8 in [64, 256], got {self.tile_w}")
        if self.cluster_n not in (1, 2, 4) or self.cluster_b not in (1, 2, 4) or self.cluster > 8:
            raise ValueError(f"LceConfig.cluster_n x cluster_b = {self.cluster_n} x {self.cluster_b} must be "
                             f"(1|2|4) x (1|2|4), at most 8 CTAs")
        if self.tile_n * self.tile_w > 128 * 192:
            raise ValueError(f"LceConfig: tile_n x tile_w = {self.tile_n} x {self.tile_w} holds more than the "
                             f"192 fp32 accumulator registers per consumer thread that fit without spills")

    @property
    def cluster(self) -> int:
        return self.cluster_n * self.cluster_b

    @property
    def tile_k(self) -> int:
        """Elements of a k-block: 128 bytes of each operand row (FP8: 128, 16-bit: 64)."""
        return 128 if self.dtype == torch.float8_e4m3fn else 64

    def __str__(self) -> str:
        out = ("-promote" if self.promote else "") + (f"-out_{str(self.out_dtype)[6:]}" if self.out_dtype else "")
        return (f"{str(self.dtype)[6:]}-{str(self.idx_dtype)[6:]}-n{self.tile_n}-w{self.tile_w}"
                f"-c{self.cluster_n}x{self.cluster_b}{out}")


def _ceil_div(a, b):
    return (a + b - 1) // b


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (the ops' padded sizes)."""
    return _ceil_div(x, m) * m


@dataclasses.dataclass(frozen=True)
class LceGeometry:
    """How one launch tiles its problem. The same arithmetic serves the host plan (Python ints)
    and the kernel (DSL Int32 read from the tensors' shapes): ``of`` takes the ceil-div to use.

    A CTA tile is tile_n output columns x tile_w output rows of one batch; a cluster tile is
    cluster_n x cluster_b CTA tiles. Cluster tiles are numbered user phase first
    ([0, user_tiles)), then the candidate phase; within a phase w-row tile fastest, then the
    column group, then the batch group."""

    w_tiles: object  # tiles of tile_w output rows (over M)
    groups: object  # column groups: cluster_n column tiles each (over N, padded to 8)
    column_tiles: object  # groups * cluster_n
    user_tiles: object  # user-phase cluster tiles
    k_blocks_user: object  # k-blocks of the user GEMM (cfg.tile_k deep)
    k_blocks_cand: object  # ... of the candidate GEMM
    n_users: object  # U
    n_cands: object  # the launch's candidates
    cluster_b: int

    @staticmethod
    def of(cfg: LceConfig, *, M, N, U, B, K_user, K_cand, ceil_div=_ceil_div) -> "LceGeometry":
        w_tiles = ceil_div(M, cfg.tile_w)
        groups = ceil_div(ceil_div(N, cfg.tile_n), cfg.cluster_n)
        user_tiles = ceil_div(U, cfg.cluster_b) * w_tiles * groups
        return LceGeometry(
            w_tiles=w_tiles, groups=groups, column_tiles=groups * cfg.cluster_n, user_tiles=user_tiles,
            k_blocks_user=ceil_div(K_user, cfg.tile_k), k_blocks_cand=ceil_div(K_cand, cfg.tile_k),
            n_users=U, n_cands=B, cluster_b=cfg.cluster_b,
        )

    def cand_tiles(self):
        """Candidate-phase cluster tiles."""
        return _ceil_div(self.n_cands, self.cluster_b) * self.w_tiles * self.groups

    def user_tile_index(self, u, w, n):
        """User CTA tile (u, w, n): its workspace tile and its ready flag."""
        return (u * self.w_tiles + w) * self.column_tiles + n

    def workspace_tiles(self):
        """User CTA tiles the workspace holds (U rounded up to the cluster's batch depth)."""
        return _ceil_div(self.n_users, self.cluster_b) * self.cluster_b * self.column_tiles * self.w_tiles


# (tile_n, tile_w) pairs; a consumer's accumulator holds tile_n * tile_w / 128 fp32 per thread
# (at most 192 without spills). 128-column tiles come in every height of 8 rows from 128 to
# 192, so that M pads to little.
TILES = ((64, 128), (64, 192), (64, 224), (64, 256)) + tuple((128, w) for w in range(128, 193, 8))
# Outputs a consumer holds when promoting (LceConfig.promote, LinearConfig.promote): its accumulator
# and two partial fragments take 3 x PROMOTE_OUTPUTS / 128 registers a thread.
PROMOTE_OUTPUTS = 64 * 128
# The LCE tiles that promote.
PROMOTE_TILES = tuple(t for t in TILES if t[0] * t[1] <= PROMOTE_OUTPUTS)
CLUSTERS = {64: ((1, 1), (2, 1), (4, 1), (4, 2)), 128: ((1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (4, 2))}

SHIPPED_CONFIGS = [
    LceConfig(dtype, idx_dtype, tile_w, cn, cb, tile_n)
    for dtype in (torch.float16, torch.bfloat16)
    for idx_dtype in (torch.int32, torch.int64)
    for tile_n, tile_w in TILES
    for cn, cb in CLUSTERS[tile_n]
] + [  # FP8 operands, bf16 out: the published shape's tile, and each tile family's smallest and largest
    # accumulator (the others compile at first use); fp16 out at the published shape's
    LceConfig(torch.float8_e4m3fn, torch.int32, tile_w, cn, cb, tile_n, out_dtype=out)
    for tile_n, tile_w, cn, cb, out in (
        (128, 152, 2, 4, torch.bfloat16), (128, 152, 2, 1, torch.bfloat16), (128, 192, 4, 2, torch.bfloat16),
        (64, 128, 1, 1, torch.bfloat16), (64, 256, 4, 2, torch.bfloat16), (128, 152, 2, 4, torch.float16))
] + [  # FP8 with promotion: its one tile, each cluster
    LceConfig(torch.float8_e4m3fn, torch.int32, tile_w, cn, cb, tile_n, out_dtype=torch.bfloat16, promote=True)
    for tile_n, tile_w in PROMOTE_TILES for cn, cb in CLUSTERS[tile_n]
]

# Each k-block a CTA's shared memory takes in (tile_n + tile_w) x 64 operand elements for
# tile_n x tile_w x 64 MACs. Above 64 bytes per SM cycle at the tensor cores' full rate, i.e.
# when 1/tile_n + 1/tile_w > 1/64, the main loop waits on its loads: on an H200 at the
# published shape, 64 x 224 tiles took 19% longer per executed MAC than 128 x 160 ones.
LOAD_BOUND_COST = 1.2


def tile_cost(tile_n: int, tile_w: int, m: int, n: int, load_bound_cost: float = LOAD_BOUND_COST) -> float:
    """Relative time of one batch's tiles: the executed (padded) output, weighted when load-bound."""
    executed = -(-n // tile_n) * tile_n * -(-m // tile_w) * tile_w
    return executed * (load_bound_cost if 1 / tile_n + 1 / tile_w > 1 / 64 else 1.0)


def pick_config(dtype: torch.dtype, idx_dtype: torch.dtype, m: int, n: int, b: int,
                load_bound_cost: float = LOAD_BOUND_COST, out_dtype: Optional[torch.dtype] = None,
                promote: bool = False) -> LceConfig:
    """The tile of least ``tile_cost`` (ties: the wider, then the taller); a cluster as wide
    as the tile's column slices of N allow (up to 4) and, with more than one batch, deep in
    batches: 128-column tiles fill 4 or 8 CTAs (each w tile then feeds all of them), 64-column
    tiles go two batches deep when 4 slices wide. FP8 operands tile as 16-bit ones (a k-block
    holds the same bytes); ``out_dtype`` is their output's; ``promote``: among PROMOTE_TILES."""
    tile_n, tile_w = min(PROMOTE_TILES if promote else TILES,
                         key=lambda t: (tile_cost(*t, m, n, load_bound_cost), -t[0], -t[1]))
    column_tiles = -(-n // tile_n)
    cn = max(c for c in (1, 2, 4) if c <= column_tiles)
    if b == 1:
        cb = 1
    elif tile_n == 128:
        cb = min(4, 8 // cn)
    else:
        cb = 2 if cn == 4 else 1
    return LceConfig(dtype, idx_dtype, tile_w, cn, cb, tile_n, out_dtype, promote)


# ---------------------------------------------------------------------------------- linear
FP8 = torch.float8_e4m3fn
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid")
PHASES = ("user", "cand")


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """Everything that changes the generated code of ikbo_gemm.linear's kernel (LinearSm90)."""

    dtype: torch.dtype
    idx_dtype: torch.dtype
    tile_m: int  # output rows (candidates or users) per tile
    tile_n: int  # output columns (features) per tile
    phase: str  # "user": x_user @ w_user^T into the fp32 workspace; "cand": the candidate GEMM + epilogue
    activation: Optional[str] = None  # candidate phase only
    has_bias: bool = False  # candidate phase only
    cluster_m: int = 1  # CTAs of a cluster on neighbouring row tiles, sharing the B tile (TMA multicast)
    split_k: int = 1  # CTAs of a cluster on one tile, each over a slice of K (partial sums added in shared memory)
    # FP8 operands (dtype float8_e4m3fn): the output's dtype, bf16 or fp16 (the user phase's
    # staging layout only: bf16); 16-bit operands: None, the output is theirs.
    out_dtype: Optional[torch.dtype] = None
    # Consumer warpgroups on one tile: 1, ping-pong (each runs whole tiles in turn); 2, both on
    # every tile, tile_m / 2 rows each (candidate phase, no split_k; FP8 only when promoting).
    consumers_per_tile: int = 1
    # FP8: each k-block summed from zero in a partial fragment, then added into the fp32
    # accumulator ("promotion"): the 8-bit wgmma's accumulator keeps about 14 mantissa bits.
    # Two partials in turn beside the accumulator: at most PROMOTE_OUTPUTS a consumer, no split_k.
    promote: bool = False
    # CTAs of a cluster on neighbouring column tiles, sharing the A tile (TMA multicast; candidate
    # phase with cluster_m 2): a 2 x 2 cluster multicasts both operands, each CTA loading half of
    # its A tile and half of its B tile.
    cluster_n: int = 1

    def __post_init__(self):
        if self.dtype not in (torch.float16, torch.bfloat16, FP8):
            raise ValueError(f"LinearConfig.dtype must be torch.float16 or torch.bfloat16 (or torch.float8_e4m3fn "
                             f"with an out_dtype), got {self.dtype}")
        if (self.out_dtype in (torch.float16, torch.bfloat16)) != (self.dtype == FP8):
            raise ValueError(f"LinearConfig.out_dtype must be torch.bfloat16 or torch.float16 with FP8 operands, "
                             f"else None; got {self.out_dtype} with {self.dtype}")
        if self.idx_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"LinearConfig.idx_dtype must be torch.int32 or torch.int64, got {self.idx_dtype}")
        if self.tile_m not in (64, 128):
            raise ValueError(f"LinearConfig.tile_m must be 64 or 128, got {self.tile_m}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"LinearConfig.tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        if self.consumers_per_tile not in (1, 2):
            raise ValueError(f"LinearConfig.consumers_per_tile must be 1 or 2, got {self.consumers_per_tile!r}")
        if self.tile_m * self.tile_n // self.consumers_per_tile > 128 * 192:
            raise ValueError(f"LinearConfig: tile_m x tile_n = {self.tile_m} x {self.tile_n} on "
                             f"{self.consumers_per_tile} consumer(s) holds more than the 192 fp32 accumulator "
                             f"registers per consumer thread that fit without spills")
        if self.consumers_per_tile == 2 and (self.tile_m != 128 or self.phase != "cand" or self.split_k > 1
                                             or (self.dtype == FP8 and not self.promote)):
            raise ValueError(f"LinearConfig: two consumers on one tile need tile_m 128, the candidate phase, no "
                             f"split_k and 16-bit operands or FP8 with promote; got tile_m {self.tile_m}, phase "
                             f"{self.phase!r}, split_k {self.split_k}, {self.dtype}, promote {self.promote}")
        if not isinstance(self.promote, bool):
            raise TypeError(f"LinearConfig.promote must be a bool, got {self.promote!r}")
        if self.promote and (self.dtype != FP8 or self.split_k > 1
                             or self.tile_m * self.tile_n // self.consumers_per_tile > PROMOTE_OUTPUTS):
            raise ValueError(f"LinearConfig: promote needs FP8 operands, no split_k and at most {PROMOTE_OUTPUTS} "
                             f"outputs a consumer (two partial fragments beside the accumulator); got {self.dtype}, "
                             f"split_k {self.split_k}, {self.tile_m} x {self.tile_n} on {self.consumers_per_tile}")
        if self.phase not in PHASES:
            raise ValueError(f"LinearConfig.phase must be 'user' or 'cand', got {self.phase!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"LinearConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.cluster_m not in (1, 2):
            raise ValueError(f"LinearConfig.cluster_m must be 1 or 2, got {self.cluster_m}")
        if self.cluster_n not in (1, 2):
            raise ValueError(f"LinearConfig.cluster_n must be 1 or 2, got {self.cluster_n}")
        if self.cluster_n == 2 and (self.phase != "cand" or self.cluster_m != 2
                                    or self.tile_m * self.tile_n > CLUSTER_N_MAX_TILE * self.consumers_per_tile):
            raise ValueError(f"LinearConfig: cluster_n 2 (A tiles multicast) needs the candidate phase, cluster_m 2 "
                             f"(a 2 x 2 cluster) and at most {CLUSTER_N_MAX_TILE} outputs a consumer; got phase "
                             f"{self.phase!r}, cluster_m {self.cluster_m}, {self.tile_m} x {self.tile_n} on "
                             f"{self.consumers_per_tile}")
        if self.phase == "user" and (self.activation is not None or self.has_bias):
            raise ValueError("LinearConfig: the user phase takes no activation and no bias (the candidate phase adds them)")
        if self.split_k not in (1, 2, 4):
            raise ValueError(f"LinearConfig.split_k must be 1, 2 or 4, got {self.split_k}")
        if self.split_k > 1 and self.cluster_m > 1:
            raise ValueError("LinearConfig: a cluster either shares B tiles (cluster_m) or splits K (split_k), not both")
        if self.split_k > 1 and self.tile_m * self.tile_n > 128 * 128:
            raise ValueError(f"LinearConfig: a K split needs a tile of at most 128 x 128 outputs (the exchange's "
                             f"registers beside the accumulator), got {self.tile_m} x {self.tile_n}")
        if (self.tile_n // 16) % self.split_k:
            raise ValueError(f"LinearConfig: the {self.tile_n // 16} epilogue sub-tiles of a {self.tile_n}-column tile "
                             f"do not deal evenly to split_k = {self.split_k} CTAs")

    @property
    def banded(self) -> bool:
        """Whether the candidate walk takes bands of row groups (their height a run-time value,
        LinearLaunch.band_rows): tiles of at most BAND_MAX_TILE outputs a consumer."""
        return self.phase == "cand" and self.tile_m * self.tile_n <= BAND_MAX_TILE * self.consumers_per_tile

    def __str__(self) -> str:
        extra = "".join(f"-{x}" for x in (self.activation, "bias" if self.has_bias else None) if x)
        split = f"-k{self.split_k}" if self.split_k > 1 else ""
        split += "-shared" if self.consumers_per_tile == 2 else ""
        split += "-promote" if self.promote else ""
        out = f"-out_{str(self.out_dtype)[6:]}" if self.out_dtype else ""
        return (f"linear-{self.phase}-{str(self.dtype)[6:]}-{str(self.idx_dtype)[6:]}-m{self.tile_m}-n{self.tile_n}"
                f"-c{self.cluster_m}{'x2' if self.cluster_n == 2 else ''}{split}{extra}{out}")

    @property
    def cluster(self) -> int:
        """CTAs a cluster: cluster_m x cluster_n sharing operand tiles, or split_k on one tile."""
        return self.cluster_m * self.cluster_n * self.split_k


LINEAR_TILES = ((128, 128), (128, 192), (128, 64), (64, 256), (64, 128))
# The candidate tile both consumer warpgroups share (LinearConfig.consumers_per_tile = 2), 64 x 256
# each: per MAC its shared memory takes in 3/4 of the operand bytes of a 128 x 128 ping-pong tile
# and its wgmmas read 5/6 of them (docs/perf/2026-12-06-linear-h100-grid.md), but its epilogue no
# longer overlaps another tile's main loop.
LINEAR_SHARED_TILE = (128, 256)


def pick_linear_tile(rows: int, n: int, tiles: tuple = LINEAR_TILES) -> tuple[int, int]:
    """The (tile_m, tile_n) of ``tiles`` of least executed (padded) output, weighted when
    load-bound (as ``tile_cost``); ties: the larger tile."""
    return min(tiles, key=lambda t: (tile_cost(t[0], t[1], n, rows), -t[0] * t[1]))


def pick_cand_tile(rows: int, n: int, sms: int, tiles: tuple = LINEAR_TILES) -> tuple[int, int]:
    """The candidate phase's tile: ``pick_linear_tile``'s, unless its tiles fill at most half the
    SMs. Each CTA then runs one tile, so the phase takes one tile's time: the tile of least work
    (weighted when load-bound; ties: the wider, wgmma's N) among those that still leave half
    the SMs to the user phase (``linear._spare_user_grid``)."""
    best = pick_linear_tile(rows, n, tiles)
    count = lambda t: -(-rows // t[0]) * -(-n // t[1])
    if 2 * count(best) > sms:
        return best
    return min((t for t in tiles if 2 * count(t) <= sms), key=lambda t: (tile_cost(*t, t[1], t[0]), -t[1]))


# Tiles a K split (LinearConfig.split_k) takes: an accumulator of at most 128 fp32 registers a
# thread leaves room for the exchange (the 128 x 192 tile spills with it).
LINEAR_SPLIT_TILES = tuple(t for t in LINEAR_TILES if t[0] * t[1] <= 128 * 128)
# The FP8 candidate phase's tiles: at most 128 accumulator values and 32 columns a thread, so that
# the scales of its columns fit beside them (wider ones spill in the epilogue).
LINEAR_FP8_CAND_TILES = ((128, 128), (128, 64), (64, 128))
# FP8 with promotion (LinearConfig.promote; PROMOTE_OUTPUTS a consumer): the candidate phase's
# 128 x 128 tile is then shared by both consumers; the user phase's tiles are these.
LINEAR_PROMOTE_TILES = ((128, 64), (64, 128))
LINEAR_SPLITS = (2, 4)
# k-blocks each CTA of a split tile runs at least.
MIN_SPLIT_K_BLOCKS = 8
# The exchange of a split tile's partial sums, counted in k-blocks of its main loop: each CTA
# sends (s - 1) / s of its fp32 accumulator to the other SMs of its cluster (an estimate).
EXCHANGE_K_BLOCKS = 4


def pick_cand_split(rows: int, n: int, k_blocks: int, sms: int, clusters,
                    tiles: tuple = LINEAR_TILES) -> tuple[tuple[int, int], int]:
    """The candidate phase's (tile, K split). As ``pick_linear_tile`` while its tiles fill more than
    half the SMs. Otherwise each CTA runs one tile and the phase takes one CTA's time: among
    ``pick_cand_tile``'s tile unsplit and the split tiles whose tiles x s CTAs are one wave of
    s-CTA clusters (``clusters(s)``: resident at once) with at least MIN_SPLIT_K_BLOCKS k-blocks
    each, the least work per CTA (weighted when load-bound, the exchange counted; ties: fewer
    CTAs). ``tiles``: the tiles to choose from (split ones: those of LINEAR_SPLIT_TILES among them)."""
    best = pick_linear_tile(rows, n, tiles)
    count = lambda t: -(-rows // t[0]) * -(-n // t[1])
    if 2 * count(best) > sms:
        return best, 1
    options = [(pick_cand_tile(rows, n, sms, tiles), 1)] + [
        (t, s) for t in LINEAR_SPLIT_TILES if t in tiles for s in LINEAR_SPLITS
        if (t[1] // 16) % s == 0 and count(t) <= clusters(s) and k_blocks >= s * MIN_SPLIT_K_BLOCKS]

    def per_cta(option):
        (tm, tn), s = option
        return tile_cost(tm, tn, tn, tm) * (-(-k_blocks // s) + (EXCHANGE_K_BLOCKS if s > 1 else 0))

    return min(options, key=lambda o: (per_cta(o), count(o[0]) * o[1]))


# LinearConfig.banded: the largest tile a consumer that walks in bands (the band arithmetic makes
# 128 x 192 spill).
BAND_MAX_TILE = 128 * 128
# LinearConfig.cluster_n 2: the largest tile a consumer (with the 2 x 2 cluster's loads, 128 x 192
# spills 312 bytes).
CLUSTER_N_MAX_TILE = 128 * 128


def cand_consumers(tile_cand: tuple, promote: bool = False) -> int:
    """Consumer warpgroups on one candidate tile: 2 on LINEAR_SHARED_TILE, and on 128 x 128 when
    promoting; else 1 (ping-pong)."""
    tile = tuple(tile_cand)
    return 2 if tile == LINEAR_SHARED_TILE or (promote and tile == (128, 128)) else 1


def takes_cluster_n(tile_cand: tuple, promote: bool = False) -> bool:
    """Whether a candidate tile may run in 2 x 2 clusters (LinearConfig.cluster_n 2): at most
    CLUSTER_N_MAX_TILE outputs a consumer."""
    return tile_cand[0] * tile_cand[1] <= CLUSTER_N_MAX_TILE * cand_consumers(tile_cand, promote)


def linear_configs(dtype, idx_dtype, tile_user, tile_cand, activation, has_bias, cluster_cand=1, split_cand=1,
                   split_user=1, out_dtype=None, promote=False, cluster_n_cand=1) -> tuple:
    """(user phase, candidate phase) configurations of one call (``out_dtype``: FP8's output;
    ``promote``: both phases promote; ``cluster_n_cand`` 2: 2 x 2 candidate clusters). The
    candidate tile LINEAR_SHARED_TILE, and 128 x 128 when promoting, is both consumers'
    (``consumers_per_tile`` 2)."""
    user_out = torch.bfloat16 if dtype == FP8 else None  # the user phase stores fp32 either way
    consumers = cand_consumers(tile_cand, promote)
    return (LinearConfig(dtype, idx_dtype, *tile_user, "user", split_k=split_user, out_dtype=user_out,
                         promote=promote),
            LinearConfig(dtype, idx_dtype, *tile_cand, "cand", activation, has_bias, cluster_cand, split_cand,
                         out_dtype, consumers_per_tile=consumers, promote=promote, cluster_n=cluster_n_cand))


LINEAR_SHIPPED_CONFIGS = [
    LinearConfig(dtype, torch.int32, tm, tn, "user") for dtype in (torch.float16, torch.bfloat16) for tm, tn in LINEAR_TILES
] + [
    LinearConfig(dtype, torch.int32, tm, tn, "cand", act, bias, cluster)
    for dtype in (torch.float16, torch.bfloat16) for tm, tn in LINEAR_TILES for cluster in (1, 2)
    for act, bias in ((None, False), ("relu", True))
] + [
    LinearConfig(torch.float16, torch.int64, 128, 128, "cand", None, False, cluster) for cluster in (1, 2)
] + [
    LinearConfig(dtype, torch.int32, *LINEAR_SHARED_TILE, "cand", act, bias, cluster, consumers_per_tile=2)
    for dtype in (torch.float16, torch.bfloat16) for cluster in (1, 2) for act, bias in ((None, False), ("relu", True))
] + [
    LinearConfig(torch.bfloat16, torch.int32, 128, 128, "cand", act, True, 2) for act in ACTIVATIONS[2:]
] + [
    LinearConfig(dtype, torch.int32, tm, tn, "cand", act, bias, 1, split)
    for dtype in (torch.float16, torch.bfloat16) for tm, tn in LINEAR_SPLIT_TILES for split in LINEAR_SPLITS
    for act, bias in ((None, False), ("relu", True))
] + [
    LinearConfig(dtype, torch.int32, tm, tn, "user", split_k=split)
    for dtype in (torch.float16, torch.bfloat16) for tm, tn in LINEAR_SPLIT_TILES for split in LINEAR_SPLITS
] + [  # FP8 operands, bf16 out (and one tile's fp16 out)
    LinearConfig(FP8, torch.int32, tm, tn, "user", out_dtype=torch.bfloat16) for tm, tn in LINEAR_TILES
] + [  # ... the user phase's K-split clusters (PlanRules.user_cluster_split, on by default)
    LinearConfig(FP8, torch.int32, tm, tn, "user", split_k=split, out_dtype=torch.bfloat16)
    for tm, tn in LINEAR_SPLIT_TILES for split in LINEAR_SPLITS
] + [
    LinearConfig(FP8, torch.int32, tm, tn, "cand", act, bias, cluster, out_dtype=torch.bfloat16)
    for tm, tn in LINEAR_FP8_CAND_TILES for cluster in (1, 2) for act, bias in ((None, False), ("relu", True))
] + [
    LinearConfig(FP8, torch.int32, 128, 128, "cand", None, False, cluster, out_dtype=torch.float16) for cluster in (1, 2)
] + [  # FP8 with promotion: the user tiles, and the candidate tiles (128 x 128 shared by both consumers)
    LinearConfig(FP8, torch.int32, tm, tn, "user", out_dtype=torch.bfloat16, promote=True)
    for tm, tn in LINEAR_PROMOTE_TILES
] + [
    LinearConfig(FP8, torch.int32, tm, tn, "cand", act, bias, cluster, out_dtype=torch.bfloat16,
                 consumers_per_tile=2 if (tm, tn) == (128, 128) else 1, promote=True)
    for tm, tn in LINEAR_FP8_CAND_TILES for cluster in (1, 2) for act, bias in ((None, False), ("relu", True))
]
# 2 x 2 candidate clusters (cluster_n 2, PlanRules.cand_cluster_n): the ping-pong and shared 16-bit
# tiles, FP8's 128 x 128 with and without promotion.
LINEAR_SHIPPED_CONFIGS += [
    LinearConfig(dtype, torch.int32, 128, 128, "cand", act, bias, 2, cluster_n=2)
    for dtype in (torch.float16, torch.bfloat16) for act, bias in ((None, False), ("relu", True))
] + [
    LinearConfig(torch.bfloat16, torch.int32, *LINEAR_SHARED_TILE, "cand", "relu", True, 2, consumers_per_tile=2,
                 cluster_n=2),
    LinearConfig(FP8, torch.int32, 128, 128, "cand", "relu", True, 2, out_dtype=torch.bfloat16, cluster_n=2),
    LinearConfig(FP8, torch.int32, 128, 128, "cand", "relu", True, 2, out_dtype=torch.bfloat16, consumers_per_tile=2,
                 promote=True, cluster_n=2),
]
