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


def test_calls_on_one_index_share_a_work_list_on_the_gpu():
    """Two SDPA calls over K/V gathered by one idx (two behaviour sequences): one work list, built
    before the first; dynamic shapes; against eager."""
    from rewrite_helpers import TwoSequences

    torch._dynamo.reset()
    model = TwoSequences(mask=True)
    compiled = ikbo_rewrite.compile(model, dynamic=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for B, U in ((40, 3), (300, 7)):
            q = torch.randn(B, 1, 2, 128, generator=g).bfloat16().cuda()
            k1, v1 = (torch.randn(U, 200, 2, 128, generator=g).bfloat16().cuda() for _ in range(2))
            k2, v2 = (torch.randn(U, 1000, 2, 128, generator=g).bfloat16().cuda() for _ in range(2))
            idx = torch.randint(0, U, (B,), generator=g).cuda()
            lengths = torch.randint(1, 201, (U,), generator=g).cuda()
            args = (q, k1, v1, k2, v2, idx, lengths)
            ref = model(*args).float()
            err = float((compiled(*args).float() - ref).norm() / ref.norm())
            assert err < 2e-2, (err, str(compiled.report))
    assert str(compiled.report).count("one work list for the calls on this index") == 2, str(compiled.report)
