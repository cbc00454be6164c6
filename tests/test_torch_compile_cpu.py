"""The ops under torch.compile: each call is traced as one registered torch.library op.

On CPU the registered ops run the references; what is checked here is the registration
(schema, shapes from fake tensors, no graph break, out=, the raising backward), which is
the same on the GPU (tests/test_torch_compile_gpu.py runs the kernels).
"""
from __future__ import annotations

import importlib

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import ikbo_fa
import ikbo_gemm
from attention_inputs import random_problem
from ikbo_gemm.config import ACTIVATIONS
from lce_inputs import random_problem as lce_problem
from linear_inputs import random_problem as linear_problem


def lce_inputs(B, U, M=5, N=12, K_cand=7, K_user=9, idx_dtype=torch.int32, seed=0):
    return lce_problem(B, U, M, N, K_user, K_cand, torch.float16, idx_dtype, "random", seed)


def linear_inputs(B, U, N=12, K_user=9, K_cand=7, idx_dtype=torch.int32, bias=True, seed=0):
    return linear_problem(B, U, N, K_user, K_cand, torch.bfloat16, idx_dtype, seed, bias=bias)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_lce_library_op_passes_opcheck(idx_dtype):
    args = lce_inputs(6, 2, N=13, idx_dtype=idx_dtype)
    torch.library.opcheck(torch.ops.ikbo_gemm.lce.default, args)
    torch.library.opcheck(torch.ops.ikbo_gemm.lce.default, args, dict(schedule="two_launch"))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_library_op_passes_opcheck(activation):
    for bias, idx_dtype in ((True, torch.int32), (False, torch.int64)):
        args = linear_inputs(6, 2, N=13, idx_dtype=idx_dtype, bias=bias)
        torch.library.opcheck(torch.ops.ikbo_gemm.linear.default, args, dict(activation=activation))


@pytest.mark.parametrize("packed, lengths, lse", [(False, False, False), (True, True, True), (False, True, True)])
@pytest.mark.parametrize("direction", ["kv", "q"])
def test_attention_library_op_passes_opcheck(packed, lengths, lse, direction):
    q, kv, _, _, idx, kvl = random_problem(1, direction, 6, 2, 3, 2, 1, 64, 9, torch.bfloat16, packed=packed,
                                           jagged=lengths)
    kv_list = [kv] if packed else list(kv)
    torch.library.opcheck(torch.ops.ikbo_fa.attention.default, (q, kv_list, idx),
                          dict(kv_lengths=kvl, return_lse=lse))


def test_lce_compiles_whole_with_dynamic_batch_and_out():
    """fullgraph: no graph break; dynamic: one graph for every batch size; out= filled."""
    counter = CompileCounterWithBackend("aot_eager")

    def model(w_cand, w_user, e_cand, e_user, idx, out=None):
        return ikbo_gemm.lce(w_cand, w_user, e_cand, e_user, idx, out=out).float().relu()

    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for B, seed in ((6, 1), (11, 2), (3, 3)):
        args = lce_inputs(B, 2, seed=seed)
        torch.testing.assert_close(compiled(*args), ikbo_gemm.lce_reference(*args).float().relu())
        out = torch.full((B, 5, 12), float("nan"), dtype=torch.float16)
        compiled(*args, out=out)
        torch.testing.assert_close(out, ikbo_gemm.lce_reference(*args))
    assert counter.frame_count == 2  # with and without out=, each for every batch size
    assert all("ikbo_gemm.lce" in str(g.graph) for g in counter.graphs)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_compiles_whole_with_dynamic_batch_and_out(bias):
    counter = CompileCounterWithBackend("aot_eager")

    def model(x_cand, x_user, idx, w_cand, w_user, bias, out=None):
        return ikbo_gemm.linear(x_cand, x_user, idx, w_cand, w_user, bias, activation="gelu", out=out).float() * 2

    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for B, seed in ((6, 1), (11, 2), (3, 3)):
        args = linear_inputs(B, 2, bias=bias, seed=seed)
        ref = ikbo_gemm.linear_reference(*args, activation="gelu")
        torch.testing.assert_close(compiled(*args), ref.float() * 2)
        out = torch.full((B, 12), float("nan"), dtype=torch.bfloat16)
        compiled(*args, out=out)
        torch.testing.assert_close(out, ref)
    assert counter.frame_count == 2  # with and without out=, each for every batch size
    assert all("ikbo_gemm.linear" in str(g.graph) for g in counter.graphs)


@pytest.mark.parametrize("packed", [False, True])
def test_attention_compiles_whole(packed):
    counter = CompileCounterWithBackend("aot_eager")
    q, kv, _, _, idx, kvl = random_problem(2, "kv", 6, 2, 3, 2, 1, 64, 9, torch.bfloat16, packed=packed,
                                           jagged=True)

    def model(q, kv, idx, kvl, out=None):
        o, lse = ikbo_fa.attention(q, kv, idx, kv_lengths=kvl, return_lse=True, out=out)
        return o * 2, lse

    compiled = torch.compile(model, backend=counter, fullgraph=True)
    ref_o, ref_lse = ikbo_fa.attention_reference(q, kv, idx, kv_lengths=kvl, return_lse=True)
    o, lse = compiled(q, kv, idx, kvl)
    torch.testing.assert_close(o, ref_o * 2)
    torch.testing.assert_close(lse, ref_lse)
    out = torch.full_like(ref_o, float("nan"))
    compiled(q, kv, idx, kvl, out=out)
    torch.testing.assert_close(out, ref_o)
    assert counter.frame_count == 2 and all("ikbo_fa.attention" in str(g.graph) for g in counter.graphs)
    o = torch.compile(lambda q, kv, idx: ikbo_fa.attention(q, kv, idx), fullgraph=True, backend="aot_eager")(q, kv, idx)
    torch.testing.assert_close(o, ikbo_fa.attention_reference(q, kv, idx))


@pytest.mark.filterwarnings("ignore:Error detected in")
def test_compiled_backward_raises_naming_the_reference():
    args = list(lce_inputs(6, 2))
    args[0].requires_grad_(True)
    compiled = torch.compile(lambda *a: ikbo_gemm.lce(*a).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="ikbo_gemm.lce has no backward.*lce_reference"):
        compiled(*args).backward()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), ikbo_gemm.lce_reference(*args).sum())


@pytest.mark.filterwarnings("ignore:Error detected in")
def test_compiled_linear_backward_raises_naming_the_reference():
    args = linear_inputs(6, 2)
    args.x_user.requires_grad_(True)
    compiled = torch.compile(lambda *a: ikbo_gemm.linear(*a, activation="relu").sum(), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="ikbo_gemm.linear has no backward.*linear_reference"):
        compiled(*args).backward()
    assert args.x_user.grad is None
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), ikbo_gemm.linear_reference(*args, activation="relu").sum())


def test_compiled_bad_shapes_name_the_argument():
    args = list(lce_inputs(6, 2))
    args[2] = args[2][:, :5]  # K_cand 5, w_cand has 7
    compiled = torch.compile(ikbo_gemm.lce, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"e_cand has shape \[6, 5, 12\]"):
        compiled(*args)


def test_compiled_calls_take_only_the_shipped_launch_policy():
    """A launch policy is a plan choice of eager calls: torch.compile traces the registered op,
    which takes the shipped one; the default object passes, another policy raises naming it."""
    lce_args = lce_problem(4, 2, 16, 8, 8, 8, torch.float16, seed=7)
    lce_mod, linear_mod = (importlib.import_module(f"ikbo_gemm.{m}") for m in ("lce", "linear"))
    shipped = torch.compile(lambda *a: ikbo_gemm.lce(*a, policy=lce_mod.DEFAULT_POLICY), backend="eager",
                            fullgraph=True)
    torch.testing.assert_close(shipped(*lce_args), ikbo_gemm.lce_reference(*lce_args))
    other = torch.compile(lambda *a: ikbo_gemm.lce(*a, policy=lce_mod.LcePolicy(spare_sms=False)), backend="eager",
                          fullgraph=True)
    with pytest.raises(Exception, match="lce: a policy other than DEFAULT_POLICY is for eager calls"):
        other(*lce_args)
    linear_args = linear_problem(4, 2, 8, 8, 16, torch.float16, seed=7)
    compiled = torch.compile(lambda *a: ikbo_gemm.linear(*a, rules=linear_mod.SMALL_GRID_RULES), backend="eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="linear: rules other than DEFAULT_RULES are for eager calls"):
        compiled(*linear_args)
