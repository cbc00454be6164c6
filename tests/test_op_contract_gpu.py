"""The contract the ops share, on an sm_90 GPU: the parts that need the kernels themselves
(layouts the kernels get, out= at any alignment, autograd, CUDA-graph capture, kernels loaded
from the disk cache, empty batches). Written once, run on each op (tests/op_adapters.py)."""
from __future__ import annotations

import pytest
import torch

from cute_kernels.compile import kernel_cache
from op_adapters import OP_OPTIONS, OPS, options_id, poisoned, with_odd_size1_strides

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
OP_NAMES = list(OPS)
OPTION_IDS = [f"{o}-{options_id(p)}" for o, p in OP_OPTIONS]



@pytest.fixture(params=OP_NAMES)
def op(request):
    return OPS[request.param]


def test_out_at_any_alignment(op):
    case = op.case(10, device=DEVICE)
    out = torch.full((torch.Size(case.out_shape).numel() + 1,), float("nan"), dtype=case.dtype, device=DEVICE)[1:]
    out = out.view(case.out_shape)
    assert out.data_ptr() % 16
    assert op.output(op.call(case, out=out)) is out
    op.check_gpu_result(out, case)
    assert torch.equal(out, op.output(op.call(case)))


def test_size1_dims_with_any_stride(op):
    """Size-1 dims with unit strides (inputs and out): torch still calls such tensors
    contiguous, and the launcher does not check those strides; the TMA descriptors still get
    strides they take, and the result is that of the dense layout."""
    plain = op.size1_case(12, device=DEVICE)
    expected = op.output(op.call(plain))
    odd, out = with_odd_size1_strides(op, plain)
    assert op.output(op.call(odd, out=out)) is out
    op.check_gpu_result(out, plain)
    assert torch.equal(out, expected)


def test_out_version_moves(op):
    """The kernel writes out through its pointer: a backward that saved out before the call
    raises, as after any in-place write, instead of reading the new values."""
    case = op.case(11, device=DEVICE)
    out = torch.zeros(case.out_shape, dtype=case.dtype, device=DEVICE)
    x = torch.ones_like(out, requires_grad=True)
    y = x * out  # saves out for backward
    assert op.output(op.call(case, out=out)) is out
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()
    op.check_gpu_result(out, case)


def test_inputs_that_require_grad(op):
    """The output is right and its backward raises, naming the reference: no silently missing
    gradient."""
    case = op.case(9, device=DEVICE)
    x = case.inputs[op.grad_input].requires_grad_(True)
    out = poisoned(case)
    got = op.output(op.call(case, out=out))
    assert got is out and got.requires_grad
    with pytest.raises(RuntimeError, match=f"{op.op_name} has no backward.*{op.reference_name}"):
        got.float().sum().backward()
    assert x.grad is None
    with torch.no_grad():
        op.check_gpu_result(op.output(op.call(case)), case)


@pytest.mark.parametrize("op_name, options", OP_OPTIONS, ids=OPTION_IDS)
def test_cuda_graph_capture(op_name, options):
    """Captured once, replayed on fresh inputs copied into the captured ones: each replay
    gives the new inputs' result (for lce, the ready flags are reset inside the graph)."""
    op = OPS[op_name]
    static = op.case(0, device=DEVICE)
    out = poisoned(static)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile outside the capture
        op.call(static, out=out, validate=False, **options)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.call(static, out=out, validate=False, **options)

    for seed in (1, 2):
        fresh = op.case(seed, device=DEVICE)
        for name, t in static.inputs.items():
            t.copy_(fresh.inputs[name])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        op.check_gpu_result(out, fresh)


def test_validation_inside_a_graph_capture(op, monkeypatch):
    """The range check cannot run in a capture: IKBO_VALIDATE does not apply to captured calls,
    validate=True raises a clear error, and eager calls stay validated."""
    monkeypatch.setenv("IKBO_VALIDATE", "1")
    case = op.case(4, device=DEVICE)
    out = poisoned(case)
    op.call(case, out=out)  # eager and validated; compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.call(case, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    op.check_gpu_result(out, case)
    with pytest.raises(RuntimeError, match="validate=True .* CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            op.call(case, out=out, validate=True)
    idx = case.args["idx"].clone()
    idx[7] = 10**6
    with pytest.raises(IndexError, match=r"idx\[7\] = 1000000 is out of range"):
        op.call(op.with_input(case, "idx", idx))


def test_kernels_loaded_from_the_disk_cache(op, tmp_path, monkeypatch):
    """A process that finds the kernels on disk loads them instead of compiling; the loaded
    kernels compute exactly what the compiled ones did."""
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    case = op.case(3, device=DEVICE)
    runs = []
    for _ in range(2):  # compiled, then loaded as a fresh process would
        kernel_cache.clear()
        op.module._plans.clear()
        out = poisoned(case)
        op.call(case, out=out)
        torch.cuda.synchronize()
        runs.append((out, [kernel.loaded for kernel in kernel_cache.values()]))
    (compiled, compiled_flags), (loaded, loaded_flags) = runs
    assert compiled_flags == [False] * op.kernels_per_call
    assert loaded_flags == [True] * op.kernels_per_call
    assert len(list(tmp_path.glob(f"{op.package}-*.o"))) == op.kernels_per_call
    assert torch.equal(loaded, compiled)
    op.check_gpu_result(loaded, case)


def test_empty_batch_gives_an_empty_result(op):
    case = op.case(5, device=DEVICE, B=0)
    res = op.output(op.call(case))
    assert res.shape == case.out_shape and res.dtype == case.dtype and res.is_cuda
    out = torch.empty(case.out_shape, dtype=case.dtype, device=DEVICE)
    assert op.output(op.call(case, out=out)) is out
    torch.cuda.synchronize()
