"""Hand-written attention, softmax(q k^T * scale + mask) v, becomes ``ikbo_fa.attention`` in
exported graphs and under ``compile(dynamic=True)``, with the key-padding masks models write
(masked_fill, where, an additive bias); a finite fill keeps eager's result for users without
keys (the mean of their V rows); what is left names the attention and why."""
from __future__ import annotations

import pytest
import torch

import ikbo_rewrite
from rewrite_helpers import HandWritten, SdpaFiniteMask, check_close, exported, has

H, S_Q, L, D = 2, 3, 11, 64


def _inputs(B, U, seed, empty_user=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S_Q, D, generator=g).bfloat16()
    k, v = (torch.randn(U, H, L, D, generator=g).bfloat16() for _ in range(2))
    idx = torch.randint(0, U, (B,), generator=g)
    lengths = torch.randint(1, L + 1, (U,), generator=g)
    if empty_user:  # a user without keys, with candidates
        lengths[idx[0]] = 0
    return q, k, v, idx, lengths


FINITE = ["masked_fill_1e9", "where_min", "bias_1e9", "bias_min", "scaled_after_masking"]


@pytest.mark.parametrize("mask", ["none", "masked_fill_inf"] + FINITE)
def test_hand_written_attention_through_export(mask):
    model = HandWritten(mask)
    finite = mask in FINITE
    args = _inputs(9, 3, seed=len(mask), empty_user=finite)
    module, report = exported(model, args)
    assert report.kinds().count("attention") == 1 and report.left == [], str(report)
    assert not has(module, "softmax") and not has(module, "matmul")
    detail = str(report)
    assert ("kv_lengths from the key-padding mask" in detail) == (mask != "none")
    assert ("a row without keys gets the mean of its V rows" in detail) == finite, detail
    out = module(*args)
    check_close(out, model, args)
    if finite:  # the user without keys: eager's uniform weights over its padded keys
        with torch.no_grad():
            ref = model(*args)
        empty = args[4][args[3]] == 0
        assert empty.any()
        torch.testing.assert_close(out[empty].float(), ref[empty].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mask", ["masked_fill_inf", "masked_fill_1e9"])
def test_hand_written_attention_under_dynamic_compile(mask):
    torch._dynamo.reset()
    model = HandWritten(mask)
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    with torch.no_grad():
        for B, U, seed in ((9, 4, 1), (14, 5, 2)):
            args = _inputs(B, U, seed, empty_user=mask == "masked_fill_1e9")
            check_close(compiled(*args), model, args)
    report = compiled.report
    assert len(compiled.reports) == 1 and report.kinds().count("attention") == 1, str(report)
    assert report.left == [] and "D 64" in str(report), str(report)
    torch._dynamo.reset()


@pytest.mark.parametrize("mask, why", [
    ("soft", "a soft mask"),
    ("causal", "not provably a key-padding prefix mask"),
])
def test_what_is_left_names_the_hand_written_attention(mask, why):
    model = HandWritten(mask)
    args = _inputs(8, 3, seed=7)
    module, report = exported(model, args)
    assert "attention" not in report.kinds() and has(module, "softmax")
    reasons = [r for left in report.left for r in left.reasons]
    assert any("hand-written softmax(q k^T) v" in r and why in r for r in reasons), str(report)
    check_close(module(*args), model, args)


def test_sdpa_with_a_finite_mask_keeps_eager_for_users_without_keys():
    model = SdpaFiniteMask()
    args = _inputs(10, 3, seed=21, empty_user=True)
    module, report = exported(model, args)
    assert report.kinds().count("attention") == 1, str(report)
    assert "mean of its V rows" in str(report)
    out = module(*args)
    with torch.no_grad():
        ref = model(*args)
    empty = args[4][args[3]] == 0
    torch.testing.assert_close(out[empty].float(), ref[empty].float(), atol=2e-2, rtol=2e-2)
    check_close(out, model, args)
