"""IKBO linear compression on an sm_90 GPU, against an fp32 reference (tests/lce_accuracy.py).

The cases cover every value of each axis at least once (B, ratio B/U, M, N,
K_user, K_cand, schedule, dtype, idx dtype, idx order) rather than their cross
product, with few distinct kernel configurations so that first-call compiles
stay short. The contract lce shares with attention (layouts, out=, autograd, CUDA
graphs, the disk cache) is in test_op_contract_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from ikbo_gemm.lce import lce
from lce_accuracy import assert_matches_reference
from lce_inputs import random_problem, users_for_ratio

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
F16, BF16 = torch.float16, torch.bfloat16



def make_inputs(B, ratio, M, N, K_user, K_cand, dtype, idx_dtype=torch.int32, shuffle=False, seed=0):
    """Fresh random operands on the GPU, by name; ``ratio`` candidates per user (U = ceil(B / ratio))
    in contiguous groups, shuffled with ``shuffle``."""
    return random_problem(B, users_for_ratio(B, ratio), M, N, K_user, K_cand, dtype, idx_dtype,
                          "shuffled" if shuffle else "sorted", seed, DEVICE)._asdict()


def poisoned(B, M, N, dtype):
    return torch.full((B, M, N), float("nan"), dtype=dtype, device=DEVICE)


# id -> (dtype, B, ratio, M, N, K_user, K_cand, schedule, idx dtype, shuffled, pass out=)
CASES = {
    "published-fp16-fused": (F16, 1024, 70, 433, 256, 1184, 872, "fused", torch.int32, False, True),
    "published-fp16-two_launch": (F16, 1024, 70, 433, 256, 1184, 872, "two_launch", torch.int32, False, True),
    "published-bf16-fused": (BF16, 1024, 70, 433, 256, 1184, 872, "fused", torch.int32, False, True),
    "one-candidate-k1-m1-n8": (F16, 1, 1, 1, 8, 1, 1, "fused", torch.int32, False, False),
    "b3-ratio1-n260": (BF16, 3, 1, 64, 260, 1025, 8, "two_launch", torch.int32, True, True),
    "b256-ratio2-n8": (F16, 256, 2, 433, 8, 8, 1025, "fused", torch.int32, True, True),
    "b256-ratio10-m1": (F16, 256, 10, 1, 256, 1025, 1, "two_launch", torch.int32, True, True),
    "b4096-ratio1000-int64": (BF16, 4096, 1000, 64, 256, 872, 1184, "fused", torch.int64, True, True),
    "b1024-one-user-n260": (F16, 1024, 10000, 433, 260, 1184, 872, "two_launch", torch.int32, False, True),
    # K that ends on a k-block boundary (1024) or fills most of one lone block (56), and lone
    # short blocks (24, 40).
    "k1024-k56": (BF16, 300, 3, 200, 136, 1024, 56, "fused", torch.int32, True, True),
    "k24-k40": (F16, 200, 5, 433, 64, 24, 40, "two_launch", torch.int64, True, True),
    # 128-column tiles: one batch (cluster 2 x 1), and N of one such tile (cluster 1 x 4, B not
    # a multiple of 4).
    "one-candidate-n256": (F16, 1, 1, 433, 256, 872, 1184, "fused", torch.int32, False, True),
    "b100-n128": (BF16, 100, 7, 433, 128, 200, 300, "fused", torch.int64, True, True),
    # Tile heights that 32 does not divide (a shorter last w chunk; the last epilogue sub-tile
    # overlaps the one before it): 152 rows unclustered and 168 rows; and the tallest tile,
    # 192 rows.
    "one-candidate-n100-w152": (BF16, 1, 1, 433, 100, 300, 200, "fused", torch.int32, False, True),
    "b64-m1000-w168": (F16, 64, 8, 1000, 256, 300, 200, "fused", torch.int32, True, True),
    "b10-m384-w192": (BF16, 10, 3, 384, 256, 200, 136, "two_launch", torch.int64, True, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_lce_matches_reference(case):
    dtype, B, ratio, M, N, K_user, K_cand, schedule, idx_dtype, shuffle, pass_out = case
    args = make_inputs(B, ratio, M, N, K_user, K_cand, dtype, idx_dtype, shuffle)
    out = poisoned(B, M, N, dtype) if pass_out else None
    got = lce(**args, out=out, schedule=schedule)
    if pass_out:
        assert got is out
    assert got.shape == (B, M, N) and got.dtype == dtype and got.is_contiguous()
    assert_matches_reference(got, args)


@pytest.mark.parametrize("schedule", ["fused", "two_launch"])
def test_nan_and_inf_stay_where_they_belong(schedule):
    """Non-finite values in unused users and in some candidates reach only their own outputs.

    K = 131 / 1025 and N = 200 leave tails in K, N and M (433), so a kernel that
    read past one batch's rows into the next (a 2-D view of e) would pick them up.
    """
    B, M, N, K_user, K_cand = 64, 433, 200, 131, 1025
    args = make_inputs(B, 8, M, N, K_user, K_cand, F16, shuffle=True)
    used = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9], device=DEVICE)  # users 4 and 7 unused
    args["idx"] = used[args["idx"].long()].to(torch.int32)
    e_user = torch.randn(10, K_user, N, device=DEVICE).to(F16)
    e_user[4] = float("nan")
    e_user[7] = float("inf")
    args["e_user"] = e_user
    args["e_cand"][10] = float("nan")
    args["e_cand"][11] = float("inf")

    buf = torch.full((B + 2, M, N), 7.0, dtype=F16, device=DEVICE)  # guards either side of out
    out = buf[1 : B + 1]
    out.fill_(float("nan"))
    lce(**args, out=out, schedule=schedule)
    assert (buf[0] == 7).all() and (buf[-1] == 7).all(), "wrote outside out"
    assert not torch.isfinite(out[10:12]).any()
    assert_matches_reference(out, args, rows=[b for b in range(B) if b not in (10, 11)])


@pytest.mark.parametrize(
    "dtype, idx_dtype, schedule",
    [(F16, torch.int32, "fused"), (BF16, torch.int64, "two_launch")],
)
def test_out_of_range_index(dtype, idx_dtype, schedule):
    B, M, N, K_user, K_cand = 96, 64, 256, 872, 1184
    args = make_inputs(B, 8, M, N, K_user, K_cand, dtype, idx_dtype, shuffle=True)
    U = args["e_user"].shape[0]
    huge = (1 << 31) - 1 if idx_dtype == torch.int32 else 1 << 40
    bad = {5: U, 17: -1, 40: huge, 95: U + 1}
    good_idx = args["idx"].clone()
    for b, v in bad.items():
        args["idx"][b] = v
    inputs = {k: v.clone() for k, v in args.items()}

    with pytest.raises(IndexError, match=r"idx\[5\]"):
        lce(**args, validate=True, schedule=schedule)

    buf = torch.full((B + 2, M, N), 7.0, dtype=dtype, device=DEVICE)
    out = buf[1 : B + 1]
    out.fill_(float("nan"))
    lce(**args, out=out, validate=False, schedule=schedule)
    torch.cuda.synchronize()
    assert (buf[0] == 7).all() and (buf[-1] == 7).all(), "wrote outside out"
    assert all(torch.equal(args[k], inputs[k]) for k in args), "an input changed"
    assert torch.isnan(out[list(bad)]).all()
    good = [b for b in range(B) if b not in bad]
    assert_matches_reference(out, {**args, "idx": good_idx}, rows=good)


def test_non_contiguous_inputs():
    B, M, N, K_user, K_cand = 128, 433, 256, 1025, 872
    args = make_inputs(B, 4, M, N, K_user, K_cand, F16, shuffle=True)
    views = dict(
        w_cand=args["w_cand"].t().contiguous().t(),  # column-major
        w_user=torch.stack([args["w_user"], args["w_user"]], dim=-1)[..., 0],  # stride 2 along K
        e_cand=args["e_cand"].transpose(1, 2).contiguous().transpose(1, 2),  # K fastest
        e_user=torch.stack([args["e_user"], args["e_user"]], dim=1)[:, 0],  # gaps between users
        idx=torch.stack([args["idx"], args["idx"]], dim=-1)[:, 0],  # stride 2
    )
    assert not any(v.is_contiguous() for v in views.values())
    out = poisoned(B, M, N, F16)
    lce(**views, out=out)
    assert_matches_reference(out, args)


@pytest.mark.gpu_exclusive  # about 15 GB
def test_output_and_workspace_past_2_31_elements():
    """20,000 users and candidates at M 433, N 256: the output holds 2.2e9 elements and the
    fp32 user tiles 2.3e9, so any 32-bit element offset would wrap (K is small to keep it quick)."""
    B = 20_000  # and U, at ratio 1
    M, N, K_user, K_cand = 433, 256, 40, 24
    args = make_inputs(B, 1, M, N, K_user, K_cand, F16, shuffle=True)
    out = poisoned(B, M, N, F16)
    assert out.numel() > 2**31
    lce(**args, out=out)
    assert torch.isfinite(out).all()
    g = torch.Generator(device=DEVICE).manual_seed(1)
    rows = torch.cat([torch.randperm(B, generator=g, device=DEVICE)[:192], torch.arange(B - 64, B, device=DEVICE)])
    picked = {**args, "e_cand": args["e_cand"][rows], "e_user": args["e_user"][args["idx"][rows].long()]}
    picked["idx"] = torch.arange(len(rows), device=DEVICE, dtype=torch.int32)
    assert_matches_reference(out[rows], picked)
