"""Both ops' kernels inside torch.compile'd functions (inductor), against fp32 references."""
from __future__ import annotations

import math

import pytest
import torch

import ikbo_fa
import ikbo_gemm
from attention_inputs import random_problem

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_lce_in_a_compiled_model():
    pytest.importorskip("triton")
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    M, N, K_cand, K_user = 433, 260, 872, 1184
    s = 1 / math.sqrt(K_cand + K_user)
    w_cand = (torch.randn(M, K_cand, device="cuda", generator=g) * s).half()
    w_user = (torch.randn(M, K_user, device="cuda", generator=g) * s).half()

    def model(e_cand, e_user, idx, out):
        y = ikbo_gemm.lce(w_cand, w_user, e_cand, e_user, idx, out=out)
        return torch.relu(y.float()) + 1

    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for B, U in ((300, 5), (77, 2)):
        e_cand = torch.randn(B, K_cand, N, device="cuda", generator=g).half()
        e_user = torch.randn(U, K_user, N, device="cuda", generator=g).half()
        idx = torch.randint(0, U, (B,), device="cuda", generator=g)
        out = torch.full((B, M, N), float("nan"), dtype=torch.float16, device="cuda")
        res = compiled(e_cand, e_user, idx, out)
        exact = w_cand.float() @ e_cand.float() + (w_user.float() @ e_user.float())[idx]
        assert _rel(out, exact) < 2e-3 and _rel(res, torch.relu(exact) + 1) < 2e-3


def test_attention_in_a_compiled_model():
    pytest.importorskip("triton")
    torch._dynamo.reset()
    q, kv, k, v, idx, kvl = random_problem(3, "kv", 300, 5, 64, 2, 2, 128, 333, torch.bfloat16, jagged=True,
                                           device="cuda")

    def model(q, kv, idx, kvl):
        o, lse = ikbo_fa.attention(q, kv, idx, kv_lengths=kvl, return_lse=True)
        return o.float() * 2, lse

    o, lse = torch.compile(model, fullgraph=True)(q, kv, idx, kvl)
    ref_o, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_lengths=kvl,
                                                 return_lse=True)
    assert _rel(o, ref_o * 2) < 1e-2
    keep = ~torch.isneginf(ref_lse)
    assert torch.allclose(lse[keep], ref_lse[keep], atol=1e-3) and torch.equal(keep, ~torch.isneginf(lse))
