"""The pass on the GPU: Inductor's CUDA graphs spell SDPA with the flash, efficient or cuDNN
kernels (the efficient one pads the mask to an aligned width), and the rewritten models run
the IKBO kernels. Each reference model through ikbo_rewrite.compile, against eager."""
from __future__ import annotations

import pytest
import torch

import ikbo_rewrite
from examples import combined, din, multi_seed, wukong
from ikbo_rewrite import linear

pytestmark = pytest.mark.gpu

MODELS = {
    "wukong": (wukong, wukong.WukongBlock, {"lce"}),
    "din": (din, din.DinBlock, {"attention", "hoist", "linear"}),
    "multi_seed": (multi_seed, multi_seed.MultiSeedBlock, {"attention", "hoist"}),
    "combined": (combined, combined.CombinedRanker, {"lce", "attention", "hoist", "linear"}),
}


@pytest.mark.parametrize("name", MODELS)
def test_compile_rewrites_each_model_on_the_gpu(name):
    torch._dynamo.reset()
    mod, cls, kinds = MODELS[name]
    if not linear.available():
        kinds = kinds - {"linear"}
    torch.manual_seed(0)
    model = cls(mod.TINY).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        compiled = ikbo_rewrite.compile(model, dynamic=True)
        for B, U, seed in ((40, 3, 1), (70, 5, 2)):
            args = mod.make_inputs(mod.TINY, B, U, dtype=torch.bfloat16, device="cuda",
                                   generator=torch.Generator().manual_seed(seed))
            ref = model(*args).float()
            out = compiled(*args).float()
            err = float((out - ref).norm() / ref.norm())
            assert err < 2e-2, (err, str(compiled.report))
    assert len(compiled.reports) == 1
    assert set(compiled.report.kinds()) == kinds, str(compiled.report)


@pytest.mark.parametrize("D, S_q, sizes", [(128, 1, ((40, 3), (300, 7))), (64, 4, ((2048, 32), (300, 7)))])
def test_calls_on_one_index_share_a_work_list_on_the_gpu(D, S_q, sizes):
    """Two SDPA calls over K/V gathered by one idx (two behaviour sequences): one work list, built
    before the first; dynamic shapes; against eager. At D 64, S_q 4 and 2048 candidates of 32
    users the list counts the 192-row tiles the calls choose."""
    from rewrite_helpers import TwoSequences

    torch._dynamo.reset()
    model = TwoSequences(mask=True)
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for B, U in sizes:
            q = torch.randn(B, S_q, 2, D, generator=g).bfloat16().cuda()
            k1, v1 = (torch.randn(U, 200, 2, D, generator=g).bfloat16().cuda() for _ in range(2))
            k2, v2 = (torch.randn(U, 1000, 2, D, generator=g).bfloat16().cuda() for _ in range(2))
            idx = torch.randint(0, U, (B,), generator=g).cuda()
            lengths = torch.randint(1, 201, (U,), generator=g).cuda()
            args = (q, k1, v1, k2, v2, idx, lengths)
            ref = model(*args).float()
            err = float((compiled(*args).float() - ref).norm() / ref.norm())
            assert err < 2e-2, (err, str(compiled.report))
    assert str(compiled.report).count("one work list for the calls on this index") == 2, str(compiled.report)


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


def _attention_inputs(B, U, L, g, D=64, S_q=2, empty_user=False):
    q = torch.randn(B, 2, S_q, D, generator=g).bfloat16()
    k, v = (torch.randn(U, 2, L, D, generator=g).bfloat16() for _ in range(2))
    idx = torch.randint(0, U, (B,), generator=g)
    lengths = torch.randint(1, L + 1, (U,), generator=g)
    if empty_user:
        lengths[idx[0]] = 0
    return _cuda(q, k, v, idx, lengths)


@pytest.mark.parametrize("mask", ["none", "masked_fill_inf", "masked_fill_1e9"])
def test_hand_written_attention_under_dynamic_compile_on_the_gpu(mask):
    """softmax(q k^T / sqrt(d) + mask) v written out, in the graphs Inductor makes on the GPU
    with dynamic shapes: one rewrite to attention serving two batch sizes, against eager (with a
    user without keys under the finite fill: eager's mean of its V rows)."""
    from rewrite_helpers import HandWritten

    torch._dynamo.reset()
    model = HandWritten(mask)
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for B, U in ((40, 3), (300, 7)):
            args = _attention_inputs(B, U, 48, g, empty_user=mask == "masked_fill_1e9")
            ref = model(*args).float()
            out = compiled(*args).float()
            err = float((out - ref).norm() / ref.norm())
            assert err < 2e-2, (err, str(compiled.report))
            if mask == "masked_fill_1e9":
                empty = args[4][args[3]] == 0
                torch.testing.assert_close(out[empty], ref[empty], atol=2e-2, rtol=2e-2)
    assert len(compiled.reports) == 1 and compiled.report.kinds().count("attention") == 1, str(compiled.report)


def test_sdpa_with_a_finite_mask_keeps_eager_for_users_without_keys_on_the_gpu():
    from rewrite_helpers import SdpaFiniteMask

    torch._dynamo.reset()
    model = SdpaFiniteMask()
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for B, U in ((40, 3), (300, 7)):
            args = _attention_inputs(B, U, 200, g, D=128, S_q=1, empty_user=True)
            ref, out = model(*args).float(), compiled(*args).float()
            assert float((out - ref).norm() / ref.norm()) < 2e-2, str(compiled.report)
            empty = args[4][args[3]] == 0
            torch.testing.assert_close(out[empty], ref[empty], atol=2e-2, rtol=2e-2)
    assert "mean of its V rows" in str(compiled.report), str(compiled.report)


@pytest.mark.parametrize("name", ["dcn_v2", "bst", "mmoe"])
def test_unseen_models_under_dynamic_compile_on_the_gpu(name):
    from models_unseen import MODELS, make_inputs
    from test_rewrite_unseen_models_cpu import _check_report

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[name]().to("cuda", torch.bfloat16).eval()
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    with torch.no_grad():
        for B, U in ((64, 3), (300, 7)):
            args = _cuda(*make_inputs(name, B, U, seed=B))
            ref = model(*args).float()
            err = float((compiled(*args).float() - ref).norm() / ref.norm())
            assert err < 2e-2, (err, str(compiled.report))
    assert len(compiled.reports) == 1
    _check_report(name, compiled.report)


def test_validate_raises_for_an_index_out_of_range_on_the_gpu(monkeypatch):
    from rewrite_helpers import TwoSequences

    monkeypatch.setenv("IKBO_VALIDATE", "0")
    torch._dynamo.reset()
    model = TwoSequences()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(40, 1, 2, 128, generator=g).bfloat16()
    kv = [torch.randn(3, 64, 2, 128, generator=g).bfloat16() for _ in range(4)]
    idx = torch.randint(0, 3, (40,), generator=g)
    args = _cuda(q, *kv, idx, torch.randint(1, 65, (3,), generator=g))
    bad = list(args)
    bad[5] = args[5].clone()
    bad[5][4] = 3
    with torch.no_grad():
        out = ikbo_rewrite.compile(model, dynamic=True)(*bad)
        assert out[4].isnan().all() and not out[torch.arange(40, device="cuda") != 4].isnan().any()
        torch._dynamo.reset()
        checked = ikbo_rewrite.compile(model, dynamic=True, validate=True)
        ref = model(*args).float()
        assert float((checked(*args).float() - ref).norm() / ref.norm()) < 2e-2
        with pytest.raises(IndexError, match=r"idx\[4\] = 3 is out of range"):
            checked(*bad)
