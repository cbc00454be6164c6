"""Every shipped kernel configuration of the ops compiles for sm_90a without a GPU, once each:
its PTX holds the instructions the kernels are built on, ptxas spills nothing, and ptxas neither
serializes a wgmma nor inserts fences or waits the code lacks (a silent slowdown otherwise)."""
import itertools
import re

import pytest
import torch

import ikbo_fa
import ikbo_gemm
from ikbo_fa.config import AttentionConfig
from cute_kernels.mainloop import PROMOTE_GROUP
from ikbo_gemm.lce_sm90 import LceSm90

# Warp-specialized TMA -> wgmma pipelines with a register split, and programmatic dependent
# launch (each kernel waits for the grid before it on the stream).
PTX_INSTRUCTIONS = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg", "griddepcontrol.wait")

SPLIT_K_INSTRUCTIONS = ("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32", "mapa.shared::cluster",
                        "mbarrier.arrive.release.cluster.shared::cluster", "barrier.cluster.wait")

# An attention configuration the op compiles at run time for an S_q of no power of two (not shipped).
ODD_ATTENTION = AttentionConfig(torch.float16, 64, 100, "q", True, True)

CONFIGS = ([("linear" if isinstance(cfg, ikbo_gemm.LinearConfig) else "lce", ikbo_gemm.compile_config, cfg)
            for cfg in ikbo_gemm.SHIPPED_CONFIGS]
           + [("attention", ikbo_fa.compile_config, cfg) for cfg in ikbo_fa.SHIPPED_CONFIGS + (ODD_ATTENTION,)])


def test_every_shipped_configuration_is_covered():
    assert len(ikbo_gemm.SHIPPED_CONFIGS) == len(set(ikbo_gemm.SHIPPED_CONFIGS)) > 0
    assert len(ikbo_fa.SHIPPED_CONFIGS) == len(set(ikbo_fa.SHIPPED_CONFIGS)) > 0
    assert ODD_ATTENTION not in ikbo_fa.SHIPPED_CONFIGS
    assert len({str(cfg) for _, _, cfg in CONFIGS}) == len(CONFIGS)  # the test ids are unique


@pytest.mark.parametrize("op, compile_config, cfg", CONFIGS, ids=[f"{op}-{cfg}" for op, _, cfg in CONFIGS])
def test_compiles_for_sm90a(op, compile_config, cfg):
    kernel = compile_config(cfg, keep_ptx=True, ptxas_report=True)
    assert ".target sm_90a" in kernel.ptx, f"{op} {cfg}: not compiled for sm_90a"
    for instruction in PTX_INSTRUCTIONS:
        assert instruction in kernel.ptx, f"{op} {cfg}: no {instruction} in the PTX"
    if getattr(cfg, "dtype", None) == torch.float8_e4m3fn:  # 8-bit wgmma, both operands K-major
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", kernel.ptx), f"{op} {cfg}"
    if op == "lce" and cfg.dtype == torch.float8_e4m3fn:
        # The candidate epilogue's user values come through shared memory: cp.async of 16 bytes past
        # L1, a commit group and a wait per staged sub-tile.
        subtiles = LceSm90(cfg).epi_subtiles
        assert kernel.ptx.count("cp.async.cg.shared.global") == 4 * subtiles, f"{op} {cfg}"
        assert kernel.ptx.count("cp.async.wait_group") == subtiles, f"{op} {cfg}"
    if op == "linear" and cfg.phase == "cand":
        assert "cp.async.bulk.tensor.2d.global.shared" in kernel.ptx, f"{op} {cfg}: no TMA store of the output"
    if op == "linear":
        # Operand tiles a cluster shares arrive by multicast TMA: B with cluster_m 2, A as well with
        # cluster_n 2 (a 2 x 2 cluster); every other load is the CTA's own.
        multicast = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\S*\.multicast::cluster", kernel.ptx)
        assert len(multicast) == (cfg.cluster_m > 1) + (cfg.cluster_n > 1), f"{op} {cfg}: {len(multicast)} multicast loads"
    if op == "linear" and cfg.consumers_per_tile == 2:
        # A shared tile: each consumer's 64 rows in m64n{tile_n} wgmmas (one 128 x tile_n tile, no
        # ping-pong turns: no named-barrier arrive).
        k = 32 if cfg.dtype == torch.float8_e4m3fn else 16
        assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k{k}" in kernel.ptx, f"{op} {cfg}"
        assert "bar.arrive" not in kernel.ptx, f"{op} {cfg}"
    if op == "linear" and cfg.promote:
        # Promotion: each k-block's partial added in fp32 once wait_group(1) retires it, the
        # groups closed by wait_group(0) (the C75xx check below: no wgmma serialized).
        assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", kernel.ptx), f"{op} {cfg}"
        regs = cfg.tile_m * cfg.tile_n // (128 * cfg.consumers_per_tile)  # accumulator registers a thread
        assert kernel.ptx.count("add.f32") >= regs * PROMOTE_GROUP, f"{op} {cfg}"
    if op == "linear" and cfg.split_k > 1:
        # The K-split exchange: 16-byte stores into the peers' shared memory that complete on their
        # mbarrier, the buffer released remotely, the cluster barrier before exit.
        for instruction in SPLIT_K_INSTRUCTIONS:
            assert instruction in kernel.ptx, f"{op} {cfg}: no {instruction} in the PTX"
    if op == "attention":
        # KV broadcast prefetches each row's first K/V blocks into L2 before its griddepcontrol.wait
        # (from the shapes, or from kv_lengths / kv_offsets).
        prefetch = "cp.async.bulk.prefetch.tensor"
        wanted = cfg.direction == "kv"
        assert (prefetch in kernel.ptx) == wanted, f"{op} {cfg}: {prefetch} {'missing' if wanted else 'present'}"
        if wanted:
            assert kernel.ptx.index(prefetch) < kernel.ptx.index("griddepcontrol.wait"), f"{op} {cfg}"
        # Rows of their own lengths zero the V rows past a row's end in 16-byte stores (a loop of
        # one per thread and pass; the scalar stores it replaces cost microseconds a tile).
        tails = cfg.has_kv_lengths or cfg.jagged
        assert kernel.ptx.count("st.shared.v4") == int(tails), f"{op} {cfg}"
        assert "st.shared.b16" not in kernel.ptx, f"{op} {cfg}"
        # The dynamic walk's tile counter: an atomic add per tile asked for, one per CTA done.
        assert (kernel.ptx.count("atom.global.add") == 2) == cfg.dynamic_walk, f"{op} {cfg}"
        # The kernel after this one may launch once a CTA's loads are all issued.
        assert kernel.ptx.index("griddepcontrol.wait") < kernel.ptx.index("griddepcontrol.launch_dependents")
    assert kernel.spill_bytes == 0, kernel.ptxas_log
    assert kernel.wgmma_notes == [], kernel.ptxas_log


def _linear_default_plan_configs():
    """The configurations ikbo_gemm.linear's default plan picks at the bench grid's shapes (B 2048
    to 8192, ratio 70, K 1024 + 2048, 2048 + 2048 and 4096 + 4096, N 256 to 4096) on an H100 or
    H200 (132 SMs), relu and bias: 16-bit operands, and FP8 ones (bf16 out) under the default
    rules and under FP8_PROMOTE_RULES."""
    import importlib

    from ikbo_gemm.config import linear_configs

    linear_mod = importlib.import_module("ikbo_gemm.linear")
    clusters = {1: 132, 2: 66, 4: 30}.__getitem__
    configs = set()
    for B, (K_user, K_cand), N in itertools.product((2048, 4096, 8192), ((1024, 2048), (2048, 2048), (4096, 4096)),
                                                     (256, 1024, 2048, 4096)):
        U = -(-B // 70)
        g = linear_mod._grids(B, U, N, K_cand, K_user, 132, clusters, linear_mod.DEFAULT_RULES)
        for dtype in (torch.float16, torch.bfloat16):
            configs.update(linear_configs(dtype, torch.int32, g.tile_user, g.tile_cand, "relu", True, g.cluster,
                                          g.split_cand, g.split_user))
        for rules in (linear_mod.DEFAULT_RULES, linear_mod.FP8_PROMOTE_RULES):
            # FP8: the plan counts K in 64-element blocks, half of FP8's 128
            g = linear_mod._grids(B, U, N, K_cand // 2, K_user // 2, 132, clusters, rules, fp8=True)
            configs.update(linear_configs(torch.float8_e4m3fn, torch.int32, g.tile_user, g.tile_cand, "relu", True,
                                          g.cluster, g.split_cand, g.split_user, torch.bfloat16,
                                          promote=rules.fp8_promote))
    return sorted(configs, key=str)


def test_linear_default_plan_at_the_bench_grid_picks_shipped_configs():
    """Each configuration is shipped, so compiled and checked above: the user phase's K-split
    clusters (PlanRules.user_cluster_split) among them, 4-CTA splits included, FP8 ones too."""
    configs = _linear_default_plan_configs()
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        assert any(c.dtype == dtype and c.phase == "user" and c.split_k == 4 for c in configs)
    assert any(c.phase == "user" and c.promote for c in configs)
    assert [c for c in configs if c not in ikbo_gemm.SHIPPED_CONFIGS] == []
