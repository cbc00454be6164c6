"""IKBO linear compression without a GPU: the reference against the undecomposed formula in
float64, the input checks, the GPU path's host side with the kernel emulated (launch split,
fallbacks, padding), and the kernel's host-side tile arithmetic. The contract lce shares with
attention is in test_op_contract_cpu.py, the compiles in test_compile_sm90a_cpu.py."""
from __future__ import annotations

import warnings

import cutlass
import pytest
import torch

from ikbo_gemm.config import SHIPPED_CONFIGS, LceConfig, LceGeometry, pick_config
from ikbo_gemm.lce import lce
from ikbo_gemm.lce_sm90 import LceSm90
from ikbo_gemm.reference import lce_reference
from lce_emulation import h200_clusters, install, lce_mod
from lce_inputs import random_problem

# Unit roundoff (half an ulp, relative) of one rounding to the dtype.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Norm-wise relative error allowed against the exact result.
NORM_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def broadcast_formula(w_cand, w_user, e_cand, e_user, idx):
    """The undecomposed op in float64: concat(W_user, W_cand) @ concat(E_user[idx[b]], E_cand[b])."""
    w = torch.cat([w_user, w_cand], dim=1).double()  # [M, K_user + K_cand]
    e = torch.cat([e_user[idx.long()], e_cand], dim=1).double()  # [B, K_user + K_cand, N]
    return w @ e, w.abs() @ e.abs()


def rel_err(x, exact):
    return float((x.double() - exact).norm() / exact.norm())


def rounding_violations(result, exact, magnitude, K, dtype):
    """Elements farther from ``exact`` than one rounding of an fp32 sum allows.

    One rounding to the dtype costs at most u * |x|; an fp32 sum of K exact
    products (and one more add) is off by at most (K + 1) * 2^-24 * sum|terms|.
    Two roundings (round each partial sum, then the total) break this bound.
    """
    u = UNIT_ROUNDOFF[dtype]
    fp32_err = 1.01 * (K + 1) * 2.0**-24 * magnitude
    bound = u * exact.abs() + (1 + u) * fp32_err + 2.0**-25
    return int(((result.double() - exact).abs() > bound).sum())


# (B, U, M, N, K_user, K_cand, dtype, idx dtype, order)
REFERENCE_CASES = {
    "ratio1-fp16-int32": (6, 6, 8, 16, 16, 24, torch.float16, torch.int32, "sorted"),
    "ratio1-bf16-int64-shuffled": (6, 6, 8, 16, 16, 24, torch.bfloat16, torch.int64, "shuffled"),
    "one-user-fp16-int64": (64, 1, 12, 8, 24, 16, torch.float16, torch.int64, "sorted"),
    "one-user-bf16-int32": (64, 1, 12, 8, 24, 16, torch.bfloat16, torch.int32, "sorted"),
    "one-candidate": (1, 3, 8, 16, 16, 8, torch.float16, torch.int32, "random"),
    "k-n-unaligned-fp16": (10, 3, 7, 9, 13, 7, torch.float16, torch.int32, "shuffled"),
    "k-n-unaligned-bf16": (10, 3, 7, 9, 13, 7, torch.bfloat16, torch.int64, "random"),
    "m1": (9, 2, 1, 24, 40, 33, torch.bfloat16, torch.int32, "shuffled"),
    "k1": (7, 2, 5, 3, 1, 1, torch.float16, torch.int64, "random"),
    "long-k": (4, 2, 16, 32, 300, 200, torch.float16, torch.int32, "random"),
}


@pytest.mark.parametrize("case", REFERENCE_CASES.values(), ids=REFERENCE_CASES.keys())
def test_reference_matches_broadcast_formula(case):
    B, U, M, N, K_user, K_cand, dtype, idx_dtype, order = case
    args = random_problem(B, U, M, N, K_user, K_cand, dtype, idx_dtype, order)
    exact, magnitude = broadcast_formula(*args)
    got = lce_reference(*args)
    assert got.shape == (B, M, N) and got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, exact) <= NORM_TOL[dtype]
    assert rounding_violations(got, exact, magnitude, K_user + K_cand, dtype) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_check_rejects_two_roundings(dtype):
    """The single-rounding check above has teeth: rounding each partial sum first fails it."""
    args = random_problem(16, 4, 32, 32, 64, 64, dtype, order="random")
    w_cand, w_user, e_cand, e_user, idx = args
    exact, magnitude = broadcast_formula(*args)
    cand = (w_cand.float() @ e_cand.float()).to(dtype)
    user = (w_user.float() @ e_user.float()).to(dtype)
    twice = cand + user[idx.long()]
    assert rounding_violations(twice, exact, magnitude, 128, dtype) > 0


@pytest.mark.parametrize("schedule", ["fused", "two_launch"])
def test_op_on_cpu_runs_reference(schedule):
    args = random_problem(7, 3, 5, 9, 13, 7, torch.float16, order="random")
    assert torch.equal(lce(*args, schedule=schedule), lce_reference(*args))


@pytest.mark.parametrize("op", [lce_reference, lce], ids=["reference", "op"])
def test_non_contiguous_inputs(op):
    B, U, M, N, K_user, K_cand = 6, 3, 5, 12, 10, 9
    dtype = torch.float16
    w_cand, w_user, e_cand, e_user, idx = random_problem(B, U, M, N, K_user, K_cand, dtype, order="shuffled")
    views = (
        w_cand.t().contiguous().t(),  # column-major
        torch.stack([w_user, w_user.neg()], dim=-1)[..., 0],  # stride 2 along K
        e_cand.transpose(1, 2).contiguous().transpose(1, 2),  # K fastest
        torch.stack([e_user, e_user.neg()], dim=1)[:, 0],  # gaps between users
        torch.stack([idx, idx.neg()], dim=-1)[:, 0],  # stride 2
    )
    assert not any(v.is_contiguous() for v in views)
    exact, magnitude = broadcast_formula(w_cand, w_user, e_cand, e_user, idx)
    got = op(*views)
    assert got.is_contiguous() and got.shape == (B, M, N)
    assert rounding_violations(got, exact, magnitude, K_user + K_cand, dtype) == 0


# ----------------------------------------------------------------------------- bad input

B0, U0, M0, N0, KU0, KC0 = 4, 2, 3, 16, 5, 8
F16 = torch.float16


def _valid():
    w_cand, w_user, e_cand, e_user, idx = random_problem(B0, U0, M0, N0, KU0, KC0, F16, order="shuffled")
    return dict(w_cand=w_cand, w_user=w_user, e_cand=e_cand, e_user=e_user, idx=idx)


def _randn(*shape, dtype=F16):
    return torch.randn(*shape).to(dtype)


# id -> (replacements, exception, substrings the message must contain)
BAD_INPUTS = {
    "w_cand-rank": (lambda a: dict(w_cand=a["w_cand"][None]), ValueError, ["w_cand", "[1, 3, 8]", "[M, K_cand]"]),
    "w_user-rank": (lambda a: dict(w_user=a["w_user"][0]), ValueError, ["w_user", "[5]", "[M, K_user]"]),
    "e_cand-rank": (lambda a: dict(e_cand=a["e_cand"][0]), ValueError, ["e_cand", "[8, 16]", "[B, K_cand, N]"]),
    "e_user-rank": (lambda a: dict(e_user=a["e_user"][None]), ValueError, ["e_user", "[1, 2, 5, 16]"]),
    "idx-rank": (lambda a: dict(idx=a["idx"][None]), ValueError, ["idx must have 1 dimension [B], got shape [1, 4]"]),
    "w_user-M": (
        lambda a: dict(w_user=_randn(4, KU0)),
        ValueError,
        ["w_user has shape [4, 5], expected [M, K_user]: its M (dimension 0) must be M (w_cand.shape[0]) = 3, got 4"],
    ),
    "e_cand-K": (
        lambda a: dict(e_cand=_randn(B0, 9, N0)),
        ValueError,
        ["e_cand has shape [4, 9, 16], expected [B, K_cand, N]: its K_cand (dimension 1) must be "
         "K_cand (w_cand.shape[1]) = 8, got 9"],
    ),
    "e_user-K": (
        lambda a: dict(e_user=_randn(U0, 6, N0)),
        ValueError,
        ["e_user has shape [2, 6, 16], expected [U, K_user, N]: its K_user (dimension 1) must be "
         "K_user (w_user.shape[1]) = 5, got 6"],
    ),
    "e_user-N": (
        lambda a: dict(e_user=_randn(U0, KU0, 15)),
        ValueError,
        ["e_user has shape [2, 5, 15], expected [U, K_user, N]: its N (dimension 2) must be N (e_cand.shape[2]) = 16, "
         "got 15"],
    ),
    "idx-length": (lambda a: dict(idx=torch.zeros(5, dtype=torch.int32)), ValueError, ["idx", "[5]", "[4]"]),
    "w_cand-fp32": (lambda a: dict(w_cand=a["w_cand"].float()), TypeError, ["w_cand", "float32"]),
    "e_cand-fp64": (lambda a: dict(e_cand=a["e_cand"].double()), TypeError, ["e_cand", "float64"]),
    "e_user-mixed": (lambda a: dict(e_user=a["e_user"].bfloat16()), TypeError, ["e_user", "bfloat16", "float16"]),
    "w_user-mixed": (lambda a: dict(w_user=a["w_user"].bfloat16()), TypeError, ["w_user", "bfloat16"]),
    "idx-float": (lambda a: dict(idx=a["idx"].float()), TypeError, ["idx", "float32"]),
    "idx-int16": (lambda a: dict(idx=a["idx"].short()), TypeError, ["idx", "int16"]),
    "e_cand-not-tensor": (lambda a: dict(e_cand=a["e_cand"].tolist()), TypeError, ["e_cand", "list"]),
    "idx-not-tensor": (lambda a: dict(idx=[0, 1, 0, 1]), TypeError, ["idx", "list"]),
    "w_cand-device": (lambda a: dict(w_cand=a["w_cand"].to("meta")), ValueError, ["w_cand", "meta"]),
    "e_user-device": (lambda a: dict(e_user=a["e_user"].to("meta")), ValueError, ["e_user", "meta"]),
    "idx-device": (lambda a: dict(idx=a["idx"].to("meta")), ValueError, ["idx", "meta"]),
    "empty-K_cand-of-no-candidates": (  # a batch of 0 candidates is fine (an empty result), an empty K is not
        lambda a: dict(e_cand=_randn(0, 0, N0), idx=torch.zeros(0, dtype=torch.int32)),
        ValueError,
        ["e_cand must not be empty: expected [B, K_cand, N] with every size but the first >= 1, got [0, 0, 16]"],
    ),
    "empty-U": (
        lambda a: dict(e_user=_randn(0, KU0, N0)),
        ValueError,
        ["e_user must not be empty: expected [U, K_user, N] with every size >= 1, got [0, 5, 16]"],
    ),
    "empty-M": (lambda a: dict(w_cand=_randn(0, KC0), w_user=_randn(0, KU0)), ValueError, ["w_cand", "[0, 8]"]),
    "empty-K_cand": (
        lambda a: dict(w_cand=_randn(M0, 0), e_cand=_randn(B0, 0, N0)),
        ValueError,
        ["w_cand", "[3, 0]"],
    ),
    "empty-K_user": (
        lambda a: dict(w_user=_randn(M0, 0), e_user=_randn(U0, 0, N0)),
        ValueError,
        ["w_user", "[3, 0]"],
    ),
    "empty-N": (
        lambda a: dict(e_cand=_randn(B0, KC0, 0), e_user=_randn(U0, KU0, 0)),
        ValueError,
        ["e_cand", "[4, 8, 0]"],
    ),
    "empty-idx": (
        lambda a: dict(idx=torch.zeros(0, dtype=torch.int64)),
        ValueError,
        ["idx has shape [0]: expected [B] = [4]"],
    ),
    "out-shape": (
        lambda a: dict(out=torch.empty(B0, M0, 15, dtype=F16)),
        ValueError,
        ["out", "[4, 3, 15]", "[4, 3, 16]"],
    ),
    "out-rank": (lambda a: dict(out=torch.empty(B0 * M0, N0, dtype=F16)), ValueError, ["out", "[12, 16]"]),
    "out-dtype": (lambda a: dict(out=torch.empty(B0, M0, N0, dtype=torch.bfloat16)), TypeError, ["out", "bfloat16"]),
    "out-fp32": (lambda a: dict(out=torch.empty(B0, M0, N0)), TypeError, ["out", "float32"]),
    "out-non-contiguous": (
        lambda a: dict(out=torch.empty(B0, N0, M0, dtype=F16).transpose(1, 2)),
        ValueError,
        ["out", "contiguous"],
    ),
    "out-device": (lambda a: dict(out=torch.empty(B0, M0, N0, dtype=F16, device="meta")), ValueError, ["out", "meta"]),
    "out-not-tensor": (lambda a: dict(out=[[0.0]]), TypeError, ["out"]),
}


@pytest.mark.parametrize("op", [lce_reference, lce], ids=["reference", "op"])
@pytest.mark.parametrize("bad", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises(op, bad):
    replace, exc, words = bad
    args = _valid()
    args.update(replace(args))
    out = args.pop("out", None)
    with pytest.raises(exc) as info:
        op(**args, out=out)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("op", [lce_reference, lce], ids=["reference", "op"])
@pytest.mark.parametrize("schedule", ["pingpong", "", None, "FUSED"])
def test_bad_schedule_raises(op, schedule):
    with pytest.raises(ValueError, match="schedule"):
        op(**_valid(), schedule=schedule)


# ----------------------------------------------------------------------------- the GPU path's host side


def _published(cfg, B, U=15):
    """The published shape's tiling (K_user 1184, K_cand 872: 19 and 14 k-blocks)."""
    geom = LceGeometry.of(cfg, M=433, N=256, U=U, B=B, K_user=1184, K_cand=872)
    assert (geom.k_blocks_user, geom.k_blocks_cand) == (19, 14)
    return geom


@pytest.mark.parametrize("B", [2, 3, 64, 1024, 4096])
def test_spare_sm_split(B, monkeypatch):
    """Where 8-CTA clusters leave SMs idle (an H200: 15 clusters on 132 SMs), the first
    candidates go to a second launch on the 12 spare SMs, in proportion to the SMs."""
    monkeypatch.setattr(lce_mod, "max_active_clusters", h200_clusters)
    cfg = pick_config(torch.float16, torch.int32, 433, 256, B)
    assert (cfg.cluster_n, cfg.cluster_b) == (2, 4)
    U, kb_user, kb_cand = 15, 19, 14
    split = lce_mod._spare_sm_split(cfg, None, _published(cfg, B, U))
    if B < 8:
        assert split is None  # the user tiles alone outweigh the spare SMs' share
        return
    b_spare, spare = split
    b_main = B - b_spare
    assert spare == 12 and b_main % cfg.cluster_b == 0 and 0 < b_main < B
    # Work per SM within one batch's share of each other.
    main_per_sm = (U * kb_user + b_main * kb_cand) / 120
    spare_per_sm = (B - b_main) * kb_cand / 12
    assert abs(main_per_sm - spare_per_sm) <= kb_cand * cfg.cluster_b / 12


@pytest.fixture
def emulated(monkeypatch):
    return install(monkeypatch)


@pytest.mark.parametrize("schedule", ["fused", "two_launch"])
def test_gpu_path_split_covers_every_candidate_once(emulated, schedule):
    """The host side of the GPU path: at M 433, N 256 an H200's spare SMs take the first
    candidates in a second launch; every candidate is written by exactly one launch."""
    B, U = 64, 5
    args = random_problem(B, U, 433, 256, 7, 9, torch.float16, order="shuffled", seed=3)
    out = torch.full((B, 433, 256), float("nan"), dtype=torch.float16)
    assert lce(*args, out=out, schedule=schedule) is out
    torch.testing.assert_close(out, lce_reference(*args), rtol=2e-3, atol=2e-3)
    launches = emulated.launches
    if schedule == "fused":
        (main, spare) = launches
        assert main["wait_prior"] == 1 and spare["wait_prior"] == 0 and spare["cfg"].cluster_b == 1
        assert main["tiles"][0] == 0 and main["cands"] + spare["cands"] == B and 0 < spare["cands"] < B
        # Only the grid whose candidate tiles wait on its own user tiles must be resident whole.
        assert main["cooperative"] == 1 and spare["cooperative"] == 0
    else:
        (users, cands) = launches
        assert users["tiles"][1] == cands["tiles"][0] and users["cands"] == cands["cands"] == B
        assert users["cooperative"] == cands["cooperative"] == 0


def test_policy_is_part_of_the_plan(emulated):
    """LcePolicy: without the spare SMs' launch the fused schedule is one launch; a forced tiling
    and a load-bound weight pick the configuration; each policy plans apart (same result)."""
    B, U = 64, 5
    args = random_problem(B, U, 433, 256, 7, 9, torch.float16, order="shuffled", seed=4)
    expected = lce_reference(*args)
    policies = [None, lce_mod.LcePolicy(spare_sms=False), lce_mod.LcePolicy(tiling=(64, 128, 2, 1), spare_sms=False),
                lce_mod.LcePolicy(load_bound_cost=1.0, spare_sms=False)]
    for policy in policies:
        out = torch.full((B, 433, 256), float("nan"), dtype=torch.float16)
        assert lce(*args, out=out, policy=policy) is out
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    default, no_spare, forced, flat = (emulated.launches[:2], *([x] for x in emulated.launches[2:]))
    assert [launch["cfg"] for launch in no_spare] == [default[0]["cfg"]] and default[1]["cfg"].cluster_b == 1
    assert (no_spare[0]["cooperative"], no_spare[0]["cands"]) == (1, B)
    assert forced[0]["cfg"] == LceConfig(torch.float16, torch.int32, 128, 2, 1, 64)
    # Load-bound tiles weighed as any other: the least padded tile, 64 x 224 (433 rows in 2 tiles).
    assert flat[0]["cfg"] == pick_config(torch.float16, torch.int32, 433, 256, B, 1.0)
    assert (flat[0]["cfg"].tile_n, flat[0]["cfg"].tile_w) != (default[0]["cfg"].tile_n, default[0]["cfg"].tile_w)


@pytest.mark.parametrize("policy, error, match", [
    (dict(tiling=(64, 100, 1, 1)), ValueError, r"LcePolicy.tiling must be"),
    (dict(tiling=(64, 128, 1, 4)), ValueError, r"LcePolicy.tiling must be"),
    (dict(load_bound_cost=0.5), ValueError, r"LcePolicy.load_bound_cost must be a number >= 1"),
    (dict(spare_sms=1), TypeError, r"LcePolicy.spare_sms must be a bool"),
    (dict(fp8_promote=1), TypeError, r"LcePolicy.fp8_promote must be a bool"),
    (dict(fp8_promote=True, tiling=(128, 152, 2, 4)), ValueError, r"LcePolicy.fp8_promote takes tiles of"),
])
def test_policy_checks_its_fields(policy, error, match):
    with pytest.raises(error, match=match):
        lce_mod.LcePolicy(**policy)


def test_fp8_promote_policy_picks_a_promoting_tile():
    """LcePolicy.fp8_promote: FP8 calls take a tile of PROMOTE_TILES with promotion on (the
    clusters as pick_config gives them); 16-bit calls keep their configuration."""
    from ikbo_gemm.config import PROMOTE_TILES

    policy = lce_mod.LcePolicy(fp8_promote=True)
    for m, n, b in ((433, 256, 1024), (1, 1, 1), (100, 1000, 4096), (64, 16, 65536)):
        cfg = policy.config(torch.float8_e4m3fn, torch.int32, m, n, b, torch.bfloat16)
        assert cfg.promote and (cfg.tile_n, cfg.tile_w) in PROMOTE_TILES
        assert policy.config(torch.bfloat16, torch.int32, m, n, b) == pick_config(torch.bfloat16, torch.int32, m, n, b)
    forced = lce_mod.LcePolicy(fp8_promote=True, tiling=(64, 128, 4, 2))
    assert forced.config(torch.float8_e4m3fn, torch.int32, 433, 256, 1024, torch.bfloat16) == LceConfig(
        torch.float8_e4m3fn, torch.int32, 128, 4, 2, 64, torch.bfloat16, promote=True)
    with pytest.raises(ValueError, match="promote needs FP8 operands"):
        LceConfig(torch.bfloat16, torch.int32, 128, 1, 1, 64, promote=True)
    with pytest.raises(ValueError, match="at most 8192 outputs a tile"):
        LceConfig(torch.float8_e4m3fn, torch.int32, 152, 2, 4, 128, torch.bfloat16, promote=True)


def test_policy_argument_is_checked():
    args = random_problem(3, 2, 16, 8, 8, 8, torch.float16, seed=5)
    with pytest.raises(TypeError, match="policy must be LcePolicy or None, got dict"):
        lce(*args, policy={"spare_sms": False})


def test_gpu_path_refused_fused_launch_runs_two_launch(emulated, monkeypatch):
    """Where the cooperative (fused) grid cannot be resident whole (a green context, an MPS SM
    limit), the driver refuses it before anything runs: the call warns once, naming the cause
    and the schedule that needs no co-residency, and runs that schedule."""
    monkeypatch.setattr(lce_mod, "_warned_fallback", False)
    emulated.refuse_cooperative = True
    args = random_problem(64, 5, 433, 256, 7, 9, torch.float16, seed=6)
    out = torch.full((64, 433, 256), float("nan"), dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="cannot be resident whole.*CooperativeLaunchTooLarge.*schedule='two_launch'"):
        assert lce(*args, out=out) is out
    torch.testing.assert_close(out, lce_reference(*args), rtol=2e-3, atol=2e-3)
    (users, cands) = emulated.launches
    assert users["cooperative"] == cands["cooperative"] == 0 and users["cands"] == cands["cands"] == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        torch.testing.assert_close(lce(*args), lce_reference(*args), rtol=2e-3, atol=2e-3)
    assert len(emulated.launches) == 4


@pytest.mark.parametrize("context_sms", [None, 132, 64])
def test_gpu_path_capture_checks_the_contexts_sms(emulated, monkeypatch, context_sms):
    """A capture records a cooperative launch without the driver's check, so the op checks the
    current context: with fewer SMs than the device (a green context) it captures two_launch."""
    monkeypatch.setattr(lce_mod, "capturing", lambda: True)
    monkeypatch.setattr(lce_mod, "context_sm_count", lambda: context_sms)
    monkeypatch.setattr(lce_mod, "sm_count", lambda device: 132)
    monkeypatch.setattr(lce_mod, "_warned_fallback", False)
    args = random_problem(64, 5, 433, 256, 7, 9, torch.float16, seed=7)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.testing.assert_close(lce(*args, validate=False), lce_reference(*args), rtol=2e-3, atol=2e-3)
    cooperative = [launch["cooperative"] for launch in emulated.launches]
    if context_sms == 64:
        assert cooperative == [0, 0] and len(seen) == 1
        assert "64 of the device's 132 SMs" in str(seen[0].message) and "two_launch" in str(seen[0].message)
    else:  # the whole device, or a driver that cannot say: the fused grid and the spare launch
        assert cooperative == [1, 0] and not seen


def test_gpu_path_refused_fused_launch_in_a_capture_raises(emulated, monkeypatch):
    """Should a driver refuse the fused grid inside a capture, the call raises, naming the
    schedule to capture instead."""
    monkeypatch.setattr(lce_mod, "capturing", lambda: True)
    monkeypatch.setattr(lce_mod, "context_sm_count", lambda: None)
    emulated.refuse_cooperative = True
    args = random_problem(64, 5, 433, 256, 7, 9, torch.float16, seed=7)
    with pytest.raises(RuntimeError, match="refused.*schedule='two_launch'"):
        lce(*args, validate=False)
    assert emulated.launches == []
    torch.testing.assert_close(lce(*args, schedule="two_launch"), lce_reference(*args), rtol=2e-3, atol=2e-3)


def test_gpu_path_tile_index_past_32_bits_raises(emulated):
    """The kernel walks its tiles in 32 bits: a call with more tiles is refused, not wrapped."""
    B = 2**31 - 2
    meta = dict(device="meta", dtype=torch.float16)
    w, e_cand, e_user = torch.empty(1, 1, **meta), torch.empty(B, 1, 1, **meta), torch.empty(1, 1, 1, **meta)
    with pytest.raises(ValueError, match="32-bit tile index"):
        lce(w, w, e_cand, e_user, torch.empty(B, dtype=torch.int32, device="meta"))


def test_gpu_path_pads_copies_and_stores_through_an_aligned_target(emulated):
    """Odd N and K, strided and misaligned inputs, int64 idx, a misaligned out: the operands the
    kernel gets are padded, contiguous and aligned, and out holds the exact result."""
    B, U, M, N, K_user, K_cand = 9, 3, 20, 13, 11, 5
    w_cand, w_user, e_cand, e_user, idx = random_problem(B, U, M, N, K_user, K_cand, torch.bfloat16,
                                                      torch.int64, order="random", seed=4)
    e_cand_t = e_cand.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided
    flat = torch.randn(e_user.numel() + 1).to(torch.bfloat16)[1:]
    flat.copy_(e_user.flatten())
    e_user_m = flat.view(e_user.shape)  # contiguous, 2 bytes past alignment
    assert e_user_m.data_ptr() % 16
    out = torch.full((B * M * N + 1,), float("nan"), dtype=torch.bfloat16)[1:].view(B, M, N)
    assert out.data_ptr() % 16
    assert lce(w_cand, w_user, e_cand_t, e_user_m, idx, out=out) is out
    assert torch.equal(out, lce_reference(w_cand, w_user, e_cand, e_user, idx))
    fresh = lce(w_cand, w_user, e_cand_t, e_user_m, idx)
    assert fresh.shape == (B, M, N) and fresh.is_contiguous() and torch.equal(fresh, out)


def test_no_spare_sm_split_without_idle_sms(monkeypatch):
    cfg = pick_config(torch.float16, torch.int32, 433, 256, 1024)
    monkeypatch.setattr(lce_mod, "max_active_clusters", lambda device, size: 128 // size)
    assert lce_mod._spare_sm_split(cfg, None, _published(cfg, 1024)) is None  # clusters fill every SM
    monkeypatch.setattr(lce_mod, "max_active_clusters", h200_clusters)
    assert lce_mod._spare_sm_split(cfg, None, _published(cfg, 1024)) is not None
    one_deep = pick_config(torch.float16, torch.int32, 433, 256, 1)
    assert one_deep.cluster_b == 1 and lce_mod._spare_sm_split(one_deep, None, _published(one_deep, 1)) is None
    wide = pick_config(torch.float16, torch.int32, 433, 1000, 1024)  # 4-slice clusters: no pairs left
    geom = LceGeometry.of(wide, M=433, N=1000, U=15, B=1024, K_user=1184, K_cand=872)
    assert wide.cluster_n == 4 and lce_mod._spare_sm_split(wide, None, geom) is None


@pytest.mark.parametrize("tile_n, tile_w", sorted({(c.tile_n, c.tile_w) for c in SHIPPED_CONFIGS}))
def test_epilogue_frees_each_accumulator_chunk_once_after_its_last_read(tile_n, tile_w):
    """The epilogue loads the next user tile into the accumulator chunks each staged sub-tile
    frees: every chunk exactly once, and only after the last sub-tile that reads it."""
    k = LceSm90(LceConfig(torch.float16, torch.int32, tile_w, 1, 1, tile_n))
    per_sub = k.ATOM_N * k.EPI_W // 128
    reads = [set(range(k.epi_acc[s], k.epi_acc[s] + per_sub)) for s in range(k.epi_subtiles)]
    assert set().union(*reads) == set(range(tile_n * tile_w // 128))  # every value is stored
    freed = [c for chunks in k.epi_freed for c in chunks]
    assert sorted(freed) == list(range(tile_n * tile_w // 512))
    for s, chunks in enumerate(k.epi_freed):
        for c in chunks:
            values = set(range(4 * c, 4 * c + 4))
            assert values & reads[s], (s, c)
            assert not any(values & r for r in reads[s + 1:]), (s, c)


@pytest.mark.parametrize("cfg", SHIPPED_CONFIGS, ids=str)
def test_each_w_row_is_loaded_and_each_output_row_stored_exactly_once(cfg):
    """Per k-block the cluster's w chunks cover the tile's rows once (the stage's TMA byte
    count is exact), each atom's stored sub-tile rows cover tile_w once, and the ring,
    staging buffers and barriers fit in shared memory."""
    k = LceSm90(cfg)
    heights = [k.w_chunk] * (k.w_chunks - 1) + [k.w_last]
    rows = [r for j, h in enumerate(heights) for r in range(j * k.w_chunk, j * k.w_chunk + h)]
    assert rows == list(range(cfg.tile_w)) and 0 < k.w_last <= k.w_chunk
    assert k.w_chunks <= k.chunks_per_cta * k.cluster
    assert k.stage_bytes == (cfg.tile_n + cfg.tile_w) * k.TILE_K * 2
    for atom in range(cfg.tile_n // k.ATOM_N):
        subs = range(atom * k.subs_per_atom, (atom + 1) * k.subs_per_atom)
        stored = [r for s in subs for r in range(k.epi_rows[s] + k.epi_skip[s], k.epi_rows[s] + k.EPI_W)]
        assert stored == list(range(cfg.tile_w))
        assert not any(k.epi_skip[s] for s in subs[:-1])  # one store atom of another height: the last's
    # Second TMA atoms are built only where 32 does not divide the tile (w: only in clusters).
    assert k.w_last_atom == (k.cluster > 1 and cfg.tile_w % 32 != 0)
    assert k.out_last_atom == (cfg.tile_w % k.EPI_W != 0)
    fp8 = cfg.dtype == torch.float8_e4m3fn
    assert k.epi_stages == (k.EPI_STAGES_FP8 if fp8 else k.EPI_STAGES) >= 2  # the one-barrier epilogue needs two
    epi_bytes = 2 * k.epi_stages * k.ATOM_N * k.EPI_W * 2
    # FP8: each consumer's user-tile buffers (one sub-tile's fp32 values each) and row scales.
    user_bytes = 2 * k.USER_BUFFERS * k.ATOM_N * k.EPI_W * 4 + 2 * cfg.tile_w * 4 if fp8 else 0
    assert 4 * (k.user_floats + k.scale_floats) == user_bytes
    assert 1024 + k.ab_stages * k.stage_bytes + epi_bytes + user_bytes <= cutlass.memory.get_smem_capacity_in_bytes(
        "sm_90")
    assert k.ab_stages >= 4


@pytest.mark.parametrize("cfg", [c for c in SHIPPED_CONFIGS if c.dtype == torch.float8_e4m3fn] + SHIPPED_CONFIGS[:4],
                         ids=str)
def test_epilogue_waits_free_each_buffer_before_its_reuse(cfg):
    """The epilogue's async groups, played in order over three tiles of one consumer, with every
    group completing as late as its waits allow: each sub-tile's user values (FP8) have landed
    when it reads them and no pending copy targets the buffer it reads; each staging buffer's
    previous store is done reading it before a sub-tile writes it."""
    k = LceSm90(cfg)
    S = k.epi_subtiles
    # cp.async groups (FP8): (buffer, sub-tile) in issue order; a wait leaves the newest n pending.
    if cfg.dtype == torch.float8_e4m3fn:
        for _tile in range(3):
            pending = [(s % k.USER_BUFFERS, s) for s in range(min(k.USER_BUFFERS, S))]  # before the main loop
            for s in range(S):
                n = k.user_groups_pending(s)
                assert n >= 0
                pending = pending[max(0, len(pending) - n):] if n else []
                assert all(sub != s for _, sub in pending), f"sub-tile {s} reads before its group landed"
                assert all(buf != s % k.USER_BUFFERS for buf, _ in pending)
                if s + k.USER_BUFFERS < S:
                    pending.append(((s + k.USER_BUFFERS) % k.USER_BUFFERS, s + k.USER_BUFFERS))
            assert not pending  # the tile's groups were all waited for
    # Bulk stores: each consumer's staging buffers, one barrier a sub-tile (cute_kernels.staged_stores).
    assert k.staged.buffers == k.epi_stages
    k.staged.replay(3 * S)
