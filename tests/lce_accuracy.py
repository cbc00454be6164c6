"""The accuracy bar of lce's GPU results: every element within one rounding of an fp32
reference, and norm-wise no worse than the torch decomposition in the inputs' dtype."""
from __future__ import annotations

import torch

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # half an ulp, relative
NORM_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # sanity bound, norm-wise relative error


def fp32_reference(w_cand, w_user, e_cand, e_user, idx):
    """fp32 user GEMMs + fp32 candidate bmm + gather, not rounded."""
    user = torch.matmul(w_user.float(), e_user.float())
    return torch.matmul(w_cand.float(), e_cand.float()) + user[idx.long()]


def torch_decomposition(w_cand, w_user, e_cand, e_user, idx):
    """What a user writes in PyTorch, in the inputs' dtype."""
    return torch.matmul(w_cand, e_cand) + torch.matmul(w_user, e_user)[idx.long()]


def rel_err(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def assert_matches_reference(out, args, rows=None):
    """``out`` against the fp32 reference of ``args`` (the op's arguments by name), on ``rows``
    of the batch (all by default)."""
    dtype = args["e_cand"].dtype
    ref = fp32_reference(**args)
    mine = torch_decomposition(**args)
    if rows is not None:
        out, ref, mine = out[rows], ref[rows], mine[rows]
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    # One rounding costs u * |x|; the slack covers fp32 accumulation order.
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + 2.0**-14 * ref.abs().max()
    bad = ~((out.float() - ref).abs() <= bound)
    if bad.any():
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} outputs off; first at {first}: "
            f"got {float(out[first])}, expected {float(ref[first])}"
        )
    err, torch_err = rel_err(out, ref), rel_err(mine, ref)
    assert err <= 1.25 * torch_err + 1e-5, f"error {err:.3e} vs torch decomposition {torch_err:.3e}"
    assert err <= NORM_TOL[dtype], f"error {err:.3e}"
