"""The contract the ops share (docs/ops.md, "Common to every op"), written once and run on
each op without a GPU.

Paths: "cpu" is the op on CPU tensors (it runs the reference), "kernel" the op's GPU path with
its kernels emulated on CPU tensors (tests/lce_emulation.py, tests/linear_emulation.py,
tests/attention_emulation.py: the host side runs as on an H200), "reference" the op's
``*_reference`` function. GPU-only parts (CUDA graphs, loaded kernels) are in
test_op_contract_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from cute_kernels.compile import KernelCache
from cute_kernels.plans import PlanCache
from op_adapters import OP_OPTIONS, OPS, options_id, poisoned, with_odd_size1_strides
from tiny_kernel import compile_tiny

OP_NAMES = list(OPS)


@pytest.fixture(params=OP_NAMES)
def op(request):
    return OPS[request.param]


def _path(op, path, monkeypatch):
    """The emulation for the "kernel" path, else None."""
    return op.emulate(monkeypatch) if path == "kernel" else None


def _call(op, path, case, **kw):
    return op.expected(case, **kw) if path == "reference" else op.call(case, **kw)


def _assert_close(op, got, expected):
    torch.testing.assert_close(got, expected, equal_nan=True, **op.tolerance)


# ----------------------------------------------------------------------------- layouts


def test_size1_dims_with_any_stride(op, monkeypatch):
    """torch calls a tensor contiguous whatever the strides of its size-1 dims (movedim and
    empty_like make odd ones): the kernel still gets strides a TMA descriptor takes (the
    emulation checks them), and stores into out itself."""
    emulation = op.emulate(monkeypatch)
    plain = op.size1_case(1)
    odd, out = with_odd_size1_strides(op, plain)
    assert op.output(op.call(odd, out=out)) is out
    assert op.stored_to(emulation) == out.data_ptr()  # a view of out, no copy
    _assert_close(op, out, op.expected(plain))


@pytest.mark.parametrize("path", ["cpu", "kernel"])
def test_out_at_any_alignment(op, path, monkeypatch):
    emulation = _path(op, path, monkeypatch)
    case = op.case(2)
    out = torch.full((torch.Size(case.out_shape).numel() + 1,), float("nan"), dtype=case.dtype)[1:]
    out = out.view(case.out_shape)
    assert out.data_ptr() % 16
    assert op.output(op.call(case, out=out)) is out
    _assert_close(op, out, op.expected(case))
    if emulation is not None:
        assert op.stored_to(emulation) % 16 == 0  # the kernel stores to an aligned tensor, copied into out


def _sharing_memory(t: torch.Tensor, out_shape, out_dtype, offset: int):
    """(a copy of ``t``, an ``out`` of ``out_shape`` starting ``offset`` bytes after it) in one buffer."""
    out_bytes = torch.Size(out_shape).numel() * out_dtype.itemsize
    buf = torch.empty(offset + out_bytes + t.nbytes + 16, dtype=torch.uint8)
    copy = buf[: t.nbytes].view(t.dtype).view(t.shape).copy_(t)
    out = buf[offset: offset + out_bytes].view(out_dtype).view(out_shape)
    return copy, out


@pytest.mark.parametrize("path", ["cpu", "kernel"])
@pytest.mark.parametrize("op_name, name", [(o, n) for o in OP_NAMES for n in OPS[o].case(0).inputs])
def test_out_sharing_memory_with_an_input_raises(op_name, name, path, monkeypatch):
    """The kernels read the inputs while they write out: an out that overlaps any input is
    refused, naming it; one right after it in the same buffer is fine."""
    op = OPS[op_name]
    _path(op, path, monkeypatch)
    case = op.case(3)
    t = case.inputs[name]
    inside, out = _sharing_memory(t, case.out_shape, case.dtype, 0)
    with pytest.raises(ValueError, match=f"out overlaps {name} in memory"):
        op.call(op.with_input(case, name, inside), out=out)
    beside, out = _sharing_memory(t, case.out_shape, case.dtype, -(-t.nbytes // 16) * 16)
    assert op.output(op.call(op.with_input(case, name, beside), out=out)) is out
    _assert_close(op, out, op.expected(case))


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
def test_dense_tensors_only_even_after_a_cached_plan(op, path, monkeypatch):
    _path(op, path, monkeypatch)
    case = op.case(4)
    _call(op, path, case)  # the plan for this signature is cached
    for name, t in case.inputs.items():
        if t.dtype.is_floating_point:
            with pytest.raises(TypeError, match=f"{name} must be a dense"):
                _call(op, path, op.with_input(case, name, t.to_sparse()))


def test_plans_stay_bounded_when_the_batch_keeps_changing(op, monkeypatch):
    """The op keeps its plans in a bounded cache: once it is full (here: filled to its limit
    with other signatures), a new signature starts it over."""
    emulation = op.emulate(monkeypatch)
    plans = op.module._plans
    assert isinstance(plans, PlanCache)
    plans.update({("another signature", i): None for i in range(plans.limit - len(plans))})
    for B in range(1, 4):
        case = op.case(B, B=B, U=min(B, 3))
        _assert_close(op, op.call(case), op.expected(case))
        assert len(plans) <= 4 * B and ("another signature", 0) not in plans
    assert op.launches(emulation) >= 3


# ----------------------------------------------------------------------------- out written in place


@pytest.mark.parametrize("path", ["cpu", "kernel"])
@pytest.mark.parametrize("op_name, options", OP_OPTIONS, ids=[f"{o}-{options_id(p)}" for o, p in OP_OPTIONS])
def test_out_version_moves(op_name, options, path, monkeypatch):
    """The kernels write out through its pointer: out's version counter still moves, so a
    backward that saved out before the call raises instead of reading the new values."""
    op = OPS[op_name]
    emulation = _path(op, path, monkeypatch)
    case = op.case(5)
    out = torch.zeros(case.out_shape, dtype=case.dtype)
    x = torch.ones_like(out, requires_grad=True)
    y = x * out  # saves out for backward
    version = out._version
    assert op.output(op.call(case, out=out, **options)) is out
    assert out._version > version
    if emulation is not None:
        assert op.launches(emulation) > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()
    _assert_close(op, out, op.output(op.expected(case, **options)))


@pytest.mark.parametrize("path", ["cpu", "kernel"])
def test_out_written_in_place_only_where_torch_allows(op, path, monkeypatch):
    _path(op, path, monkeypatch)
    case = op.case(6)
    with pytest.raises(RuntimeError, match="out is a leaf tensor that requires grad"):
        op.call(case, out=torch.zeros(case.out_shape, dtype=case.dtype, requires_grad=True))
    with torch.no_grad():  # no autograd to fool: written
        leaf = torch.zeros(case.out_shape, dtype=case.dtype, requires_grad=True)
        assert op.output(op.call(case, out=leaf)) is leaf
    with torch.inference_mode():
        inference_out = torch.full(case.out_shape, float("nan"), dtype=case.dtype)
        assert op.output(op.call(case, out=inference_out)) is inference_out  # fine under inference mode
    _assert_close(op, inference_out, op.expected(case))
    with pytest.raises(RuntimeError, match="out is an inference tensor"):
        op.call(case, out=inference_out)


# ----------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
def test_inputs_that_require_grad(op, path, monkeypatch):
    """On the GPU path the result is right and its backward raises, naming the reference: no
    silently missing gradient. CPU tensors run the reference, which differentiates."""
    _path(op, path, monkeypatch)
    case = op.case(7)
    expected = op.expected(case)
    x = case.inputs[op.grad_input].requires_grad_(True)
    res = op.output(_call(op, path, case))
    assert res.requires_grad
    _assert_close(op, res.detach(), expected)
    if path == "kernel":
        with pytest.raises(RuntimeError, match=f"{op.op_name} has no backward.*{op.reference_name}"):
            res.float().nan_to_num().sum().backward()
        assert x.grad is None
    else:
        res.float().nan_to_num().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("op_name, options", OP_OPTIONS, ids=[f"{o}-{options_id(p)}" for o, p in OP_OPTIONS])
def test_out_view_with_grad_keeps_the_gradient_honest(op_name, options, monkeypatch):
    """out= a view of a buffer while an input requires grad: a loss read through the buffer
    raises (naming the op) instead of silently missing the op's term."""
    op = OPS[op_name]
    op.emulate(monkeypatch)
    case = op.case(8)
    expected = op.output(op.expected(case, **options))
    buf = torch.full((2, *case.out_shape), float("nan"), dtype=case.dtype)
    x = case.inputs[op.grad_input].requires_grad_(True)
    res = op.output(op.call(case, out=buf[1], **options))
    assert res.data_ptr() == buf[1].data_ptr()
    _assert_close(op, buf[1].detach(), expected)
    assert buf.requires_grad
    with pytest.raises(RuntimeError, match=f"{op.op_name} has no backward"):
        buf.float().nan_to_num().sum().backward()
    assert x.grad is None


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize("op_name, options", OP_OPTIONS, ids=[f"{o}-{options_id(p)}" for o, p in OP_OPTIONS])
def test_launches_with_the_operands_device_current(op_name, options, monkeypatch, devices_made_current):
    """A kernel launches in the current device's context: operands on another GPU have their
    device made current around every launch."""
    op = OPS[op_name]
    emulation = op.emulate(monkeypatch)
    current = devices_made_current(op.module)
    seen = []
    emulation.hooks.append(lambda kernel: seen.append((kernel, list(current))))
    case = op.case(9)
    _assert_close(op, op.output(op.call(case, **options)), op.output(op.expected(case, **options)))
    assert seen and all(devices == [case.device] for _, devices in seen), seen
    assert len(seen) == op.launches(emulation) and not current


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
def test_an_input_on_another_device_raises_naming_it(op, path, monkeypatch):
    """Checked before anything runs (a meta tensor stands in for another device)."""
    _path(op, path, monkeypatch)
    case = op.case(17)
    for name, t in case.inputs.items():
        with pytest.raises(ValueError, match=rf"\b{name} is on meta\b.*: all tensors must share one device"):
            _call(op, path, op.with_input(case, name, t.to("meta")))


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
def test_bad_out_raises_and_is_left_unwritten(op, path, monkeypatch):
    _path(op, path, monkeypatch)
    case = op.case(18)
    *lead, last = case.out_shape
    shape = ", ".join(map(str, case.out_shape))
    dtype = str(case.dtype).removeprefix("torch.")
    nan = float("nan")
    bad = [
        (torch.full((*lead, last + 1), nan, dtype=case.dtype), ValueError, rf"out has shape .*expected \[{shape}\]"),
        (torch.full(case.out_shape, nan), TypeError, f"out must be {dtype}, got float32"),
        (torch.full((*lead, 2 * last), nan, dtype=case.dtype)[..., ::2], ValueError, "out must be contiguous"),
    ]
    for out, error, match in bad:
        with pytest.raises(error, match=match):
            _call(op, path, case, out=out)
        assert torch.isnan(out).all()
    with pytest.raises(ValueError, match=f"out is on meta, expected {case.device}"):
        _call(op, path, case, out=torch.empty(case.out_shape, dtype=case.dtype, device="meta"))


# ----------------------------------------------------------------------------- the disk cache


def test_kernels_kept_on_disk_per_configuration(op, tmp_path, monkeypatch):
    """The op keeps its kernels in the disk cache, keyed by configuration: a fresh process
    loads them instead of compiling, and another configuration is another file. (The
    configurations' compile is replaced by a small kernel's.)"""
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(op.module, op.compile_name, lambda cfg: builds.append(cfg) or compile_tiny())
    first, second = op.configs()
    for process in range(2):
        cache = KernelCache()  # a fresh process's
        monkeypatch.setattr(op.module, "kernel_cache", cache)
        op.kernel_for(first)
        op.kernel_for(first)
        assert [k.loaded for k in cache.values()] == [process == 1]
        assert builds == [first]
    assert len(list(tmp_path.glob(f"{op.package}-*.o"))) == 1
    op.kernel_for(second)
    assert builds == [first, second] and len(list(tmp_path.glob(f"{op.package}-*.o"))) == 2


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_out_of_range_index_raises_with_validation(op, path, idx_dtype, monkeypatch):
    """validate=True: IndexError at the first bad position, naming the bound and what it is;
    checked on every call, also once the signature's plan is cached."""
    _path(op, path, monkeypatch)
    case = op.case(10, idx_dtype=idx_dtype)
    U = case.users
    _call(op, path, case, validate=True)  # the plan is cached
    for bad_value in (U, -1, (1 << 31) - 1):
        idx = case.args["idx"].clone()
        idx[2], idx[4] = bad_value, U  # positions 2 and 4 are bad
        message = (rf"idx\[2\] = {bad_value} is out of range: values must lie in \[0, U\) = \[0, {U}\), "
                   f"U being {op.looked_up}")
        with pytest.raises(IndexError, match=message):
            _call(op, path, op.with_input(case, "idx", idx), validate=True)


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
def test_validation_follows_environment(op, path, monkeypatch):
    _path(op, path, monkeypatch)
    case = op.case(11)
    idx = case.args["idx"].clone()
    idx[2] = case.users
    bad = op.with_input(case, "idx", idx)
    monkeypatch.setenv("IKBO_VALIDATE", "1")
    with pytest.raises(IndexError, match=r"idx\[2\]"):
        _call(op, path, bad)
    assert torch.isnan(op.output(_call(op, path, bad, validate=False))[2]).all()
    monkeypatch.setenv("IKBO_VALIDATE", "0")
    assert torch.isnan(op.output(_call(op, path, bad))[2]).all()
    with pytest.raises(IndexError, match=r"idx\[2\]"):
        _call(op, path, bad, validate=True)


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
@pytest.mark.parametrize("validate", ["0", "false", 0.0, "yes"])
def test_validate_must_be_a_bool(op, path, validate, monkeypatch):
    """A string such as "0" is truthy: validate takes a bool (or None), nothing else."""
    _path(op, path, monkeypatch)
    with pytest.raises(TypeError, match="validate must be a bool or None"):
        _call(op, path, op.case(12), validate=validate)


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_out_of_range_index_gives_nan_without_validation(op, path, idx_dtype, monkeypatch):
    """Without validation an out-of-range index reads and writes nothing out of bounds: that
    candidate's output is NaN, and no other candidate is affected."""
    _path(op, path, monkeypatch)
    case = op.case(13, idx_dtype=idx_dtype)
    huge = (1 << 31) - 1 if idx_dtype == torch.int32 else 1 << 40  # int64: 2^40 wraps to 0 in 32 bits
    bad = {1: case.users, 4: -1, 6: huge}
    idx = case.args["idx"].clone()
    for b, v in bad.items():
        idx[b] = v
    out = poisoned(case)
    assert op.output(_call(op, path, op.with_input(case, "idx", idx), out=out, validate=False)) is out
    good = [b for b in range(case.out_shape[0]) if b not in bad]
    assert torch.isnan(out[list(bad)]).all()
    assert not torch.isnan(out[good]).any()
    _assert_close(op, out[good], op.output(op.expected(case))[good])


def test_validate_true_inside_a_graph_capture_raises(op, monkeypatch):
    """The range check reads the indices back to the host, which a capture forbids: asked for
    explicitly it raises there; switched on by the environment it does not apply."""
    case = op.case(14)
    idx = case.args["idx"].clone()
    idx[3] = case.users
    bad = op.with_input(case, "idx", idx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setenv("IKBO_VALIDATE", "1")
    for call in (op.call, op.expected):
        with pytest.raises(RuntimeError, match="validate=True .* CUDA-graph capture"):
            call(case, validate=True)
        assert torch.isnan(op.output(call(bad))[3]).all()  # not validated: NaN, no IndexError


# ----------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
def test_empty_batch_gives_an_empty_result(op, path, monkeypatch):
    """A batch of 0 candidates returns an empty result of the right shape, as torch ops do,
    launching nothing."""
    emulation = _path(op, path, monkeypatch)
    case = op.case(15, B=0)
    assert case.out_shape[0] == 0 and case.args["idx"].shape == (0,)
    res = op.output(_call(op, path, case))
    assert res.shape == case.out_shape and res.dtype == case.dtype
    out = torch.empty(case.out_shape, dtype=case.dtype)
    assert op.output(_call(op, path, case, out=out)) is out
    if emulation is not None:
        assert op.launches(emulation) == 0


@pytest.mark.parametrize("B", [6, 0])
@pytest.mark.parametrize("path", ["cpu", "kernel", "reference"])
def test_the_batch_idx_looks_up_must_not_be_empty(op, path, B, monkeypatch):
    _path(op, path, monkeypatch)
    with pytest.raises(ValueError, match=op.empty_side):
        _call(op, path, op.without_users(op.case(16, B=B)))
