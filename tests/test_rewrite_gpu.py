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
