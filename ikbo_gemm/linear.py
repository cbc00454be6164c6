"""ikbo_gemm.linear: a linear layer on concatenated user and candidate features, decomposed.

    out[b] = act(cat(x_user[idx[b]], x_cand[b]) @ weight.T + bias)
           = act(x_cand[b] @ w_cand.T + (x_user @ w_user.T)[idx[b]] + bias)

The user GEMM runs once per user into an fp32 workspace [U, N]; the candidate GEMM's epilogue
adds each row's user result, the bias and the activation in fp32 and rounds once (LinearSm90:
two launches of one kernel class on the current stream, the second overlapping the first).

Alignment. TMA needs 16-byte row pitches: x and w are taken as they are wherever their rows
start 16 bytes apart (TMA reads zeros past K), else copied into rows padded along K (a copy of
each: for x_cand a slow path); an N that is not a multiple of 8 stores into a padded buffer
that is then copied into the output, and inputs not 16-byte aligned are copied.

Candidate tiles. Ping-pong tiles (``config.pick_linear_tile``: the least padded output), or,
with 16-bit operands, 128 x 256 tiles both consumer warpgroups share where K_cand and the grid
are large enough and N not (``PlanRules.shared_tile_min_k``, ``shared_tile_max_n``): per MAC
they move fewer operand bytes through L2 and shared memory, but their epilogue no longer
overlaps another tile's main loop.

Grids of few tiles. Where the candidate tiles fill at most half the SMs, each CTA runs one
tile and the phase takes one tile's time: the op then takes a smaller tile
(``config.pick_cand_tile``). Where the candidate grid is one partial wave, the user phase runs
on the SMs it leaves idle only where its CTAs end about when the candidate main loops do
(``PlanRules.spare_by_time``; else it runs ahead as the wide user phase; FP8 calls under
``fp8_promote``: where its tiles are no more MACs than a candidate tile). Where N >= 4096 the
user phase runs in narrow tiles and up to 8 K slices wherever it may hold back candidate CTAs
(``PlanRules.wide_user_min_n``; ``wide_user`` at every N). Where the user phase runs ahead of
the candidate grid in K slices, it splits K instead over clusters of 2 or 4 CTAs a tile that add
their partial sums in shared memory: one workspace slab (``PlanRules.user_cluster_split``; not
FP8 calls under ``fp8_promote``, whose slices stay slabs). ``PlanRules`` adds choices
that are off: the tiles' K loop split over clusters of 2 or 4 CTAs that add their partial sums
in shared memory (``config.pick_cand_split``), and the user phase as K-split pairs on the 2-CTA
slots that candidate clusters leave (both slower on the whole, timed).

Memory: besides the output, each call allocates the fp32 workspace, 4 bytes per element of
[U, N] with U rounded up to the user tile's rows (128 or 64) and N to the tile width, times
the user phase's K slices written as slabs (1 to 4, up to 8 with ``PlanRules.wide_user``; 1
where they run as K-split clusters).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cute_kernels import (
    CompiledKernel,
    PlanCache,
    max_active_clusters,
    copy_back,
    forward_only,
    into_out,
    k_major_operand,
    kernel_cache,
    library_op,
    on_device,
    on_gpu,
    plan_key,
    require_sm90,
    sm_count,
    store_target,
)
from cute_kernels.policy_spec import parse_spec, spec_of
from cute_kernels.checks import check_index_range, check_out_target, policy_or_default, validation_enabled

from .checks import FP8, check_linear_inputs, check_out_dtype
from .compile import compile_linear_config
from .config import (
    LINEAR_FP8_CAND_TILES,
    LINEAR_PROMOTE_TILES,
    LINEAR_SHARED_TILE,
    LINEAR_SPLIT_TILES,
    LINEAR_TILES,
    LinearConfig,
    linear_configs,
    pick_cand_split,
    pick_cand_tile,
    pick_linear_tile,
    round_up,
    takes_cluster_n,
    tile_cost,
)
from .linear_sm90 import LinearEpilogue, LinearLaunch, LinearOperands
from .reference import linear_reference

_INPUT_NAMES = ("x_cand", "x_user", "idx", "w_cand", "w_user", "bias")
# CTAs per cluster of the candidate phase where there are two row tiles or more (they share
# each B tile by TMA multicast) and K is not split.
_CAND_CLUSTER = 2


@dataclasses.dataclass(frozen=True)
class PlanRules:
    """The launch policy of :func:`linear` (its ``rules`` argument; part of the plan key): choices
    for grids of few tiles, each timed against the plan without it in one run
    (``perf/bench_linear.py``, provider "ikbo linear, small-grid rules").

    Off in the op (``DEFAULT_RULES``): on the H200 they were faster at 2 of the 13 points of
    the small-grid sweep where they change the plan and slower at most others
    (docs/perf/2026-12-05-linear-split-k-timed.md). The kernels they pick (LinearConfig.split_k)
    stay compiled and tested.

    The last four fields force a choice the plan would make itself (None: it does), so that a
    test or a benchmark runs a given kernel configuration or grid on purpose."""

    split_k: bool = False  # candidate tiles that fill at most half the SMs: K over clusters (pick_cand_split)
    user_pairs: bool = False  # the user phase on the 2-CTA slots a partial candidate wave leaves, K-split pairs
    wide_user: bool = False  # the user phase in narrow tiles and up to 8 K slices, never on the spare SMs alone
    # ... and so wherever N is at least this (None: only with wide_user). On the H100 (bf16, ratio
    # 70, graph) N 4096 ran 0.88x to 1.02x the time without it over B 512 to 8192 and both K
    # pairs, N 1024 and 256 up to 1.38x: docs/perf/2026-12-06-linear-h100-grid.md.
    wide_user_min_n: Optional[int] = 4096
    # The candidate phase in 128 x 256 tiles both consumers share (LINEAR_SHARED_TILE) where K_cand
    # is at least shared_tile_min_k, N at most shared_tile_max_n, the tiles fill every SM at least
    # once and pad N no more than the usual tile (16-bit operands; None turns a bound off, and a
    # min_k of None the shared tile). On the H100 (bf16, ratio 70, graph, B 4096 to 16384) it ran
    # 0.91 to 1.01x the ping-pong time at N 1024, 0.95 to 1.13x at N 2048 and up to 1.18x at
    # N 4096: docs/perf/2026-12-06-linear-shared-tile.md. Only where its rounds of the grid hold no
    # more outputs an SM (B 6144: 0.85x the time at K 1024 + 2048, H100:
    # docs/perf/2026-12-07-linear-row-group-raster-h100.md).
    shared_tile_min_k: Optional[int] = 1024
    shared_tile_max_n: Optional[int] = 1024
    # The user phase's K slices (where its grid runs ahead of the candidate grid) as K-split
    # clusters of 2 or 4 CTAs that add their partial sums in shared memory: one workspace slab for
    # the candidate epilogue to read instead of one a slice. On the H100 (bf16, ratio 70, graph)
    # 0.90 to 1.003x the time without it over B 2048 to 8192, both K pairs and N 1024 to 4096
    # (B 4096, K 1024 + 2048, N 4096: 119 -> 108 us): docs/perf/2026-12-06-linear-user-cluster-split.md.
    # FP8, with spare_by_time (H100, ratio 70, relu, graph, L2 cold; B 2048 to 8192, K 1024 + 2048
    # to 4096 + 4096, N 256 and 1024): 0.77 to 1.00x the time of both off where the plan changes
    # (B 2048, K 4096 + 4096, N 1024: 35.1 -> 27.0 us; B 4096, 4096 + 4096, N 256: 23.0 -> 20.1;
    # B 8192, 1024 + 2048, N 1024: 47.1 -> 43.6; B 8192, 4096 + 4096, N 1024: 75.0 -> 69.3), within
    # noise (3%, the spread of identical plans) elsewhere: docs/perf/2026-12-07-linear-fp8-rules-h100.md.
    # None: on, but for FP8 calls under fp8_promote (no K-split promoting configurations: slabs);
    # True: on (never with fp8_promote); False: off.
    user_cluster_split: Optional[bool] = None
    # The user phase on the SMs a partial candidate wave leaves idle only where each of its CTAs,
    # streaming its operands, ends about when the candidate main loops do (_spare_user_time_fits;
    # else it runs ahead, in many short CTAs: the wide user phase); False: by MACs alone; None: on,
    # but for FP8 calls under fp8_promote (their user phase ahead has no K-split clusters: up to 8
    # workspace slabs). On the H100 (graph) it ran 3 to 10% faster at every bf16 point where it
    # changes the plan (docs/perf/2026-12-07-linear-timeline-h100.md). FP8: with user_cluster_split
    # see that field; without it (the user phase ahead as up to 8 slabs) 17% faster at B 2048,
    # N 1024 and 17 to 25% slower at B 4096, N 256 (19.5 against 16.5 us), the slabs' cost.
    spare_by_time: Optional[bool] = None
    cand_split: Optional[tuple] = None  # ((tile_m, tile_n), split_k) of the candidate phase
    cand_clusters: Optional[int] = None  # at most this many candidate clusters (each then walks more tiles)
    # (tile_m, tile_n) of the user phase (where wide_user does not pick; K-split clusters take
    # 128 x 128 or 64 x 128 in place of 128 x 192)
    user_tile: Optional[tuple] = None
    # at most this many K slices of the user phase (workspace slabs, or CTAs of a K-split cluster)
    user_splits: Optional[int] = None
    # FP8 calls: both phases promote each k-block's sum into fp32 registers (LinearConfig.promote),
    # as accurate as torch._scaled_mm; the 128 x 128 candidate tile shared by both consumers, user
    # tiles of LINEAR_PROMOTE_TILES, no K split. 16-bit calls: no effect.
    fp8_promote: bool = False
    # The candidate walk in bands of this many cluster row groups, row group fastest within a
    # band (1: column tile fastest, the tiles running together sharing their A rows); tiles of at
    # most 128 x 128 a consumer (LinearConfig.banded; wider ones keep column tile fastest). None:
    # BAND_ROWS where a band over every column tile fits the clusters resident at once (few
    # column tiles), else 1 (``_band_rows``; docs/perf/2026-12-07-linear-row-group-raster-h100.md).
    cand_band_rows: Optional[int] = None
    # Column tiles a candidate cluster shares its A tiles over (LinearConfig.cluster_n): 2 makes the
    # 2-CTA clusters of neighbouring row tiles 2 x 2 ones that multicast both operands, halving the
    # A tile's L2 reads as the pairs halve the B tile's (where the phase has 2-CTA clusters, no K
    # split, at least 2 column tiles and at most 128 x 128 outputs a consumer). None: 1, until
    # timed (4-CTA clusters may hold fewer SMs): docs/perf/2026-12-08-linear-2x2-clusters.md.
    cand_cluster_n: Optional[int] = None

    def __post_init__(self):
        for name in ("split_k", "user_pairs", "wide_user", "fp8_promote"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PlanRules.{name} must be a bool, got {getattr(self, name)!r}")
        split = self.cand_split
        if split is not None and not (isinstance(split, tuple) and len(split) == 2 and (
                (split[0] in LINEAR_TILES and split[1] in (1, 2, 4)) or (split[0] == LINEAR_SHARED_TILE and split[1] == 1))):
            raise ValueError(f"PlanRules.cand_split must be ((tile_m, tile_n) of {LINEAR_TILES}, 1, 2 or 4) or "
                             f"({LINEAR_SHARED_TILE}, 1), got {split!r}")
        for name in ("user_cluster_split", "spare_by_time"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise TypeError(f"PlanRules.{name} must be None or a bool, got {getattr(self, name)!r}")
        if self.cand_clusters is not None and (isinstance(self.cand_clusters, bool)
                                               or not isinstance(self.cand_clusters, int) or self.cand_clusters < 1):
            raise ValueError(f"PlanRules.cand_clusters must be a positive int, got {self.cand_clusters!r}")
        if self.cand_cluster_n not in (None, 1, 2) or isinstance(self.cand_cluster_n, bool):
            raise ValueError(f"PlanRules.cand_cluster_n must be None, 1 or 2, got {self.cand_cluster_n!r}")
        for name in ("wide_user_min_n", "shared_tile_min_k", "shared_tile_max_n", "user_splits", "cand_band_rows"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"PlanRules.{name} must be a positive int or None, got {v!r}")
        if self.user_tile is not None and self.user_tile not in LINEAR_TILES:
            raise ValueError(f"PlanRules.user_tile must be one of {LINEAR_TILES}, got {self.user_tile!r}")
        if self.fp8_promote and (self.split_k or self.user_pairs or (split is not None and split[1] > 1)
                                 or self.user_tile not in (None, *LINEAR_PROMOTE_TILES)):
            raise ValueError(f"PlanRules.fp8_promote takes no K split (split_k, user_pairs, a cand_split over "
                             f"clusters) and user tiles of {LINEAR_PROMOTE_TILES} only; got split_k={self.split_k}, "
                             f"user_pairs={self.user_pairs}, cand_split={split!r}, user_tile={self.user_tile!r}")

    @classmethod
    def parse(cls, spec: str) -> "PlanRules":
        """``'wide_user=1,user_tile=64x128'`` -> DEFAULT_RULES with those fields replaced
        (``cute_kernels.policy_spec``; cand_split as tile_m x tile_n x split)."""
        return parse_spec(DEFAULT_RULES, spec, {"cand_split": lambda t: (t[:2], t[2]) if len(t) == 3 else t})

    def spec(self) -> str:
        """The fields that differ from DEFAULT_RULES as ``parse`` reads them ('' for the default)."""
        return spec_of(self, DEFAULT_RULES)


DEFAULT_RULES = PlanRules()
SMALL_GRID_RULES = PlanRules(split_k=True, user_pairs=True)
# Not timed yet (docs/perf/2026-12-05-linear-wide-user-phase.md).
WIDE_USER_RULES = PlanRules(wide_user=True)
SPLIT_WIDE_USER_RULES = PlanRules(split_k=True, wide_user=True)
# The candidate phase in ping-pong tiles only.
NO_SHARED_TILE_RULES = PlanRules(shared_tile_min_k=None)
# The user phase's K slices each a workspace slab of its own (user_cluster_split off).
NO_USER_CLUSTER_SPLIT_RULES = PlanRules(user_cluster_split=False)
# The spare SMs' user CTAs chosen by their MACs alone (spare_by_time off; the default does so
# only for FP8 calls under fp8_promote).
SPARE_BY_MACS_RULES = PlanRules(spare_by_time=False)
# FP8 calls with promotion (docs/perf/2026-12-07-fp8-accumulator-promotion.md).
FP8_PROMOTE_RULES = PlanRules(fp8_promote=True)
# Row groups a band of the default candidate walk, where it takes bands (PlanRules.cand_band_rows).
BAND_ROWS = 8
# The candidate walk in bands of 8 row groups, row group fastest, at any column count; and
# column tile fastest at any (the order before the bands).
ROW_GROUP_RASTER_RULES = PlanRules(cand_band_rows=BAND_ROWS)
COLUMN_WALK_RULES = PlanRules(cand_band_rows=1)
# The candidate phase in the shared 128 x 256 tile at any shape.
SHARED_TILE_RULES = PlanRules(cand_split=(LINEAR_SHARED_TILE, 1))
# The candidate phase in 2 x 2 clusters that multicast both operands, where it has 2-CTA clusters.
CLUSTER_2X2_RULES = PlanRules(cand_cluster_n=2)


def split_weight(weight: torch.Tensor, k_user: int, user_first: bool = True):
    """(w_cand, w_user) of an nn.Linear weight [N, K_user + K_cand] that consumes the
    concatenation of user and candidate features (user features first, or last with
    ``user_first=False``), as contiguous copies: split once, when the model is loaded."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [N, K_user + K_cand], got {getattr(weight, 'shape', weight)!r}")
    k_total = weight.shape[1]
    if isinstance(k_user, bool) or not isinstance(k_user, int) or not 0 < k_user < k_total:
        raise ValueError(f"k_user must be an int in [1, {k_total - 1}] (weight has {k_total} input features), "
                         f"got {k_user!r}")
    if user_first:
        w_user, w_cand = weight[:, :k_user], weight[:, k_user:]
    else:
        w_cand, w_user = weight[:, : k_total - k_user], weight[:, k_total - k_user:]
    return w_cand.contiguous(), w_user.contiguous()


def _kernel(cfg: LinearConfig) -> CompiledKernel:
    return kernel_cache.get(("ikbo_gemm.linear", cfg), lambda: compile_linear_config(cfg), package="ikbo_gemm")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a call needs that depends only on shapes, dtypes, options and device."""

    user: CompiledKernel
    cand: CompiledKernel
    out_shape: tuple  # (B, N)
    n8: int
    k8_cand: int
    k8_user: int
    ws_shape: tuple  # (splits, U_pad, N_pad) fp32
    n_users: int
    splits: int  # slices of the user phase's K: workspace slabs
    grid_user: int
    grid_cand: int
    band_rows: int  # the candidate walk's (LinearLaunch.band_rows)
    user_cfg: LinearConfig
    cand_cfg: LinearConfig
    out_dtype: torch.dtype
    fp8: bool


_plans = PlanCache()


def _plan(x_cand, x_user, idx, w_cand, w_user, bias, activation, out, rules: PlanRules, scales: dict,
          out_dtype) -> Optional[_Plan]:
    """The launch plan for these shapes (None off the GPU or for B = 0); inputs fully checked
    once per signature."""
    # A plan holds compiled kernels: the key names where they come from (``_kernel``).
    key = plan_key(x_cand, x_user, idx, w_cand, w_user, bias, out, activation, rules, _kernel,
                   tuple(scales.values()), out_dtype)
    plan = _plans.get(key, False)
    if plan is not False:
        return plan
    B, U, N, K_cand, K_user = check_linear_inputs(x_cand, x_user, idx, w_cand, w_user, bias, activation, out, False,
                                                  out_dtype=out_dtype, **scales)
    fp8 = x_cand.dtype == FP8
    # FP8 k-blocks hold 128 elements (128 bytes), 16-bit ones 64: the grids count 64-element
    # blocks, so FP8 gives them half of K. TMA row pitches: 16 bytes.
    k_plan_cand, k_plan_user = (-(-K_cand // 2), -(-K_user // 2)) if fp8 else (K_cand, K_user)
    k_align = 16 if fp8 else 8
    plan = None
    if on_gpu(x_cand):
        device = x_cand.device
        require_sm90(device, "linear")
    if on_gpu(x_cand) and B > 0:
        grids = _grids(B, U, N, k_plan_cand, k_plan_user, sm_count(device),
                       lambda size: max_active_clusters(device, size), rules, fp8)
        out_dtype = check_out_dtype(out_dtype, x_cand.dtype)
        user_cfg, cand_cfg = linear_configs(x_cand.dtype, idx.dtype, grids.tile_user, grids.tile_cand, activation,
                                            bias is not None, grids.cluster, grids.split_cand, grids.split_user,
                                            out_dtype if fp8 else None, promote=fp8 and rules.fp8_promote,
                                            cluster_n_cand=grids.cluster_n)
        plan = _Plan(
            user=_kernel(user_cfg),
            cand=_kernel(cand_cfg),
            out_shape=(B, N),
            n8=round_up(N, 8),
            k8_cand=round_up(K_cand, k_align),
            k8_user=round_up(K_user, k_align),
            # Padded to whole tiles of both phases (the candidate phase's: whole column groups).
            ws_shape=(grids.splits, round_up(U, grids.tile_user[0]),
                      max(round_up(N, grids.tile_user[1]), round_up(N, grids.tile_cand[1] * grids.cluster_n))),
            n_users=U,
            splits=grids.splits,
            grid_user=grids.grid_user,
            grid_cand=grids.grid_cand,
            band_rows=grids.band_rows if cand_cfg.banded else 1,
            user_cfg=user_cfg,
            cand_cfg=cand_cfg,
            out_dtype=out_dtype,
            fp8=fp8,
        )
    return _plans.keep(key, plan)


@dataclasses.dataclass(frozen=True)
class _Grids:
    """Tiles, clusters and grid sizes of both phases (the shape-only part of a plan)."""

    tile_user: tuple
    tile_cand: tuple
    cluster: int  # candidate CTAs sharing B tiles
    cluster_n: int  # ... and on neighbouring column tiles, sharing A tiles (a cluster of cluster x cluster_n)
    split_cand: int  # candidate CTAs sharing one tile's K loop
    split_user: int  # user CTAs sharing one tile's K loop (pairs on spare 2-CTA slots)
    splits: int  # user phase slices of K written as workspace slabs
    grid_user: int
    grid_cand: int
    band_rows: int = 1  # row groups a band of the candidate walk (where its configuration is banded)


def _grids(B: int, U: int, N: int, K_cand: int, K_user: int, sms: int, clusters, rules: PlanRules,
           fp8: bool = False) -> _Grids:
    """Both phases' grids. ``clusters(size)``: clusters of that many CTAs resident at once. FP8:
    the candidate tiles of LINEAR_FP8_CAND_TILES; promoting (``rules.fp8_promote``), the user
    tiles of LINEAR_PROMOTE_TILES, the user phase's K slices as slabs (never K-split clusters)
    and, unless the rules say True, its spare SMs by MACs (``_unless_promoted``)."""
    promote = fp8 and rules.fp8_promote
    user_tiles = LINEAR_PROMOTE_TILES if promote else LINEAR_TILES
    g = _chosen_grids(B, U, N, K_cand, K_user, sms, clusters, rules, LINEAR_FP8_CAND_TILES if fp8 else LINEAR_TILES,
                      shared_tile=not fp8, user_tile_set=user_tiles,
                      cluster_split=not promote and rules.user_cluster_split is not False,
                      spare_by_time=_unless_promoted(rules.spare_by_time, promote))
    if rules.cand_clusters is not None:
        g = dataclasses.replace(g, grid_cand=min(g.grid_cand, rules.cand_clusters * g.split_cand * g.cluster
                                                 * g.cluster_n))
    return dataclasses.replace(g, band_rows=_band_rows(g, N, clusters, rules))


def _band_rows(g: _Grids, N: int, clusters, rules: PlanRules) -> int:
    """Row groups a band of the candidate walk: the rules', or BAND_ROWS where a band over every
    column tile fits the clusters resident at once (up to 8 column tiles: a wave then holds the
    same tiles in either order, and only their placement changes; bands took 14% of the L2 read
    requests off), else 1 (column tile fastest: with more column tiles a band of 8 ran 3 to 15%
    slower on the H100)."""
    if rules.cand_band_rows is not None:
        return rules.cand_band_rows
    if g.split_cand > 1:
        return 1
    column_groups = -(-N // (g.tile_cand[1] * g.cluster_n))
    return BAND_ROWS if BAND_ROWS * column_groups <= clusters(g.cluster * g.cluster_n) else 1


def _unless_promoted(choice: Optional[bool], promote: bool) -> bool:
    """A PlanRules choice that may be None: the choice, or None's meaning, on unless the call is
    an FP8 one under ``fp8_promote`` (``promote``)."""
    return not promote if choice is None else choice


def _chosen_grids(B: int, U: int, N: int, K_cand: int, K_user: int, sms: int, clusters, rules: PlanRules,
                  cand_tile_set: tuple, shared_tile: bool = True, cluster_split: bool = True,
                  user_tile_set: tuple = LINEAR_TILES, spare_by_time: bool = True) -> _Grids:
    kb_cand, kb_user = -(-K_cand // 64), -(-K_user // 64)
    tile_user = rules.user_tile or pick_linear_tile(U, N, user_tile_set)
    if rules.cand_split is not None:
        tile_cand, split_cand = rules.cand_split
    elif rules.split_k:
        tile_cand, split_cand = pick_cand_split(B, N, kb_cand, sms, clusters, cand_tile_set)
    else:
        tile_cand, split_cand = pick_cand_tile(B, N, sms, cand_tile_set), 1
    if split_cand == 1 and rules.cand_split is None and shared_tile and _takes_shared_tile(B, N, K_cand, sms,
                                                                                          tile_cand, rules):
        tile_cand = LINEAR_SHARED_TILE
    cand_tiles, user_tiles = _tiles(B, N, tile_cand), _tiles(U, N, tile_user)
    most = rules.user_splits or WIDE_USER_SLICES
    splits = _user_splits(user_tiles, kb_user, sms, min(4, most))
    base = dict(tile_user=tile_user, tile_cand=tile_cand, split_cand=split_cand, split_user=1, splits=splits,
                grid_user=min(sms, splits * user_tiles))
    # The user phase where its grid may run before candidate CTAs (every return below but the
    # spare SMs' ones). wide_user: narrower tiles and up to 8 K slices, so that those start
    # sooner, and never the spare SMs' long user CTAs (whose K loops may outlast the candidates').
    wide_user = rules.wide_user or (rules.wide_user_min_n is not None and N >= rules.wide_user_min_n)

    def ahead_grids(wide: bool) -> dict:
        ahead = base
        if wide:
            wide_tile = _wide_user_tile(U, N, user_tile_set)
            wide_tiles = _tiles(U, N, wide_tile)
            wide_splits = _user_splits(wide_tiles, kb_user, sms, most)
            ahead = dict(base, tile_user=wide_tile, splits=wide_splits, grid_user=min(sms, wide_splits * wide_tiles))
        if cluster_split:
            ahead = _user_cluster_split(ahead, U, N, kb_user, clusters)
        return ahead

    ahead = ahead_grids(wide_user)
    if split_cand > 1:
        # One cluster per tile (pick_cand_split keeps them one wave); the kernel needs a k-block
        # in every CTA's slice.
        if (split_cand - 1) * -(-kb_cand // split_cand) >= kb_cand:
            raise ValueError(f"linear: {kb_cand} k-blocks leave a CTA of a {split_cand}-way K split none")
        return _Grids(cluster=1, cluster_n=1, grid_cand=cand_tiles * split_cand, **ahead)
    cluster = _CAND_CLUSTER if B > tile_cand[0] else 1
    two_by_two = rules.cand_cluster_n == 2 and cluster == 2 and N > tile_cand[1] and takes_cluster_n(tile_cand)
    cluster_n = 2 if two_by_two else 1
    size = cluster * cluster_n
    m_groups = -(-B // (tile_cand[0] * cluster))
    cand_clusters = min(clusters(size), m_groups * -(-N // (tile_cand[1] * cluster_n)))
    cand_grid = dict(cluster=cluster, cluster_n=cluster_n, grid_cand=cand_clusters * size)
    cand_work = tile_cand[0] * tile_cand[1] * K_cand
    if wide_user or cand_tiles > cand_clusters * size or cand_clusters * size >= sms:
        return _Grids(**ahead, **cand_grid)  # wide_user, or no SM left idle by a partial wave
    spare = _spare_user_grid(user_tiles, tile_user[0] * tile_user[1] * K_user, cand_work,
                             sms - cand_clusters * size)
    if spare and spare_by_time and not _spare_user_time_fits(
            -(-user_tiles // spare) * (min(U, tile_user[0]) + tile_user[1]) * K_user, cand_work):
        # The spare SMs' user CTAs would stream their w_user columns for longer than the
        # candidate main loops run: the user phase runs ahead, in many short CTAs instead.
        return _Grids(**ahead_grids(True), **cand_grid)
    if size == 2 and clusters(2) - spare < cand_clusters and rules.user_pairs and kb_user >= 2:
        # Single user CTAs, each on an SM of its own 2-CTA slot, would leave too few slots for
        # the candidate clusters (some would wait for a user CTA); K-split pairs take whole slots.
        pairs = _spare_user_grid(user_tiles, tile_user[0] * tile_user[1] * K_user / 2, cand_work,
                                 clusters(2) - cand_clusters)
        if pairs:
            return _Grids(**dict(base, split_user=2, splits=1, grid_user=2 * pairs), **cand_grid)
    if spare:
        return _Grids(**dict(base, splits=1, grid_user=spare), **cand_grid)
    return _Grids(**ahead, **cand_grid)


def _takes_shared_tile(B: int, N: int, K_cand: int, sms: int, tile: tuple, rules: PlanRules) -> bool:
    """Whether the candidate phase runs LINEAR_SHARED_TILE instead of ``tile`` (``PlanRules.shared_tile_min_k``,
    ``shared_tile_max_n``): K_cand and N in bounds, a shared tile per SM or more, no more padded output,
    and no more rounds of the grid in outputs an SM computes: at B 6144, N 1024 the shared tiles
    make 1.45 rounds (the busiest SMs run 2 shared tiles) where 128 x 128 tiles make 2.9 (3 such
    tiles, 1.5 shared ones' outputs)."""
    shared = LINEAR_SHARED_TILE
    rounds = lambda t: -(-_tiles(B, N, t) // sms) * t[0] * t[1]  # noqa: E731
    return (rules.shared_tile_min_k is not None and K_cand >= rules.shared_tile_min_k
            and (rules.shared_tile_max_n is None or N <= rules.shared_tile_max_n)
            and _tiles(B, N, shared) >= sms and tile_cost(*shared, N, B) <= tile_cost(*tile, N, B)
            and rounds(shared) <= rounds(tile))


def _user_cluster_split(grids: dict, U: int, N: int, kb_user: int, clusters) -> dict:
    """``grids`` with the user phase's K slices as K-split clusters (``PlanRules.user_cluster_split``):
    2 or 4 CTAs a tile (as many as the slices, at most 4), in a tile a K split takes, one slab."""
    if grids["splits"] < 2:
        return grids
    tile = grids["tile_user"]
    if tile not in LINEAR_SPLIT_TILES:
        tile = (64, 128) if U <= 64 else (128, 128)
    s = 4 if grids["splits"] >= 4 else 2
    if (tile[1] // 16) % s or (s - 1) * -(-kb_user // s) >= kb_user:
        return grids
    return dict(grids, tile_user=tile, splits=1, split_user=s, grid_user=min(clusters(s), _tiles(U, N, tile)) * s)


def _tiles(rows: int, n: int, tile: tuple) -> int:
    """Tiles of ``tile`` = (rows, columns) over a [rows, n] output."""
    return -(-rows // tile[0]) * -(-n // tile[1])


def _spare_user_grid(user_tiles: int, user_work: float, cand_work: float, free: int) -> int:
    """User CTAs (or K-split pairs) for the ``free`` SMs (or 2-CTA slots) the candidate grid,
    one partial wave, leaves idle, or 0. User CTAs elsewhere would hold back candidate CTAs
    (they start on an SM once the user grid left it) by a user tile each, all of it exposed;
    on the idle SMs they run beside the candidate tiles. Taken only where each one's share of
    the user tiles (``user_work`` a tile and CTA) is no more work than a candidate tile
    (``cand_work``), so that the candidate epilogue's wait on the workspace falls at the end of
    its main loop."""
    if free <= 0:
        return 0
    spare = min(free, user_tiles)
    return spare if -(-user_tiles // spare) * user_work <= cand_work else 0


# What one CTA moves, as measured on the H100 (bf16; FP8 in the plan's 64-element k-blocks, the same
# bytes and wgmma time per block): a spare SM's user CTA streamed its operands at about 41 bytes a
# cycle, a 128 x 128 candidate tile ran about 1,415 MACs a cycle, at about 1.75 GHz.
SM_STREAM_BYTES_PER_CYCLE = 41
SM_MACS_PER_CYCLE = 1415
SM_CYCLES_PER_US = 1750
# How far the spare SMs' user CTAs may outlast the candidate main loops: the candidate epilogue
# waits for them, but a call's fixed costs hide a little of it.
SPARE_SLACK_US = 2.0


def _spare_user_time_fits(user_load: int, cand_work: int) -> bool:
    """Whether a spare SM's user CTA, streaming ``user_load`` 16-bit operand elements (its tiles'
    x_user rows and w_user columns over K_user), ends within SPARE_SLACK_US of a candidate CTA's
    main loop of ``cand_work`` MACs. A user tile of few rows and the whole K_user moves its bytes
    at what one SM can pull from L2, not at its MAC rate: on the H100 (B 2048, K 4096 + 4096,
    N 1024, bf16) four such CTAs took 31 us beside candidate main loops of 27 us, and the
    candidate epilogues waited for them (docs/perf/2026-12-07-linear-timeline-h100.md)."""
    user_cycles = 2 * user_load / SM_STREAM_BYTES_PER_CYCLE
    return user_cycles - cand_work / SM_MACS_PER_CYCLE <= SPARE_SLACK_US * SM_CYCLES_PER_US


# Most K slices of the user phase with PlanRules.wide_user (4 without): each is a workspace slab
# that every candidate epilogue adds.
WIDE_USER_SLICES = 8


def _wide_user_tile(U: int, N: int, tiles: tuple = LINEAR_TILES) -> tuple[int, int]:
    """The user tile of PlanRules.wide_user: 64 x 128 where U fits one 64-row tile (the phase
    then streams w_user; narrower tiles make more CTAs for the same bytes), else the usual."""
    return (64, 128) if U <= 64 else pick_linear_tile(U, N, tiles)


def _user_splits(user_tiles: int, k_blocks: int, sms: int, most: int = 4) -> int:
    """Slices of K for the user phase. The candidate grid starts on an SM once the user grid
    has left it, so a user phase of few, long tiles delays part of the candidate grid by a
    whole tile; up to ``most`` slices of at least 2 k-blocks each spread it over the SMs. The
    count is such that every slice has a k-block."""
    target = max(1, min(most, sms // max(user_tiles, 1), k_blocks // 2))
    per_split = -(-k_blocks // target)
    return -(-k_blocks // per_split)


def linear(x_cand, x_user, idx, w_cand, w_user, bias=None, *, activation=None, out=None, validate=None, rules=None,
           x_cand_scale=None, x_user_scale=None, w_cand_scale=None, w_user_scale=None, out_dtype=None):
    """IKBO linear layer: ``out[b] = act(x_cand[b] @ w_cand.T + x_user[idx[b]] @ w_user.T + bias)``.

    Shapes: x_cand [B, K_cand], x_user [U, K_user], idx [B] (int32 or int64, values in [0, U),
    any order), w_cand [N, K_cand], w_user [N, K_user] (nn.Linear's [out, in] layout; see
    :func:`split_weight`), bias [N] (optional). fp16 or bf16, all one dtype; fp32 accumulation,
    the user and candidate partial sums and the bias added in fp32 and rounded once, after
    ``activation``: None, "relu", "gelu" (erf), "gelu_tanh", "silu" or "sigmoid".

    FP8: all four operands float8_e4m3fn (``quantize_fp8``), each with its float32 scale,
    ``x_cand_scale`` [B], ``x_user_scale`` [U], ``w_cand_scale`` [N], ``w_user_scale`` [N], or
    0-d for one per tensor: ``out[b] = act(sxc[b] swc * (xc8[b] @ wc8.T) + sxu[idx[b]] swu *
    (xu8[idx[b]] @ wu8.T) + bias)``, the scales applied to the fp32 sums, one rounding to
    ``out_dtype`` (bf16 by default, or fp16); bias bf16, fp16 or fp32. (Rows whose pitch is
    not a multiple of 16 bytes are copied into padded ones for TMA; a 0-d scale is repeated
    per row, a bias converted to fp32: small copies.)

    ``out`` (optional): a contiguous [B, N] tensor of the output dtype, any alignment, sharing
    no memory with the inputs (ValueError otherwise); written as torch writes in place.

    ``validate`` (default: the IKBO_VALIDATE environment variable) checks that every idx lies
    in [0, U), raising IndexError at the first bad position (a host synchronization; inside a
    CUDA-graph capture validate=True raises). Without it an out-of-range index never reads or
    writes outside the tensors: that candidate's output row is NaN.

    ``rules``: the launch policy, a :class:`PlanRules` (default: ``DEFAULT_RULES``, the shipped
    plan). It changes which kernels run and on how many CTAs, never the result beyond fp32
    summation order; a benchmark times an alternative by passing it. Eager calls only: under
    torch.compile rules other than the ``DEFAULT_RULES`` object raise ValueError.

    B = 0 gives an empty [0, N] result. CPU tensors run :func:`linear_reference`; a CUDA GPU
    other than sm_90 raises. No host synchronization (unless validating); CUDA-graph capturable.
    Under torch.compile a call is traced as one node, ``torch.ops.ikbo_gemm.linear``. The kernel
    has no backward: with grad mode on and an input that requires grad, the output's backward
    raises (use :func:`linear_reference` for gradients).
    """
    scales = dict(x_cand_scale=x_cand_scale, x_user_scale=x_user_scale, w_cand_scale=w_cand_scale,
                  w_user_scale=w_user_scale)
    if torch.compiler.is_compiling():
        if rules is not None and rules is not DEFAULT_RULES:  # identity: nothing for the tracer to evaluate
            raise ValueError("linear: rules other than DEFAULT_RULES are for eager calls (the op torch.compile "
                             "traces takes the shipped plan)")
        # Traced by torch.compile: the registered op (one node), out= filled by a copy.
        return into_out(out, torch.ops.ikbo_gemm.linear(x_cand, x_user, idx, w_cand, w_user, bias, activation,
                                                        validate, *scales.values(), out_dtype))
    rules = policy_or_default("linear", "rules", rules, PlanRules, DEFAULT_RULES)
    plan = _plan(x_cand, x_user, idx, w_cand, w_user, bias, activation, out, rules, scales, out_dtype)
    inputs = (x_cand, x_user, idx, w_cand, w_user, bias)
    if out is not None:
        check_out_target("out", out, _INPUT_NAMES, inputs)
    if validation_enabled(validate):
        check_index_range("idx", idx, x_user.shape[0], "U", "the batch of x_user")
    if plan is None:  # off the GPU, or no candidates
        return linear_reference(*inputs, activation=activation, out=out, validate=False, out_dtype=out_dtype,
                                **scales)
    with on_device(x_cand.device):
        return forward_only(
            "ikbo_gemm.linear",
            "ikbo_gemm.linear_reference",
            lambda xc, xu, wc, wu, b, out: _run(plan, xc, xu, idx, wc, wu, b, out, scales),
            (x_cand, x_user, w_cand, w_user, bias),
            out,
        )


def _scale_vector(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """An FP8 scale as the kernel reads it: one fp32 per row (a 0-d scale repeated), contiguous."""
    return scale.expand(rows).contiguous() if scale.dim() == 0 else scale.contiguous()


def _run(plan: _Plan, x_cand, x_user, idx, w_cand, w_user, bias, out, scales: dict) -> torch.Tensor:
    """Launch the user phase, then the candidate phase (on checked inputs); return ``out``."""
    device = x_cand.device
    xc, wc = k_major_operand(x_cand, plan.k8_cand), k_major_operand(w_cand, plan.k8_cand)
    xu, wu = k_major_operand(x_user, plan.k8_user), k_major_operand(w_user, plan.k8_user)
    idx_k = idx if idx.is_contiguous() else idx.contiguous()
    bias_k = None if bias is None else (bias if bias.is_contiguous() else bias.contiguous())
    user_scales, cand_scales = (), ()
    if plan.fp8:  # one scale per row of each operand; the bias in fp32
        N = plan.out_shape[1]
        user_scales = (_scale_vector(scales["x_user_scale"], xu.shape[0]), _scale_vector(scales["w_user_scale"], N))
        cand_scales = (_scale_vector(scales["x_cand_scale"], xc.shape[0]), _scale_vector(scales["w_cand_scale"], N))
        bias_k = None if bias_k is None else bias_k.float()
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=device)
    target = store_target(out, (plan.out_shape[0], plan.n8))
    ws = torch.empty(plan.ws_shape, dtype=torch.float32, device=device)
    plan.user(LinearOperands(xu, wu, idx_k), LinearEpilogue(ws, ws, None, *user_scales),
              LinearLaunch(plan.n_users, plan.splits, plan.grid_user, 1))
    plan.cand(LinearOperands(xc, wc, idx_k), LinearEpilogue(target, ws, bias_k, *cand_scales),
              LinearLaunch(plan.n_users, plan.splits, plan.grid_cand, plan.band_rows))
    return copy_back(out, target)


def _linear_shape(x_cand, x_user, idx, w_cand, w_user, bias=None, activation=None, validate=None, x_cand_scale=None,
                  x_user_scale=None, w_cand_scale=None, w_user_scale=None, out_dtype=None):
    scales = dict(x_cand_scale=x_cand_scale, x_user_scale=x_user_scale, w_cand_scale=w_cand_scale,
                  w_user_scale=w_user_scale)
    B, _, N, _, _ = check_linear_inputs(x_cand, x_user, idx, w_cand, w_user, bias, activation, None, False,
                                        out_dtype=out_dtype, **scales)
    return x_cand.new_empty((B, N), dtype=check_out_dtype(out_dtype, x_cand.dtype))


@library_op("ikbo_gemm::linear", "ikbo_gemm.linear", "ikbo_gemm.linear_reference", _linear_shape)
def _linear_op(
    x_cand: torch.Tensor,
    x_user: torch.Tensor,
    idx: torch.Tensor,
    w_cand: torch.Tensor,
    w_user: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    validate: Optional[bool] = None,
    x_cand_scale: Optional[torch.Tensor] = None,
    x_user_scale: Optional[torch.Tensor] = None,
    w_cand_scale: Optional[torch.Tensor] = None,
    w_user_scale: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``torch.ops.ikbo_gemm.linear``: what torch.compile traces a call of :func:`linear` as."""
    return linear(x_cand, x_user, idx, w_cand, w_user, bias, activation=activation, validate=validate,
                  x_cand_scale=x_cand_scale, x_user_scale=x_user_scale, w_cand_scale=w_cand_scale,
                  w_user_scale=w_user_scale, out_dtype=out_dtype)
