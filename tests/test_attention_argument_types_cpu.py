"""Arguments of the wrong kind get a TypeError naming them (as idx and kv_offsets do), on the
op's first call, on its cached plan (the GPU path with the kernels emulated) and in the
reference; work_list refuses U = 0 as the op does."""
from __future__ import annotations

import pytest
import torch

import ikbo_fa
from attention_emulation import install
from ikbo_fa.reference import attention_reference


def _problem(B=6, U=2, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 2, 2, 64, generator=g).bfloat16()
    k, v = (torch.randn(U, L, 2, 64, generator=g).bfloat16() for _ in range(2))
    idx = torch.randint(0, U, (B,), generator=g)
    lengths = torch.randint(1, L + 1, (U,), generator=g)
    return q, (k, v), idx, lengths


@pytest.fixture(params=["op", "reference", "op, gpu path"])
def attention(request, monkeypatch):
    if request.param == "op, gpu path":
        install(monkeypatch)
    return attention_reference if request.param == "reference" else ikbo_fa.attention


def test_kv_lengths_as_a_list_is_a_type_error(attention):
    q, kv, idx, lengths = _problem()
    attention(q, kv, idx, kv_lengths=lengths)  # the plan exists for tensor lengths
    with pytest.raises(TypeError, match="^kv_lengths must be a torch.Tensor"):
        attention(q, kv, idx, kv_lengths=lengths.tolist())


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_return_lse_must_be_a_bool(attention, flag):
    q, kv, idx, _ = _problem(seed=1)
    o, lse = attention(q, kv, idx, return_lse=True)  # the plan exists for True
    assert o.shape == q.shape and lse.shape == (6, 2, 2)
    with pytest.raises(TypeError, match=f"^return_lse must be a bool, got {type(flag).__name__} "):
        attention(q, kv, idx, return_lse=flag)


def test_work_list_refuses_no_users_as_the_op_does():
    q, (k, v), idx, _ = _problem(seed=2)
    with pytest.raises(ValueError, match="k/v must not be empty"):
        ikbo_fa.attention(q, (k[:0], v[:0]), idx)
    with pytest.raises(ValueError, match="^num_users must be >= 1, got 0$"):
        ikbo_fa.work_list(idx[:0], 0)
    wl = ikbo_fa.work_list(idx, 2, 2)
    assert wl.order.shape == (6,)
