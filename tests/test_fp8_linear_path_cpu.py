"""The GPU path of ikbo_gemm.linear with FP8 operands on CPU tensors (its host side as on an
H200, the kernels emulated: tests/linear_emulation.py): the configurations it picks, rows 16 bytes
apart, the scales one per row (0-d ones repeated), the bias in fp32, the output dtype."""
from __future__ import annotations

import pytest
import torch

import ikbo_gemm
import linear_emulation
from fp8_inputs import linear_fp8_f64, linear_fp8_problem

FP8 = torch.float8_e4m3fn
BF16, F16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("per_tensor", [False, True], ids=["rowwise", "per_tensor"])
@pytest.mark.parametrize("dims", [dict(B=150, U=5, N=24, K_user=196, K_cand=36),  # K not a multiple of 16
                                  dict(B=600, U=3, N=40, K_user=1000, K_cand=300),  # user K slices
                                  dict(B=1, U=1, N=1, K_user=1, K_cand=1)],
                         ids=["pad", "slices", "one"])
@pytest.mark.parametrize("out_dtype", [BF16, F16])
def test_fp8_call_through_the_kernel_path(dims, per_tensor, out_dtype, monkeypatch):
    kernels = linear_emulation.install(monkeypatch)
    kw = linear_fp8_problem(**dims, per_tensor=per_tensor, bias_dtype=BF16)
    out = torch.full((dims["B"], dims["N"]), float("nan"), dtype=out_dtype)
    res = ikbo_gemm.linear(**kw, activation="gelu", out=out, out_dtype=out_dtype)
    assert res is out
    user, cand = (launch["cfg"] for launch in kernels.launches)
    assert user.dtype == cand.dtype == FP8 and user.phase == "user" and cand.phase == "cand"
    assert cand.out_dtype == out_dtype and user.out_dtype == BF16
    exact = linear_fp8_f64(**kw, activation="gelu")
    bound = (2.0**-8 if out_dtype == BF16 else 2.0**-11) * exact.abs() + 1e-5
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("slabs", [False, True], ids=["cluster-split", "slabs"])
def test_fp8_plan_counts_k_blocks_of_128(slabs, monkeypatch):
    """The user phase's K slices each hold whole 128-element k-blocks (the emulation checks it):
    the CTAs of a K-split cluster (the default), or workspace slabs (user_cluster_split off)."""
    kernels = linear_emulation.install(monkeypatch)
    kw = linear_fp8_problem(2000, 2, 64, 4096, 128)
    ikbo_gemm.linear(**kw, rules=ikbo_gemm.PlanRules(user_cluster_split=False) if slabs else None)
    user = kernels.launches[0]
    slices = user["splits"] if slabs else user["cfg"].split_k
    assert (user["splits"], user["cfg"].split_k) == ((slices, 1) if slabs else (1, slices))
    assert slices > 1 and -(-4096 // 128) >= 2 * slices


@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("B, N", [(8192, 192), (8192, 256), (4096, 960), (300, 4096), (64, 256), (8192, 4096)])
def test_fp8_candidate_tiles_leave_room_for_the_column_scales(B, N, split_k, monkeypatch):
    """Tiles that 16-bit calls of these shapes take (128 x 192, 64 x 256) would spill the FP8
    epilogue's column scales: FP8 picks among LINEAR_FP8_CAND_TILES, and ships only those."""
    from ikbo_gemm.config import LINEAR_FP8_CAND_TILES, pick_cand_tile
    kernels = linear_emulation.install(monkeypatch)
    rules = ikbo_gemm.PlanRules(split_k=split_k)
    ikbo_gemm.linear(**linear_fp8_problem(B, 3, N, 16, 32 * 1024 if split_k else 32), rules=rules)
    cand = kernels.launches[1]["cfg"]
    assert (cand.tile_m, cand.tile_n) in LINEAR_FP8_CAND_TILES
    assert cand.tile_n <= 128 and cand.tile_m * cand.tile_n <= 128 * 128
    fp8_cand = {(c.tile_m, c.tile_n) for c in ikbo_gemm.SHIPPED_CONFIGS
                if isinstance(c, ikbo_gemm.LinearConfig) and c.dtype == FP8 and c.phase == "cand"}
    assert fp8_cand == set(LINEAR_FP8_CAND_TILES)
    assert any(pick_cand_tile(b, n, 132) not in LINEAR_FP8_CAND_TILES for b, n in ((8192, 192), (8192, 256)))


def test_operands_are_read_in_place_where_their_rows_are_16_bytes_apart(monkeypatch):
    """x_cand as a view into wider rows (pitch 48, K 36) reaches the kernel as it is; an
    expanded x_user (zero row stride: TMA takes no repeated rows) is copied. Same results."""
    kernels = linear_emulation.install(monkeypatch)
    kw = linear_fp8_problem(40, 3, 24, 20, 36)
    wide = torch.zeros(40, 48, dtype=torch.uint8)
    wide[:, :36] = kw["x_cand"].view(torch.uint8)
    kw["x_cand"] = wide.view(FP8)[:, :36]
    kw["x_user"] = kw["x_user"][:1].expand(3, 20)
    kw["x_user_scale"] = kw["x_user_scale"][:1].expand(3)
    out = ikbo_gemm.linear(**kw)
    user, cand = kernels.launches
    assert cand["a"] == kw["x_cand"].data_ptr() and user["a"] != kw["x_user"].data_ptr()
    bound = 2.0**-8 * linear_fp8_f64(**kw).abs() + 1e-5
    assert ((out.double() - linear_fp8_f64(**kw)).abs() <= bound).all()


def test_fp8_shipped_configurations():
    fp8 = [c for c in ikbo_gemm.SHIPPED_CONFIGS if isinstance(c, ikbo_gemm.LinearConfig) and c.dtype == FP8]
    assert {c.phase for c in fp8} == {"user", "cand"} and {c.out_dtype for c in fp8} == {BF16, F16}
    assert all(str(c).endswith(f"-out_{str(c.out_dtype)[6:]}") for c in fp8)
    with pytest.raises(ValueError, match="out_dtype"):
        ikbo_gemm.LinearConfig(FP8, torch.int32, 128, 128, "cand")
    with pytest.raises(ValueError, match="out_dtype"):
        ikbo_gemm.LinearConfig(BF16, torch.int32, 128, 128, "cand", out_dtype=F16)


def test_fp8_library_op_passes_opcheck():
    kw = linear_fp8_problem(6, 2, 13, 9, 7, per_tensor=False)
    args = tuple(kw[n] for n in ("x_cand", "x_user", "idx", "w_cand", "w_user", "bias"))
    scales = {n: kw[n] for n in ("x_cand_scale", "x_user_scale", "w_cand_scale", "w_user_scale")}
    # Not test_schema: it multiplies the inputs, which FP8 tensors on the CPU cannot.
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.ikbo_gemm.linear.default, args, dict(activation="relu", **scales),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.ikbo_gemm.linear.default, args, dict(out_dtype=F16, **scales), test_utils=checks)


def test_fp8_call_compiles_whole_as_the_registered_op():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    kw = linear_fp8_problem(20, 3, 16, 8, 24)

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def layer(kw):
        return ikbo_gemm.linear(**kw, activation="silu", out_dtype=F16) * 2

    for B in (20, 33):
        kw = linear_fp8_problem(B, 3, 16, 8, 24, seed=B)
        assert torch.equal(layer(kw), ikbo_gemm.linear_reference(**kw, activation="silu", out_dtype=F16) * 2)
    assert counter.graphs and all("ikbo_gemm.linear" in str(g.graph) for g in counter.graphs)
    torch._dynamo.reset()


@pytest.mark.parametrize("rules", [dict(cand_split=((128, 128), 2)), dict(cand_split=((64, 128), 4)),
                                   dict(wide_user=True)], ids=["split2", "split4", "wide-user"])
def test_fp8_plan_rules(rules, monkeypatch):
    """Forced K splits count 128-element k-blocks (the emulation checks every CTA has one)."""
    kernels = linear_emulation.install(monkeypatch)
    kw = linear_fp8_problem(200, 2, 40, 1024, 1024)
    out = ikbo_gemm.linear(**kw, rules=ikbo_gemm.PlanRules(**rules))
    cand = kernels.launches[-1]["cfg"]
    assert cand.dtype == FP8 and cand.split_k == rules.get("cand_split", (None, 1))[1]
    exact = linear_fp8_f64(**kw)
    assert ((out.double() - exact).abs() <= 2.0**-8 * exact.abs() + 1e-5).all()
