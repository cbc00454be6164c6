"""The GPU path of ikbo_gemm.lce with FP8 operands on CPU tensors (its host side as on an H200,
the kernel emulated: tests/lce_emulation.py): the FP8 configurations it picks, e K-major with
rows 16 bytes apart, one fp32 scale per row of w and batch entry of e (0-d ones repeated, e_cand's
sliced per launch), the output dtype, both schedules and the spare-SM split."""
from __future__ import annotations

import pytest
import torch

import ikbo_gemm
import lce_emulation
from fp8_inputs import assert_one_rounding, lce_fp8_f64, lce_fp8_problem
from ikbo_gemm.config import LceConfig

FP8 = torch.float8_e4m3fn
BF16, F16 = torch.bfloat16, torch.float16

DIMS = {  # B, U, M, N, K_user, K_cand
    "pad": (150, 5, 40, 24, 196, 36),  # K not a multiple of 16, N not one of 8
    "ratio 70": (210, 3, 100, 72, 40, 24),
    "one": (1, 1, 1, 1, 1, 1),
}


@pytest.mark.parametrize("schedule", ["fused", "two_launch"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["rowwise", "per_tensor"])
@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
@pytest.mark.parametrize("out_dtype", [BF16, F16])
def test_fp8_call_through_the_kernel_path(dims, per_tensor, out_dtype, schedule, monkeypatch):
    kernels = lce_emulation.install(monkeypatch)
    monkeypatch.setattr(lce_emulation.lce_mod, "lce_reference", None)  # the kernel path, no fallback
    B, U, M, N, _, _ = dims
    kw = lce_fp8_problem(*dims, seed=sum(dims), per_tensor=per_tensor)
    out = torch.full((B, M, N), float("nan"), dtype=out_dtype)  # poisoned
    assert ikbo_gemm.lce(**kw, out=out, out_dtype=out_dtype, schedule=schedule) is out
    assert kernels.launches and all(launch["cfg"].dtype == FP8 and launch["cfg"].out_dtype == out_dtype
                                    for launch in kernels.launches)
    assert_one_rounding(out, lce_fp8_f64(**kw), out_dtype)


@pytest.mark.parametrize("e_layout", ["pitched", "contiguous"])
def test_fp8_e_with_k_not_a_multiple_of_16(e_layout, monkeypatch):
    """quantize_fp8's e (rows 16 bytes apart) reaches the kernel as it is; a contiguous e of such
    a K is copied into padded rows. Both give the same result."""
    kernels = lce_emulation.install(monkeypatch)
    dims = (40, 3, 24, 16, 24, 36)  # K 24 and 36
    kw = lce_fp8_problem(*dims, seed=7)
    assert kw["e_cand"].stride(1) == 48 and not kw["e_cand"].is_contiguous()
    if e_layout == "contiguous":
        kw["e_cand"], kw["e_user"] = kw["e_cand"].contiguous(), kw["e_user"].contiguous()
    out = torch.full((40, 24, 16), float("nan"), dtype=BF16)
    ikbo_gemm.lce(**kw, out=out)
    copied = {launch["e_cand"] != kw["e_cand"].data_ptr() for launch in kernels.launches}
    assert copied == {e_layout == "contiguous"}
    assert_one_rounding(out, lce_fp8_f64(**kw), BF16)


def test_fp8_spare_sm_split_slices_e_cand_scale(monkeypatch):
    """The published shape (K cut short): its 8-CTA clusters leave SMs to a second launch of the first candidates:
    each launch gets its own candidates' scales (the emulation checks their count)."""
    kernels = lce_emulation.install(monkeypatch)
    kw = lce_fp8_problem(1024, 15, 433, 256, 40, 24, seed=5)
    out = ikbo_gemm.lce(**kw)
    assert len(kernels.launches) == 2 and kernels.launches[1]["cands"] < 1024
    assert_one_rounding(out, lce_fp8_f64(**kw), BF16)


def test_fp8_out_of_range_is_nan_and_isolated(monkeypatch):
    lce_emulation.install(monkeypatch)
    kw = lce_fp8_problem(40, 3, 20, 16, 32, 48, seed=2)
    kw["idx"][[3, 17]] = torch.tensor([3, -1], dtype=torch.int32)
    out = ikbo_gemm.lce(**kw, validate=False)
    bad = torch.zeros(40, dtype=torch.bool)
    bad[[3, 17]] = True
    assert out[bad].isnan().all() and not out[~bad].isnan().any()


def test_fp8_k_blocks_hold_128_elements():
    cfg = LceConfig(FP8, torch.int32, 152, 2, 4, 128, out_dtype=BF16)
    geom = ikbo_gemm.config.LceGeometry.of(cfg, M=433, N=256, U=15, B=1024, K_user=1184, K_cand=872)
    assert cfg.tile_k == 128 and (geom.k_blocks_user, geom.k_blocks_cand) == (10, 7)
    assert LceConfig(BF16, torch.int32, 152, 2, 4, 128).tile_k == 64


def test_fp8_shipped_configurations():
    fp8 = [c for c in ikbo_gemm.SHIPPED_CONFIGS if isinstance(c, LceConfig) and c.dtype == FP8]
    published = ikbo_gemm.config.pick_config(FP8, torch.int32, 433, 256, 1024, out_dtype=BF16)
    assert published in fp8 and {c.out_dtype for c in fp8} == {BF16, F16} and {c.tile_n for c in fp8} == {64, 128}
    assert all(str(c).endswith(f"-out_{str(c.out_dtype)[6:]}") for c in fp8)
    with pytest.raises(ValueError, match="out_dtype"):
        LceConfig(FP8, torch.int32, 152, 2, 4, 128)
    with pytest.raises(ValueError, match="out_dtype"):
        LceConfig(BF16, torch.int32, 152, 2, 4, 128, out_dtype=F16)


def test_fp8_library_op_passes_opcheck():
    kw = lce_fp8_problem(6, 2, 5, 9, 7, 13, seed=3)
    args = tuple(kw[n] for n in ("w_cand", "w_user", "e_cand", "e_user", "idx"))
    scales = {n: kw[n] for n in ("w_cand_scale", "w_user_scale", "e_cand_scale", "e_user_scale")}
    # Not test_schema: it multiplies the inputs, which FP8 tensors on the CPU cannot.
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.ikbo_gemm.lce.default, args, dict(out_dtype=F16, **scales), test_utils=checks)


def test_fp8_call_compiles_whole_as_the_registered_op():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def layer(kw):
        return ikbo_gemm.lce(**kw, out_dtype=F16) * 2

    for B in (20, 33):
        kw = lce_fp8_problem(B, 3, 16, 8, 24, 40, seed=B)
        assert torch.equal(layer(kw), ikbo_gemm.lce_reference(**kw, out_dtype=F16) * 2)
    assert counter.frame_count == 1
