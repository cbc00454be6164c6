"""The configuration modules of both ops (ikbo_gemm.config, ikbo_fa.config): field checks that
name the field, the pick of a configuration, and LceGeometry (the tiling the host plan and the
LCE kernel share) against a brute-force count over the output's elements."""
import dataclasses

import pytest
import torch

import ikbo_fa
import ikbo_gemm
from ikbo_fa.config import AttentionConfig, kernel_config, row_packing
from ikbo_gemm.config import SHIPPED_CONFIGS, LceConfig, LceGeometry, pick_config
from lce_emulation import install, lce_mod
from lce_inputs import random_problem

# ----------------------------------------------------------------------------- field checks

LCE_VALID = LceConfig(torch.float16, torch.int32, 152, 2, 4, 128)
LCE_BAD_FIELDS = {
    "dtype-fp32": (dict(dtype=torch.float32), "LceConfig.dtype must be torch.float16 or torch.bfloat16"),
    "dtype-string": (dict(dtype="fp16"), "LceConfig.dtype"),
    "idx_dtype-int16": (dict(idx_dtype=torch.int16), "LceConfig.idx_dtype must be torch.int32 or torch.int64"),
    "tile_n-96": (dict(tile_n=96), "LceConfig.tile_n must be 64 or 128, got 96"),
    "tile_w-not-a-multiple-of-8": (dict(tile_w=150), r"LceConfig.tile_w must be a multiple of 8 in \[64, 256\], got 150"),
    "tile_w-56": (dict(tile_w=56, tile_n=64), "LceConfig.tile_w"),
    "tile_w-264": (dict(tile_w=264, tile_n=64), "LceConfig.tile_w"),
    "cluster_n-3": (dict(cluster_n=3), r"LceConfig.cluster_n x cluster_b = 3 x 4"),
    "cluster_b-8": (dict(cluster_n=1, cluster_b=8), r"LceConfig.cluster_n x cluster_b = 1 x 8"),
    "cluster-16": (dict(cluster_n=4, cluster_b=4), r"LceConfig.cluster_n x cluster_b = 4 x 4 .* at most 8 CTAs"),
    "accumulator": (dict(tile_w=200), r"LceConfig: tile_n x tile_w = 128 x 200 .* 192 fp32 accumulator registers"),
}


@pytest.mark.parametrize("change, message", LCE_BAD_FIELDS.values(), ids=LCE_BAD_FIELDS.keys())
def test_lce_config_field_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(LCE_VALID, **change)


ATTENTION_VALID = AttentionConfig(torch.bfloat16, 128, 64, "kv", True, True)
ATTENTION_BAD_FIELDS = {
    "dtype-fp32": (dict(dtype=torch.float32), "AttentionConfig.dtype must be torch.float16 or torch.bfloat16"),
    "dtype-string": (dict(dtype="bf16"), "AttentionConfig.dtype"),
    "head_dim-96": (dict(head_dim=96), r"AttentionConfig.head_dim must be one of \(64, 128\), got 96"),
    "s_q-0": (dict(s_q=0), "AttentionConfig.s_q must be an int >= 1, got 0"),
    "s_q-float": (dict(s_q=64.0), "AttentionConfig.s_q must be an int >= 1, got 64.0"),
    "direction": (dict(direction="k"), "AttentionConfig.direction must be 'kv' or 'q', got 'k'"),
    "split_pair-q": (dict(has_kv_lengths=False, direction="q", split_pair=True),
                     "AttentionConfig: split_pair needs direction 'kv' and excludes split_kv"),
    "split_pair-split_kv": (dict(split_kv=True, split_pair=True),
                            "AttentionConfig: split_pair needs direction 'kv' and excludes split_kv"),
    "key_block-256": (dict(head_dim=64, key_block=256), r"AttentionConfig.key_block must be one of \(128, 192\)"),
    "key_block-d128": (dict(key_block=192), "AttentionConfig: key_block 192 needs head_dim 64 and no key split"),
    "key_block-split": (dict(head_dim=64, key_block=192, split_kv=True),
                        "AttentionConfig: key_block 192 needs head_dim 64 and no key split"),
}


@pytest.mark.parametrize("change, message", ATTENTION_BAD_FIELDS.values(), ids=ATTENTION_BAD_FIELDS.keys())
def test_attention_config_field_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ATTENTION_VALID, **change)


def test_shipped_configs_are_valid_and_exported():
    # the package's list: the LCE configurations, then the linear layer's
    assert ikbo_gemm.SHIPPED_CONFIGS[: len(SHIPPED_CONFIGS)] == tuple(SHIPPED_CONFIGS)
    assert all(isinstance(c, ikbo_gemm.LinearConfig) for c in ikbo_gemm.SHIPPED_CONFIGS[len(SHIPPED_CONFIGS):])
    assert ikbo_gemm.LceConfig is LceConfig
    assert ikbo_fa.AttentionConfig is AttentionConfig
    for cfg in SHIPPED_CONFIGS:
        assert dataclasses.replace(cfg) == cfg  # __post_init__ accepts it
    for cfg in ikbo_fa.SHIPPED_CONFIGS:
        assert dataclasses.replace(cfg) == cfg and cfg.dtype in (torch.float16, torch.bfloat16)
    assert kernel_config(torch.float16, 64, 3, "q", False, True) == AttentionConfig(torch.float16, 64, 3, "q", False,
                                                                                    True)


def test_key_block_192_only_at_d64_without_a_key_split():
    pick = lambda d, **kw: kernel_config(torch.bfloat16, d, 4, "kv", False, True, d64_key_block=192, **kw)  # noqa: E731
    assert pick(64).key_block == 192 and pick(128).key_block == 128
    assert pick(64, split_kv=True).key_block == 128 and pick(64, split_pair=True).key_block == 128
    assert pick(64, jagged=True).key_block == 128  # rows of their own lengths keep 128-key blocks
    assert kernel_config(torch.bfloat16, 64, 4, "kv", True, True, d64_key_block=192).key_block == 128
    assert kernel_config(torch.bfloat16, 64, 4, "q", False, True, d64_key_block=192).key_block == 192
    assert kernel_config(torch.bfloat16, 64, 4, "kv", False, True).key_block == 128
    assert str(pick(64)).endswith("-n192") and "-n" not in str(pick(128)).split("-kv")[1]
    with pytest.raises(ValueError, match="AttentionPolicy.d64_key_block must be one of"):
        ikbo_fa.AttentionPolicy(d64_key_block=64)
    assert ikbo_fa.DEFAULT_POLICY.d64_key_block == 192 and ikbo_fa.DEFAULT_POLICY.d64_wide_min_keys == 2048


def test_tile_m_192_only_at_d64_kv_broadcast_without_a_split_pair():
    """192-row tiles (three consumer warpgroups) at D 64 in KV broadcast only, on 128-key blocks,
    never with a split pair; anything else is refused by name."""
    pick = lambda d, **kw: kernel_config(torch.bfloat16, d, 4, "kv", False, True, d64_tile_m=192, **kw)  # noqa: E731
    assert pick(64).tile_m == 192 and pick(64).key_block == 128 and pick(128).tile_m == 128
    assert pick(64, d64_key_block=192).key_block == 128  # 160 registers a thread: no 192-key blocks
    assert pick(64, split_kv=True).tile_m == 192 and pick(64, jagged=True, split_kv=True).tile_m == 192
    assert pick(64, split_pair=True).tile_m == 128
    assert kernel_config(torch.bfloat16, 64, 4, "q", False, True, d64_tile_m=192).tile_m == 128
    assert str(pick(64)).endswith("-m192") and "-m" not in str(pick(128))
    for bad in (dict(head_dim=128), dict(direction="q"), dict(key_block=192), dict(split_pair=True)):
        base = dict(dtype=torch.bfloat16, head_dim=64, s_q=4, direction="kv", has_kv_lengths=False,
                    return_lse=False, tile_m=192)
        with pytest.raises(ValueError, match="tile_m 192 needs head_dim 64"):
            AttentionConfig(**{**base, **bad})
    with pytest.raises(ValueError, match="AttentionConfig.tile_m must be one of"):
        AttentionConfig(torch.bfloat16, 64, 4, "kv", False, False, tile_m=256)
    with pytest.raises(ValueError, match="AttentionPolicy.d64_tile_m must be one of"):
        ikbo_fa.AttentionPolicy(d64_tile_m=64)


@pytest.mark.parametrize("s_q", [1, 2, 7, 8, 9, 31, 33, 63, 64, 65, 100, 128, 129, 300])
def test_row_packing_fits_each_candidate(s_q):
    rows, slots, chunks = row_packing(s_q)
    if s_q <= 64:  # slots of a power of two >= 8 rows, sharing a warpgroup's 64 rows
        assert rows >= max(s_q, 8) and rows & (rows - 1) == 0 and rows < 2 * max(s_q, 8)
        assert slots * rows == 64 and chunks == 1
    else:  # 64-row slots over 128-row chunks
        assert (rows, slots) == (64, 1) and (chunks - 1) * 128 < s_q <= chunks * 128


# ----------------------------------------------------------------------------- picking a configuration


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_picked_configs_are_shipped(dtype, idx_dtype):
    """Every shape runs a configuration that test_compile_sm90a_cpu.py compiles."""
    for m in (1, 64, 100, 128, 160, 200, 433, 512, 1000, 4097):
        for n in (1, 8, 64, 65, 128, 130, 256, 264, 512, 1000):
            for b in (0, 1, 2, 3, 1024):
                assert pick_config(dtype, idx_dtype, m, n, b) in SHIPPED_CONFIGS, (m, n, b)


def test_published_shape_tile_is_not_load_bound():
    """At the published shape a tile's operand loads per MAC stay under the limit
    (1/tile_n + 1/tile_w <= 1/64) and each w tile feeds a full cluster of 8 CTAs."""
    cfg = pick_config(torch.float16, torch.int32, 433, 256, 1024)
    assert 1 / cfg.tile_n + 1 / cfg.tile_w <= 1 / 64
    assert cfg.cluster_n * cfg.cluster_b == 8


# ----------------------------------------------------------------------------- LceGeometry


def _brute_force(cfg, M, N, U, B, K_user, K_cand):
    """The tiling counted over the elements: each output element (batch, row, column) lies in one
    CTA tile (batch, row // tile_w, column // tile_n) and in one cluster tile (batch //
    cluster_b, row // tile_w, column tile // cluster_n); a cluster tile holds all cluster_n x
    cluster_b of its CTA tiles, real or padding."""
    def tiles(batch):
        b, m, n = torch.meshgrid(torch.arange(batch), torch.arange(M), torch.arange(N), indexing="ij")
        w, col = m // cfg.tile_w, n // cfg.tile_n
        keys = ((b // cfg.cluster_b) * M + w) * N + col // cfg.cluster_n  # one integer per cluster tile
        keys = keys.flatten().unique()
        return torch.stack([keys // (M * N), keys // N % M, keys % N], -1)

    user_clusters, cand_clusters = tiles(U), tiles(B)
    # Every CTA tile of every user cluster tile: (user, w, column tile).
    ctas = {(int(cb) * cfg.cluster_b + r // cfg.cluster_n, int(w), int(g) * cfg.cluster_n + r % cfg.cluster_n)
            for cb, w, g in user_clusters.tolist() for r in range(cfg.cluster)}
    k_blocks = lambda k: len({i // 64 for i in range(k)})  # noqa: E731
    return dict(user_tiles=len(user_clusters), cand_tiles=len(cand_clusters), user_ctas=ctas,
                k_blocks_user=k_blocks(K_user), k_blocks_cand=k_blocks(K_cand))


# (tile_n, tile_w, cluster_n, cluster_b) x problems (M, N padded to 8, U, B, K_user, K_cand)
GEOMETRY_CONFIGS = [(64, 128, 1, 1), (64, 192, 4, 2), (64, 224, 2, 1), (128, 152, 2, 4), (128, 128, 1, 4),
                    (128, 192, 4, 2), (128, 168, 4, 1)]
GEOMETRY_PROBLEMS = [(1, 8, 1, 1, 1, 1), (433, 256, 15, 24, 1184, 872), (129, 264, 3, 7, 64, 65),
                     (200, 520, 5, 2, 127, 128), (64, 136, 2, 9, 8, 300)]


@pytest.mark.parametrize("problem", GEOMETRY_PROBLEMS, ids=lambda p: "x".join(map(str, p)))
@pytest.mark.parametrize("tiling", GEOMETRY_CONFIGS, ids=lambda t: "n{}-w{}-c{}x{}".format(*t))
def test_lce_geometry_against_a_brute_force_count(tiling, problem):
    tile_n, tile_w, cn, cb = tiling
    M, N, U, B, K_user, K_cand = problem
    cfg = LceConfig(torch.float16, torch.int32, tile_w, cn, cb, tile_n)
    geom = LceGeometry.of(cfg, M=M, N=N, U=U, B=B, K_user=K_user, K_cand=K_cand)
    count = _brute_force(cfg, M, N, U, B, K_user, K_cand)
    assert geom.user_tiles == count["user_tiles"] and geom.cand_tiles() == count["cand_tiles"]
    assert (geom.k_blocks_user, geom.k_blocks_cand) == (count["k_blocks_user"], count["k_blocks_cand"])
    # The workspace holds every CTA tile of the user cluster tiles, each at its own index.
    ctas = count["user_ctas"]
    assert geom.workspace_tiles() == len(ctas)
    assert sorted(geom.user_tile_index(u, w, n) for u, w, n in ctas) == list(range(len(ctas)))
    assert geom.column_tiles == geom.groups * cn and geom.column_tiles * tile_n >= N


@pytest.mark.parametrize("N", [256, 13])
@pytest.mark.parametrize("tiling", [(64, 192, 4, 2), (128, 152, 2, 4), (128, 128, 1, 1)],
                         ids=lambda t: "n{}-w{}-c{}x{}".format(*t))
def test_lce_plan_allocates_and_walks_the_brute_force_count(tiling, N, monkeypatch):
    """The op's plan (on the GPU path, the kernel emulated): one ready flag and one workspace
    tile per user CTA tile, and the two launches of "two_launch" walk the user cluster tiles,
    then the candidates' (N padded to 8 first)."""
    tile_n, tile_w, cn, cb = tiling
    cfg = LceConfig(torch.float16, torch.int32, tile_w, cn, cb, tile_n)
    emulated = install(monkeypatch)
    policy = lce_mod.LcePolicy(tiling=tiling)
    B, U, M, K_user, K_cand = 9, 5, 200, 70, 20
    args = random_problem(B, U, M, N, K_user, K_cand, torch.float16, order="random", seed=N)
    torch.testing.assert_close(lce_mod.lce(*args, schedule="two_launch", policy=policy), lce_mod.lce_reference(*args),
                               rtol=0, atol=0)
    count = _brute_force(cfg, M, -(-N // 8) * 8, U, B, K_user, K_cand)
    users, cands = emulated.launches
    assert users["flags"] == cands["flags"] == len(count["user_ctas"])
    assert users["tiles"] == (0, count["user_tiles"])
    assert cands["tiles"] == (count["user_tiles"], count["user_tiles"] + count["cand_tiles"])
