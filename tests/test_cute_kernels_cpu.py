"""The shared machinery: compile cache, compile-only for sm_90a, input checks."""
import dataclasses
import os

import pytest
import torch

from cute_kernels import (
    PlanCache,
    checks,
    copy_back,
    dense_unit_strides,
    forward_only,
    kernel_cache,
    on_device,
    on_gpu,
    plan_key,
    store_target,
    tma_ready,
)
from cute_kernels import compile as compile_mod
from cute_kernels.compile import KernelCache
from tiny_kernel import compile_tiny as _compile


def test_compile_for_sm90a_without_gpu_and_keep_no_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kernel = _compile(keep_ptx=True, ptxas_report=True)
    assert ".target sm_90a" in kernel.ptx
    assert kernel.spill_bytes == 0
    assert kernel.seconds > 0
    assert os.listdir(tmp_path) == []  # the PTX dump does not land in the working directory


def test_spill_bytes_and_wgmma_notes_need_the_report():
    kernel = _compile()
    with pytest.raises(ValueError, match="ptxas_report"):
        kernel.spill_bytes
    with pytest.raises(ValueError, match="ptxas_report"):
        kernel.wgmma_notes


def test_wgmma_notes_read_from_the_ptxas_log():
    kernel = _compile(ptxas_report=True)
    assert kernel.wgmma_notes == []  # no wgmma in this kernel
    log = (
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 872 by compiler\n"
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized\n"
    )
    notes = dataclasses.replace(kernel, ptxas_log=log).wgmma_notes
    assert [n[:7] for n in notes] == ["(C7519)", "(C7514)"]


def test_cache_builds_once_per_key():
    cache = KernelCache()
    calls = []

    def build():
        calls.append(1)
        return _compile()

    first = cache.get(("double", "fp16"), build)
    assert cache.get(("double", "fp16"), build) is first
    assert len(calls) == 1 and len(cache) == 1
    cache.get(("double", "bf16"), build)
    assert len(calls) == 2 and cache.compile_seconds(("double", "fp16")) == first.seconds
    assert kernel_cache is not cache


def test_forward_only_gives_no_silent_gradient():
    w = torch.randn(5, 3, requires_grad=True)
    e = torch.randn(3, 4)
    seen = []

    def run(w_, e_, out):
        seen.append((w_.requires_grad, w_.data_ptr() == w.data_ptr()))
        assert out is None
        return w_ @ e_

    plain = forward_only("op", "op_reference", run, (w.detach(), e))
    assert plain.grad_fn is None and seen.pop() == (False, True)
    with torch.no_grad():
        assert forward_only("op", "op_reference", run, (w, e)).grad_fn is None
    assert seen.pop() == (True, True)  # no node: the inputs reach run as they are

    out = forward_only("op", "op_reference", run, (w, e))
    assert seen.pop() == (False, True)  # detached, the same storage
    assert out.requires_grad and torch.allclose(out, w.detach() @ e)
    with pytest.raises(RuntimeError, match="op has no backward.*op_reference"):
        out.sum().backward()
    assert w.grad is None


@pytest.mark.parametrize("lse", [False, True])
def test_forward_only_out_view_keeps_its_base_on_the_node(lse):
    """out= a view of a buffer: a loss read through the buffer must raise, not lose the term."""
    w = torch.randn(5, 3, requires_grad=True)
    e = torch.randn(3, 4)

    def run(w_, e_, out):
        res = w_ @ e_
        if out is not None:
            out.data.copy_(res)  # as the kernels store: through the pointer
            res = out
        return (res, res.sum(-1)) if lse else res

    for grad in (False, True):
        buf = torch.full((3, 5, 4), float("nan"))
        out = buf[1]
        with torch.set_grad_enabled(grad):
            res = forward_only("op", "op_reference", run, (w, e), out)
        assert (res[0] if lse else res) is out and torch.allclose(buf[1], w.detach() @ e)
        assert buf.requires_grad == grad
    with pytest.raises(RuntimeError, match="op has no backward"):
        buf.sum().backward()
    assert w.grad is None


def test_plan_cache_is_bounded():
    plans = PlanCache(limit=3)
    for b in range(10):
        assert plans.keep(("b", b), b) == b
        assert len(plans) <= 3 and plans[("b", b)] == b
    plans.keep(("b", 9), "again")  # a key already held never clears the others
    assert len(plans) == 1 and plans[("b", 9)] == "again"


def _misaligned(shape):
    """Random contiguous data whose first element is 2 bytes past a 16-byte boundary."""
    flat = torch.randn(torch.Size(shape).numel() + 1).half()[1:]
    assert flat.data_ptr() % 16 == 2
    return flat.view(shape)


def test_tma_ready_copies_only_what_tma_cannot_take():
    t = torch.randn(4, 24).half()
    assert tma_ready(t) is t
    assert tma_ready(t[:, :8], strides_ok=True).data_ptr() == t.data_ptr()  # strided but usable
    for bad in (t.t(), t[:, :8], _misaligned((4, 24)), _misaligned((4, 24))[:, :8]):
        ready = tma_ready(bad)
        assert ready.is_contiguous() and ready.data_ptr() % 16 == 0 and torch.equal(ready, bad)
    ready = tma_ready(_misaligned((4, 24)), strides_ok=True)  # usable strides, misaligned data
    assert ready.data_ptr() % 16 == 0


def test_size1_dims_get_dense_strides():
    t = torch.randn(5, 1, 8).half().movedim(1, 0)  # [1, 5, 8], the size-1 dim's stride 8
    assert t.is_contiguous() and t.stride() == (8, 8, 1)
    d = dense_unit_strides(t)
    assert d.stride() == (40, 8, 1) and d.data_ptr() == t.data_ptr() and torch.equal(d, t)
    odd = torch.randn(3, 8, 1).half().movedim(2, 1)  # [3, 1, 8], stride 1 on the size-1 dim
    assert odd.is_contiguous() and odd.stride(1) == 1
    assert tma_ready(odd).stride() == (8, 8, 1)
    assert store_target(odd, (3, 1, 8)).stride() == (8, 8, 1)
    strided = torch.randn(4, 1, 32).half()[:, :, :16]  # strided rows: only the size-1 dim changes
    assert dense_unit_strides(strided.movedim(1, 0)).stride() == (128, 32, 1)


def test_store_target_and_copy_back():
    out = torch.full((3, 5, 7), float("nan")).half()
    assert store_target(out, (3, 5, 7)) is out
    assert copy_back(out, out) is out
    wide = store_target(out, (3, 5, 8))  # columns padded for the kernel
    assert wide.shape == (3, 5, 8) and wide.dtype == out.dtype
    wide.copy_(torch.randn(3, 5, 8))
    assert copy_back(out, wide) is out and torch.equal(out, wide[..., :7])
    bad = _misaligned((3, 5, 8))
    target = store_target(bad, (3, 5, 8))
    assert target is not bad and target.data_ptr() % 16 == 0
    target.copy_(torch.randn(3, 5, 8))
    assert torch.equal(copy_back(bad, target), target)


def test_copy_back_moves_the_version_counter():
    out = torch.zeros(2, 8).half()
    version = out._version
    copy_back(out, out)  # the kernel stored into out itself
    assert out._version > version
    version = out._version
    copy_back(out, torch.ones(2, 16).half())
    assert out._version > version and torch.equal(out, torch.ones(2, 8).half())


def test_on_device_makes_only_another_gpu_current(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        with on_device(device):  # nothing to switch
            pass
        assert not isinstance(on_device(device), torch.cuda.device)
    guard = on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_writable_check():
    checks.check_writable("out", torch.zeros(3))
    checks.check_writable("out", torch.zeros(3, requires_grad=True) * 2)  # not a leaf: autograd tracks it
    with torch.no_grad():
        checks.check_writable("out", torch.zeros(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="out is a leaf tensor that requires grad"):
        checks.check_writable("out", torch.zeros(3, requires_grad=True))
    with torch.inference_mode():
        inference = torch.zeros(3)
        checks.check_writable("out", inference)
    with pytest.raises(RuntimeError, match="out is an inference tensor"):
        checks.check_writable("out", inference)


def test_no_overlap_check():
    buf = torch.randn(4, 10)
    checks.check_no_overlap("out", buf[2:], ("a", "b", "c"), (buf[:2], None, torch.randn(3)))
    for view in (buf[1:3], buf[:, 3:5], buf.t(), buf[3, 9:]):
        with pytest.raises(ValueError, match="out overlaps b in memory"):
            checks.check_no_overlap("out", buf[2:], ("a", "b"), (buf[:2], view))
    with pytest.raises(ValueError, match="overlaps"):  # interleaved columns: refused too
        checks.check_no_overlap("out", buf[:, ::2], ("a",), (buf[:, 1::2],))
    meta = torch.empty(4, 10, device="meta")  # no storage: every data_ptr is 0
    checks.check_no_overlap("out", meta, ("a",), (torch.empty(3, device="meta"),))
    checks.check_no_overlap("out", buf, ("a",), (buf.to_sparse(),))  # refused by the shape checks instead


def test_out_target_check_is_both_checks():
    buf = torch.zeros(8)
    checks.check_out_target("out", buf[4:], ("a",), (buf[:4],))
    with pytest.raises(ValueError, match="out overlaps a"):
        checks.check_out_target("out", buf[3:], ("a",), (buf[:4],))
    with pytest.raises(RuntimeError, match="out is a leaf tensor that requires grad"):
        checks.check_out_target("out", torch.zeros(3, requires_grad=True), ("a",), (buf,))


def test_checks_name_the_argument():
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="^w must be float16 or bfloat16, got float32$"):
        checks.check_tensor("w", x, ndim=2, dtypes=checks.FLOAT_DTYPES, layout="[M, K]")
    with pytest.raises(ValueError, match=r"^w must have 3 dimensions \[B, K, N\], got shape \[2, 3\]$"):
        checks.check_tensor("w", x.half(), ndim=3, dtypes=checks.FLOAT_DTYPES, layout="[B, K, N]")
    with pytest.raises(ValueError, match=r"^idx must have 1 dimension \[B\], got shape \[2, 3\]$"):
        checks.check_tensor("idx", x.int(), ndim=1, dtypes=checks.INDEX_DTYPES, layout="[B]")
    with pytest.raises(ValueError, match=r"^w must not be empty: expected \[M, K\] with every size >= 1, got \[0, 3\]$"):
        checks.check_tensor("w", torch.empty(0, 3).half(), ndim=2, dtypes=checks.FLOAT_DTYPES, layout="[M, K]")
    with pytest.raises(ValueError, match=r"with every size but the first >= 1, got \[0, 0\]$"):
        checks.check_tensor("e", torch.empty(0, 0).half(), ndim=2, dtypes=checks.FLOAT_DTYPES, layout="[B, K]",
                            empty_batch=True)
    assert checks.check_tensor("e", torch.empty(0, 3).half(), ndim=2, dtypes=checks.FLOAT_DTYPES, layout="[B, K]",
                               empty_batch=True).shape == (0, 3)
    with pytest.raises(TypeError, match="w must be a torch.Tensor"):
        checks.check_tensor("w", [1, 2], ndim=2, dtypes=checks.FLOAT_DTYPES, layout="[M, K]")


def test_dim_check_names_the_dimension_and_where_its_size_comes_from():
    e = torch.randn(6, 4, 4).half()
    checks.check_dim("e_cand", e, 1, 4, "K_cand (w_cand.shape[1])", "[B, K_cand, N]")
    with pytest.raises(ValueError) as info:
        checks.check_dim("e_cand", e, 1, 5, "K_cand (w_cand.shape[1])", "[B, K_cand, N]")
    assert str(info.value) == ("e_cand has shape [6, 4, 4], expected [B, K_cand, N]: its K_cand (dimension 1) must be "
                               "K_cand (w_cand.shape[1]) = 5, got 4")


def test_index_range_names_the_first_bad_position():
    idx = torch.tensor([0, 2, 5, -1, 7])
    with pytest.raises(IndexError, match=r"^idx\[2\] = 5 is out of range: values must lie in \[0, U\) = \[0, 5\)$"):
        checks.check_index_range("idx", idx, 5, "U")
    with pytest.raises(IndexError) as info:
        checks.check_index_range("idx", torch.tensor([0, 1, 3]), 3, "U", "the batch of k and v")
    assert str(info.value) == ("idx[2] = 3 is out of range: values must lie in [0, U) = [0, 3), "
                               "U being the batch of k and v")
    checks.check_index_range("idx", torch.randint(0, 5, (100,)), 5, "U")


def test_plan_key_of_a_call_signature():
    t = torch.randn(3, 4).half()
    key = plan_key(t, [t, None], "fused", 2)
    assert hash(key) is not None and key == plan_key(torch.randn(3, 4).half(), [t, None], "fused", 2)
    for other in (t.float(), t.t(), t[:2], t.to("meta"), torch.randn(3, 8).half()[:, :4]):  # dtype, strides, shape, device
        assert plan_key(other, [t, None], "fused", 2) != key
    assert plan_key(t, (t, None), "fused", 2) != key  # a tuple is not a list
    assert plan_key(t, [t, None], "two_launch", 2) != key
    sparse = plan_key(t.to_sparse())  # a key of its own (the full checks then refuse it)
    assert hash(sparse) is not None and sparse != key[:1] and torch.sparse_coo in sparse[0]


def test_on_gpu():
    assert not on_gpu(torch.zeros(2)) and not on_gpu(torch.zeros(2, device="meta"))
    assert not on_gpu(None) and not on_gpu([torch.zeros(2)])


def test_validation_switch(monkeypatch):
    monkeypatch.delenv("IKBO_VALIDATE", raising=False)
    assert not checks.validation_enabled(None)
    assert checks.validation_enabled(True)
    monkeypatch.setenv("IKBO_VALIDATE", "1")
    assert checks.validation_enabled(None)
    assert not checks.validation_enabled(False)
    monkeypatch.setenv("IKBO_VALIDATE", "0")
    assert not checks.validation_enabled(None)
    for off in (" 0", "0 ", "off", "N", "FALSE\n", ""):
        monkeypatch.setenv("IKBO_VALIDATE", off)
        assert not checks.validation_enabled(None), off
    for on in ("1", " yes", "true"):
        monkeypatch.setenv("IKBO_VALIDATE", on)
        assert checks.validation_enabled(None), on
    for bad in ("0", "false", 0.0):
        with pytest.raises(TypeError, match="validate must be a bool or None"):
            checks.validation_enabled(bad)


def test_validation_inside_a_graph_capture(monkeypatch):
    """The range check reads the indices back to the host, which a capture forbids: asked for
    explicitly it raises there; switched on by the environment it does not apply."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setenv("IKBO_VALIDATE", "1")
    assert not checks.validation_enabled(None) and not checks.validation_enabled(False)
    with pytest.raises(RuntimeError, match="validate=True .* CUDA-graph capture"):
        checks.validation_enabled(True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert checks.validation_enabled(None) and checks.validation_enabled(True)


def test_occupancy_query_runs_in_the_primary_context(monkeypatch):
    """The occupancy query reports for the current context: it runs with the device's primary
    context pushed (a thread that has made no CUDA runtime call has none current, a green
    context has fewer SMs), and the context current before is restored after it."""
    import types

    import cuda.bindings

    from cute_kernels import arch

    calls = []
    stack = ["green"]
    fake = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        cuDeviceGet=lambda i: calls.append(("get", i)) or (0, 100 + i),
        cuDevicePrimaryCtxRetain=lambda d: calls.append(("retain", d)) or (0, 7000 + d),
        cuCtxPushCurrent=lambda c: stack.append(c) or (0,),
        cuCtxPopCurrent=lambda: (0, stack.pop()),
    )
    monkeypatch.setattr(cuda.bindings, "driver", fake)
    with arch._primary_context(1):
        assert stack == ["green", 7101]
    assert stack == ["green"] and calls == [("get", 1), ("retain", 101)]
    with pytest.raises(ValueError), arch._primary_context(1):
        raise ValueError  # popped on the way out
    assert stack == ["green"]
    fake.cuDevicePrimaryCtxRetain = lambda d: (2, None)
    with pytest.raises(RuntimeError, match="primary CUDA context of device 1"), arch._primary_context(1):
        pass
    assert stack == ["green"]


def test_context_sm_count(monkeypatch):
    """The SMs of the current context (a green context's share) from the driver; None where
    there is no current context or the driver cannot say."""
    import types

    import cuda.bindings

    from cute_kernels import arch

    state = {"ctx": 5, "err": 0}
    fake = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        CUdevResourceType=types.SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1),
        cuCtxGetCurrent=lambda: (0, state["ctx"]),
        cuCtxGetDevResource=lambda ctx, kind: (
            state["err"], types.SimpleNamespace(sm=types.SimpleNamespace(smCount=64 if ctx == 5 and kind == 1 else 0))
        ),
    )
    monkeypatch.setattr(cuda.bindings, "driver", fake)
    assert arch.context_sm_count() == 64
    state["err"] = 3
    assert arch.context_sm_count() is None
    state.update(err=0, ctx=0)
    assert arch.context_sm_count() is None
    del fake.cuCtxGetDevResource  # a cuda-python without the query
    state["ctx"] = 5
    assert arch.context_sm_count() is None


def test_occupancy_query_holds_the_compile_lock(monkeypatch):
    """The occupancy query compiles a probe kernel; the DSL is not thread-safe."""
    import contextlib

    import cutlass.utils

    from cute_kernels import arch

    held = []

    class FakeHardwareInfo:
        def __init__(self, index):
            pass

        def get_max_active_clusters(self, size):
            held.append(compile_mod._compile_lock._is_owned())
            return 120 // size

    monkeypatch.setattr(cutlass.utils, "HardwareInfo", FakeHardwareInfo)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(arch, "_primary_context", lambda index: contextlib.nullcontext())
    arch._max_active_clusters.cache_clear()
    try:
        assert arch._max_active_clusters(7, 8) == 15 and held == [True]
    finally:
        arch._max_active_clusters.cache_clear()


def _never():
    raise AssertionError("compiled although the disk cache holds the kernel")


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    key = ("double", "fp16")
    first = KernelCache().get(key, _compile, package="cute_kernels")
    assert not first.loaded
    path = compile_mod.disk_path(key, "cute_kernels")
    assert path.parent == tmp_path and path.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    # A fresh process's cache: loaded, not compiled.
    again = KernelCache().get(key, _never, package="cute_kernels")
    assert again.loaded and callable(again.fn)
    # Another key, another source or another toolchain is another file.
    assert compile_mod.disk_path(("double", "bf16"), "cute_kernels") != path
    monkeypatch.setattr(compile_mod, "source_fingerprint", lambda package: "edited")
    assert compile_mod.disk_path(key, "cute_kernels") != path


def test_disk_cache_replaces_a_bad_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    key = ("double", "fp16")
    path = compile_mod.disk_path(key, "cute_kernels")
    path.write_bytes(b"not an object file")
    with pytest.warns(UserWarning, match="cannot load cached kernel"):
        kernel = KernelCache().get(key, _compile, package="cute_kernels")
    assert not kernel.loaded
    assert KernelCache().get(key, _never, package="cute_kernels").loaded


def test_disk_cache_off_or_unwritable(tmp_path, monkeypatch):
    key = ("double", "fp16")
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", "")
    assert compile_mod.disk_path(key, "cute_kernels") is None
    assert not KernelCache().get(key, _compile, package="cute_kernels").loaded
    # Without a package a kernel stays in memory.
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    KernelCache().get(key, _compile)
    assert list(tmp_path.iterdir()) == []
    # A directory that cannot be made: warned about, the kernel still returned.
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="cannot write the kernel cache"):
        kernel = KernelCache().get(key, _compile, package="cute_kernels")
    assert callable(kernel.fn) and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_disk_cache_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTE_KERNELS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_mod.cache_dir() == tmp_path / "cute_kernels"


@pytest.mark.parametrize("buffers", [2, 3, 4, 6])
def test_staged_stores_free_each_buffer_before_its_reuse(buffers):
    from cute_kernels.staged_stores import StagedStores

    staged = StagedStores(buffers)
    assert staged.pending_at_sync == buffers - 2
    assert [staged.buffer(j, 1) for j in range(buffers + 1)] == [buffers + j % buffers for j in range(buffers + 1)]
    staged.replay(5 * buffers + 3)


def test_staged_stores_replay_catches_a_wait_too_loose():
    from cute_kernels.staged_stores import StagedStores

    class Loose(StagedStores):
        @property
        def pending_at_sync(self):
            return self.buffers - 1

    with pytest.raises(AssertionError, match="read after the barrier"):
        Loose(3).replay(10)
    with pytest.raises(ValueError, match="at least 2 buffers"):
        StagedStores(1)

