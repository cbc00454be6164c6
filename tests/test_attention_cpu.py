"""CPU tests of ikbo_fa: the reference against float64 attention on materialized
tensors, argument validation, and sm_90a compiles of every shipped kernel configuration."""
import importlib
import math

import pytest
import torch

import ikbo_fa
from cute_kernels.plans import PlanCache
attention_mod = importlib.import_module("ikbo_fa.attention")  # the module, not the function
from ikbo_fa.reference import attention_reference, naive_attention
from ikbo_fa.worklist import kv_worklist, max_tiles_per_head

from attention_inputs import materialize, random_problem


def _problem(seed, *, direction, B, U, S_q, H, H_kv, D, L, dtype=torch.float32, packed=False,
             jagged=False, sort=False):
    q, kv, k, v, idx, lengths = random_problem(seed, direction, B, U, S_q, H, H_kv, D, L, dtype,
                                               packed=packed, jagged=jagged, sort=sort)
    return q, kv, k, v, idx.to(torch.int32), lengths


def _materialized_truth(q, k, v, idx, direction, scale, lengths):
    qm, km, vm, lm = materialize(q, k, v, idx, direction, lengths)
    return naive_attention(qm.double(), km.double(), vm.double(), scale, lm)


CASES = [
    # direction, B, U, S_q, H, H_kv, D, L, packed, jagged
    ("kv", 7, 3, 5, 2, 1, 16, 9, False, False),
    ("kv", 10, 1, 1, 4, 2, 8, 1, True, False),
    ("kv", 12, 5, 3, 6, 6, 8, 13, True, True),
    ("kv", 9, 9, 2, 2, 2, 8, 5, False, True),  # ratio 1 (needs broadcast)
    ("q", 8, 3, 4, 2, 1, 16, 7, False, False),
    ("q", 6, 2, 3, 4, 4, 8, 11, True, True),
    ("q", 5, 1, 2, 2, 1, 8, 3, False, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_reference_matches_float64_materialized(case):
    direction, B, U, S_q, H, H_kv, D, L, packed, jagged = case
    q, kv, k, v, idx, lengths = _problem(hash(case) % 1000, direction=direction, B=B, U=U, S_q=S_q, H=H,
                                         H_kv=H_kv, D=D, L=L, packed=packed, jagged=jagged)
    broadcast = direction if B == U else None
    scale = 1.0 / math.sqrt(D)
    out, lse = attention_reference(q, kv, idx, kv_lengths=lengths, broadcast=broadcast, return_lse=True)
    ref_o, ref_lse = _materialized_truth(q, k, v, idx, direction, scale, lengths)
    assert out.shape == (B, S_q, H, D) and out.dtype == q.dtype
    assert lse.shape == (B, H, S_q) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    if jagged:
        empty = (lengths[idx.long()] == 0) if direction == "kv" else (lengths == 0)
        assert empty.any()
        assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_unsorted(dtype):
    q, kv, k, v, idx, lengths = _problem(3, direction="kv", B=33, U=4, S_q=6, H=2, H_kv=1, D=32, L=40,
                                         dtype=dtype, jagged=True)
    out = attention_reference(q, kv, idx, kv_lengths=lengths, scale=0.3)
    ref, _ = _materialized_truth(q, k, v, idx, "kv", 0.3, lengths)
    assert out.dtype == dtype
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2


def test_op_on_cpu_runs_reference_and_fills_out():
    q, kv, k, v, idx, lengths = _problem(4, direction="kv", B=9, U=2, S_q=3, H=2, H_kv=2, D=8, L=6,
                                         dtype=torch.bfloat16)
    out = torch.full((9, 3, 2, 8), float("nan"), dtype=torch.bfloat16)
    res, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True)
    assert res is out and not out.isnan().any()
    ref, ref_lse = attention_reference(q, kv, idx, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_jagged_padding_that_is_not_finite_is_ignored():
    q, kv, k, v, idx, _ = _problem(5, direction="kv", B=6, U=2, S_q=2, H=1, H_kv=1, D=8, L=10)
    lengths = torch.tensor([4, 7])
    k[0, 4:] = float("nan")
    v[0, 4:] = float("inf")
    k[1, 7:] = float("inf")
    v[1, 7:] = float("nan")
    out = attention_reference(q, (k, v), idx, kv_lengths=lengths)
    assert torch.isfinite(out).all()


def test_nan_in_one_user_stays_there():
    q, kv, k, v, idx, _ = _problem(6, direction="kv", B=10, U=3, S_q=2, H=2, H_kv=1, D=8, L=5)
    k[1, 2, 0, 3] = float("nan")
    out = attention_reference(q, (k, v), idx)
    bad = idx == 1
    assert out[bad].isnan().all() and not out[~bad].isnan().any()


@pytest.mark.parametrize("direction", ["kv", "q"])
def test_out_of_range_index(direction):
    q, kv, k, v, idx, _ = _problem(7, direction=direction, B=8, U=3, S_q=2, H=2, H_kv=1, D=8, L=5,
                                   dtype=torch.float16)
    idx[2] = 3
    idx[5] = -1
    with pytest.raises(IndexError, match=r"idx\[2\] = 3"):
        attention_reference(q, kv, idx, validate=True)
    with pytest.raises(IndexError, match=r"idx\[2\] = 3"):
        ikbo_fa.attention(q, kv, idx, validate=True)
    out, lse = attention_reference(q, kv, idx, validate=False, return_lse=True)
    bad = torch.zeros(8, dtype=torch.bool)
    bad[[2, 5]] = True
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[~bad].isnan().any() and not lse[~bad].isnan().any()
    good = idx.clone()
    good[bad] = 0
    ref = attention_reference(q, kv, good)
    torch.testing.assert_close(out[~bad], ref[~bad], rtol=0, atol=0)


def test_validation_errors():
    q, kv, k, v, idx, _ = _problem(8, direction="kv", B=6, U=2, S_q=2, H=2, H_kv=1, D=8, L=5,
                                   dtype=torch.bfloat16)
    f = ikbo_fa.attention
    with pytest.raises(TypeError, match="q must be"):
        f(q.to(torch.int32), kv, idx)
    with pytest.raises(TypeError, match="k is"):
        f(q, (k.half(), v), idx)
    with pytest.raises(TypeError, match="idx must be"):
        f(q, kv, idx.float())
    with pytest.raises(TypeError, match="idx must be"):
        f(q, kv, [0, 1])
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        f(q[0], kv, idx)
    with pytest.raises(ValueError, match="idx has length 5"):
        f(q, kv, idx[:5])
    with pytest.raises(ValueError, match="not a multiple"):
        f(q[:, :, :1].expand(6, 2, 3, 8).contiguous(), (k.expand(2, 5, 2, 8), v.expand(2, 5, 2, 8)), idx)
    with pytest.raises(ValueError, match="head dimension"):
        f(q, (k[..., :4], v[..., :4]), idx)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        f(q, (k, v[:, :4]), idx)
    with pytest.raises(ValueError, match="packed"):
        f(q, torch.randn(2, 5, 3, 1, 8, dtype=torch.bfloat16), idx)
    with pytest.raises(ValueError, match="kv must have 5 dimensions"):
        f(q, k, idx)
    with pytest.raises(TypeError, match="kv must be"):
        f(q, (k, v, v), idx)
    with pytest.raises(ValueError, match="broadcast"):
        f(q, kv, idx, broadcast="x")
    with pytest.raises(ValueError, match="needs k/v batch"):
        f(q, kv, idx, broadcast="q")
    with pytest.raises(ValueError, match="kv_lengths"):
        f(q, kv, idx, kv_lengths=torch.tensor([1, 2, 3]))
    with pytest.raises(IndexError, match="kv_lengths"):
        f(q, kv, idx, kv_lengths=torch.tensor([1, 6]), validate=True)
    with pytest.raises(ValueError, match="out has shape"):
        f(q, kv, idx, out=torch.empty(6, 2, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must be"):
        f(q, kv, idx, out=torch.empty(6, 2, 2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="device"):
        f(q, kv, idx.to("meta"))
    # Both sides at batch len(idx): the direction must be named.
    sq = torch.randn(2, 2, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="broadcast='kv'"):
        f(sq, (k, v), torch.tensor([1, 0]))
    a = f(sq, (k, v), torch.tensor([1, 0]), broadcast="kv")
    b = f(sq, (k, v), torch.tensor([1, 0]), broadcast="q")
    assert not torch.equal(a, b)


def test_worklist_groups_and_counts():
    idx = torch.tensor([2, 0, 5, 2, -3, 1, 2, 0, 2, 2])
    order, cand_start, tile_start = kv_worklist(idx, 3, 2, 1)
    assert order.dtype == cand_start.dtype == tile_start.dtype == torch.int32
    assert cand_start.tolist() == [0, 2, 3, 8, 10]
    assert order.tolist() == [1, 7, 5, 0, 3, 6, 8, 9, 2, 4]
    assert tile_start.tolist() == [0, 1, 2, 5, 6]
    assert tile_start[-1] <= max_tiles_per_head(10, 3, 2, 1)
    _, _, tile_start = kv_worklist(idx, 3, 1, 3)
    assert tile_start.tolist() == [0, 6, 9, 24, 30]


# ---------------------------------------------------------------- compiles
def _compile_ids(cfg):
    return (f"{cfg.dtype}-d{cfg.head_dim}-s{cfg.s_q}-{cfg.direction}-len{int(cfg.has_kv_lengths)}"
            f"-lse{int(cfg.return_lse)}-ovl{int(cfg.overlap)}")


def _check_compiled(cfg):
    ck = attention_mod.compile_config(cfg, keep_ptx=True, ptxas_report=True)
    # griddepcontrol.wait: launched dependent on the work list (programmatic dependent launch)
    for instr in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier", "griddepcontrol.wait"):
        assert instr in ck.ptx, instr
    assert ck.spill_bytes == 0, ck.ptxas_log
    # ptxas serializes wgmma when the accumulators do not fit (a silent 2x slowdown), and
    # inserts fences or waits the code lacks: neither may happen.
    assert ck.wgmma_notes == [], ck.ptxas_log


@pytest.mark.parametrize("cfg", attention_mod.SHIPPED_CONFIGS, ids=_compile_ids)
def test_shipped_config_compiles_for_sm90a(cfg):
    _check_compiled(cfg)


def test_odd_sq_compiles_for_sm90a():
    from ikbo_fa.fwd_sm90 import FwdConfig

    _check_compiled(FwdConfig("fp16", 64, 100, "q", True, True))


# ------------------------------------------------- work list: torch reference edges
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_worklist_reference_out_of_range_and_edges(idx_dtype):
    big = 2**40 if idx_dtype == torch.int64 else 2**31 - 1
    idx = torch.tensor([3, -1, 0, 7, big, 3, -big, 3, 1], dtype=idx_dtype)  # U = 4: 7, big, -1, -big invalid
    order, cand_start, tile_start = kv_worklist(idx, 4, 4, 1)
    assert cand_start.tolist() == [0, 1, 2, 2, 5, 9]
    assert order.tolist() == [2, 8, 0, 5, 7, 1, 3, 4, 6]
    assert tile_start.tolist() == [0, 1, 2, 2, 3, 4]
    # One user, one candidate.
    order, cand_start, tile_start = kv_worklist(torch.tensor([0], dtype=idx_dtype), 1, 8, 1)
    assert order.tolist() == [0] and cand_start.tolist() == [0, 1, 1] and tile_start.tolist() == [0, 1, 1]
    order, cand_start, tile_start = kv_worklist(torch.tensor([5], dtype=idx_dtype), 1, 1, 2)
    assert order.tolist() == [0] and cand_start.tolist() == [0, 0, 1] and tile_start.tolist() == [0, 0, 2]


def test_worklist_reference_random_against_python():
    g = torch.Generator().manual_seed(11)
    U, B, per_tile = 37, 500, 4
    idx = torch.randint(-5, U + 5, (B,), generator=g)
    order, cand_start, tile_start = kv_worklist(idx, U, per_tile, 1)
    groups = [[b for b in range(B) if (int(idx[b]) if 0 <= idx[b] < U else U) == u] for u in range(U + 1)]
    starts = [0]
    tiles = [0]
    for grp in groups:
        starts.append(starts[-1] + len(grp))
        tiles.append(tiles[-1] + -(-len(grp) // per_tile))
    assert cand_start.tolist() == starts and tile_start.tolist() == tiles
    assert order.tolist() == [b for grp in groups for b in grp]
    assert tile_start[-1] <= max_tiles_per_head(B, U, per_tile, 1)


# ------------------------------------------ the GPU path's host side, kernels emulated
LOG2E = 1.4426950408889634


class _EmulatedKernels:
    """Stand-ins for the compiled kernels: the work list from the torch reference,
    the forward pass from naive attention over exactly the arrays the kernel reads."""

    def __init__(self):
        self.fwd_calls = []
        self.worklist_calls = 0

    def worklist(self, idx, order, cand_start, tile_start, n_users, per_tile, chunks):
        self.worklist_calls += 1
        for t, n in ((order, idx.shape[0]), (cand_start, n_users + 2), (tile_start, n_users + 2)):
            assert t.dtype == torch.int32 and t.is_contiguous() and t.shape == (n,)
        assert idx.is_contiguous()
        ref = kv_worklist(idx, n_users, per_tile, chunks)
        for t, r in zip((order, cand_start, tile_start), ref):
            t.copy_(r)

    def fwd(self, q, k, v, out, lse, cand, cand_start, tile_start, kvl, scale_log2, scale, n_ctas):
        self.fwd_calls.append(dict(cand=cand, kvl=kvl, scale=scale, n_ctas=n_ctas, q=q, k=k, out=out))
        assert scale_log2 == pytest.approx(scale * LOG2E)
        assert scale > 0  # the kernel's running max assumes it
        assert cand.dtype == torch.int32 and cand.is_contiguous() and 1 <= n_ctas <= 132
        # What the TMA descriptors need (the launcher checks no stride of a size-1 dim).
        for t in (q, k, v, out):
            assert t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]), t.stride()
            assert t.data_ptr() % 16 == 0
        L = k.shape[1]
        if kvl is not None:
            assert kvl.dtype == torch.int32 and kvl.is_contiguous()
            assert ((kvl >= 0) & (kvl <= L)).all()
        B = out.shape[0]
        f32 = lambda t: t.float()  # noqa: E731
        if cand_start is not None:  # KV broadcast: groups of the work list
            U = k.shape[0]
            assert cand_start.shape == (U + 2,) and tile_start.shape == (U + 2,)
            assert sorted(cand.tolist()) == list(range(B)) and int(cand_start[-1]) == B
            runs = [(cand[cand_start[u]:cand_start[u + 1]].long(), u) for u in range(U + 1)]
        else:  # Q broadcast: one candidate per run, Q looked up
            runs = [(torch.tensor([b]), b) for b in range(B)]
        for members, r in runs:
            if len(members) == 0:
                continue
            if cand_start is not None:
                bad = r == k.shape[0]
                qs = q[members]
                ks, vs = (k[:1], v[:1]) if bad else (k[r:r + 1], v[r:r + 1])
            else:
                c = int(cand[r])
                bad = not 0 <= c < q.shape[0]
                qs = q[0:1] if bad else q[c:c + 1]
                ks, vs = k[r:r + 1], v[r:r + 1]
            n = len(members)
            ks = ks.expand(n, *ks.shape[1:])
            vs = vs.expand(n, *vs.shape[1:])
            lengths = None if kvl is None else kvl[r if not bad else 0].expand(n)
            o, l = naive_attention(f32(qs), f32(ks), f32(vs), scale, lengths)
            if bad:
                o.fill_(float("nan"))
                l.fill_(float("nan"))
            out.data[members] = o.to(out.dtype)  # through the pointer, as the kernel: autograd sees no write
            if lse is not None:
                lse.data[members] = l


@pytest.fixture
def emulated(monkeypatch):
    kernels = _EmulatedKernels()
    monkeypatch.setattr(attention_mod, "_plans", PlanCache())
    monkeypatch.setattr(attention_mod, "_on_gpu", lambda q: isinstance(q, torch.Tensor))
    monkeypatch.setattr(attention_mod, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: kernels.fwd)
    monkeypatch.setattr(attention_mod, "_worklist_kernel", lambda dtype: kernels.worklist)
    builds = []
    real_resolve = attention_mod.resolve_problem

    def counting_resolve(*args, **kwargs):
        builds.append(1)
        return real_resolve(*args, **kwargs)

    monkeypatch.setattr(attention_mod, "resolve_problem", counting_resolve)
    kernels.builds = builds
    return kernels


def _gpu_path_problem(seed, direction, B, U, idx_dtype=torch.int32, S_q=3, L=9, jagged=False, packed=False):
    q, kv, k, v, idx, lengths = _problem(seed, direction=direction, B=B, U=U, S_q=S_q, H=2, H_kv=1, D=64, L=L,
                                         dtype=torch.bfloat16, jagged=jagged, packed=packed)
    return q, kv, idx.to(idx_dtype), lengths


def test_gpu_path_launches_with_the_operands_device_current(emulated, monkeypatch, devices_made_current):
    """A kernel launches in the current device's context: operands on another GPU have their
    device made current around both launches (the work list and the attention kernel)."""
    current = devices_made_current(attention_mod)
    seen = []
    for name in ("fwd", "worklist"):
        kernel = getattr(emulated, name)
        monkeypatch.setattr(emulated, name, lambda *a, kernel=kernel, name=name: (
            seen.append((name, list(current))), kernel(*a))[1])
    q, kv, idx, _ = _gpu_path_problem(23, "kv", 11, 3)
    out = ikbo_fa.attention(q, kv, idx)
    torch.testing.assert_close(out, attention_reference(q, kv, idx), rtol=1e-2, atol=1e-2)
    assert seen == [("worklist", [q.device]), ("fwd", [q.device])] and not current


def test_gpu_path_scale_values(emulated):
    """Any finite scale whose product with log2(e) fits in float32; below float32's normal range
    the kernel runs as scale 0 (q zeroed, scale 1), where exp2(-inf * 0) would be NaN."""
    q, kv, idx, _ = _gpu_path_problem(30, "kv", 6, 2)
    for tiny in (1e-300, -1e-300, 1e-45):
        out = ikbo_fa.attention(q, kv, idx, scale=tiny)
        call = emulated.fwd_calls[-1]
        assert call["scale"] == 1.0 and not call["q"].any()
        torch.testing.assert_close(out, attention_reference(q, kv, idx, scale=0.0), rtol=1e-2, atol=1e-2)
    for op in (ikbo_fa.attention, attention_reference):
        with pytest.raises(ValueError, match="outside float32's range"):
            op(q, kv, idx, scale=1e39)
        for bad in (10**400, float("inf"), True, "0.1"):
            with pytest.raises(TypeError, match="scale must be a finite float"):
                op(q, kv, idx, scale=bad)
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(ikbo_fa.attention(q, kv, idx, scale=np.float32(0.25)),
                               attention_reference(q, kv, idx, scale=0.25), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("direction", ["kv", "q"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("use_kernel_worklist", [True, False])
def test_gpu_path_matches_reference_out_of_range_unvalidated(emulated, monkeypatch, direction, idx_dtype,
                                                             use_kernel_worklist):
    if not use_kernel_worklist:
        monkeypatch.setattr(attention_mod, "_worklist_fits", lambda n: False)
    B, U, L = 11, 3, 9
    q, kv, idx, _ = _gpu_path_problem(21, direction, B, U, idx_dtype, L=L, packed=direction == "kv")
    n_kv = U if direction == "kv" else B
    g = torch.Generator().manual_seed(22)
    lengths = torch.randint(-4, L + 6, (n_kv,), generator=g).to(idx_dtype)  # out of [0, L]: clamped
    for call in range(3):
        bad_idx = idx.clone()
        bad_idx[call] = -1 - call
        # int64: wraps to a valid user if converted without the clamp
        bad_idx[call + 4] = 2**32 + call if idx_dtype == torch.int64 else U + call
        out, lse = ikbo_fa.attention(q, kv, bad_idx, kv_lengths=lengths, return_lse=True, validate=False)
        ref, ref_lse = attention_reference(q, kv, bad_idx, kv_lengths=lengths, return_lse=True, validate=False)
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2, equal_nan=True)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4, equal_nan=True)
        assert out[[call, call + 4]].isnan().all()
    assert len(emulated.builds) == 1  # one full check for one signature
    assert len(emulated.fwd_calls) == 3
    if direction == "kv":
        assert emulated.worklist_calls == (3 if use_kernel_worklist else 0)
    else:
        assert emulated.worklist_calls == 0


@pytest.mark.parametrize("direction", ["kv", "q"])
def test_gpu_path_validated_inputs_pass_through(emulated, direction):
    B, U, L = 8, 3, 9
    q, kv, idx, lengths = _gpu_path_problem(23, direction, B, U, L=L, jagged=True)
    lengths32 = lengths.to(torch.int32)
    out = torch.full((B, 3, 2, 64), float("nan"), dtype=torch.bfloat16)
    res = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths32, out=out, validate=True)
    assert res is out and not out.isnan().any()
    torch.testing.assert_close(out, attention_reference(q, kv, idx, kv_lengths=lengths), rtol=1e-2, atol=1e-2)
    call = emulated.fwd_calls[-1]
    assert call["kvl"] is lengths32  # range-checked contiguous int32 lengths: no copy
    if direction == "q":
        assert call["cand"] is idx  # int32 idx: the kernel reads it as is
    ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, validate=True)  # int64 lengths: another signature
    assert emulated.fwd_calls[-1]["kvl"].dtype == torch.int32
    assert torch.equal(emulated.fwd_calls[-1]["kvl"], lengths32)
    assert len(emulated.builds) == 2


def test_gpu_path_cached_plan_still_checks_ranges_and_scale(emulated):
    q, kv, idx, lengths = _gpu_path_problem(24, "kv", 9, 4, jagged=True)
    ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, validate=True)
    bad = idx.clone()
    bad[6] = 4
    with pytest.raises(IndexError, match=r"idx\[6\] = 4"):
        ikbo_fa.attention(q, kv, bad, kv_lengths=lengths, validate=True)
    with pytest.raises(IndexError, match=r"kv_lengths\[1\] = 10"):
        ikbo_fa.attention(q, kv, idx, kv_lengths=torch.tensor([1, 10, 2, 3]), validate=True)
    for scale in (0.5, 0.25, 0.0, -0.3):
        out = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, scale=scale)
        assert emulated.fwd_calls[-1]["scale"] == (abs(scale) or 1.0)
        torch.testing.assert_close(out, attention_reference(q, kv, idx, kv_lengths=lengths, scale=scale),
                                   rtol=1e-2, atol=1e-2)
    ikbo_fa.attention(q, kv, idx, kv_lengths=lengths)
    assert emulated.fwd_calls[-1]["scale"] == pytest.approx(1 / 8)
    assert len(emulated.builds) == 2  # scale=None and an explicit scale
    with pytest.raises(TypeError, match="scale must be"):  # checked on the cached plan too
        ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, scale=float("inf"))
    assert len(emulated.builds) == 2


def test_gpu_path_signature_changes_rebuild_and_recheck(emulated):
    q, kv, idx, _ = _gpu_path_problem(25, "kv", 6, 2)
    ikbo_fa.attention(q, kv, idx)
    ikbo_fa.attention(q, kv, idx)
    assert len(emulated.builds) == 1
    ikbo_fa.attention(q[:5], kv, idx[:5])
    assert len(emulated.builds) == 2
    with pytest.raises(TypeError, match="k is"):
        ikbo_fa.attention(q, (kv[0].half(), kv[1]), idx)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        ikbo_fa.attention(q.float(), (kv[0].float(), kv[1].float()), idx)
    with pytest.raises(ValueError, match="head dimension D = 32"):
        ikbo_fa.attention(q[..., :32], (kv[0][..., :32], kv[1][..., :32]), idx)
    with pytest.raises(ValueError, match="out must be contiguous"):
        ikbo_fa.attention(q, kv, idx, out=torch.empty(6, 64, 2, 3, dtype=torch.bfloat16).transpose(1, 3))
    with pytest.raises(TypeError, match="kv must be"):
        ikbo_fa.attention(q, (kv[0], kv[1], kv[1]), idx)
    with pytest.raises(ValueError, match="broadcast"):
        ikbo_fa.attention(q, kv, idx, broadcast=["kv"])
    # Strided q (a TMA-unfriendly layout) is copied; the result is unchanged.
    wide = torch.randn(6, 3, 2, 68, dtype=torch.bfloat16)  # rows of 136 bytes
    wide[..., :64] = q
    out = ikbo_fa.attention(wide[..., :64], kv, idx)
    assert emulated.fwd_calls[-1]["q"].is_contiguous()
    torch.testing.assert_close(out, attention_reference(q, kv, idx), rtol=1e-2, atol=1e-2)


def test_gpu_path_out_alignment_overlap_and_grad(emulated):
    q, kv, idx, _ = _gpu_path_problem(5, "kv", B=6, U=2)
    expected = ikbo_fa.attention(q, kv, idx)
    out = torch.full((q.numel() + 1,), float("nan"), dtype=q.dtype)[1:].view(q.shape)
    assert out.data_ptr() % 16
    assert ikbo_fa.attention(q, kv, idx, out=out) is out
    assert emulated.fwd_calls[-1]["out"].data_ptr() % 16 == 0  # the kernel stores to an aligned copy
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="out overlaps q in memory"):
        ikbo_fa.attention(q, kv, idx, out=q)
    q.requires_grad_(True)
    res = ikbo_fa.attention(q, kv, idx)
    assert res.requires_grad and torch.equal(res.detach(), expected)
    with pytest.raises(RuntimeError, match="ikbo_fa.attention has no backward.*attention_reference"):
        res.float().sum().backward()


@pytest.mark.parametrize("return_lse", [False, True])
def test_gpu_path_out_view_with_grad_keeps_the_gradient_honest(emulated, return_lse):
    """out= a view of a buffer while q requires grad: a loss read through the buffer raises
    (naming the reference) instead of silently missing the attention term."""
    q, kv, idx, _ = _gpu_path_problem(29, "kv", B=6, U=2)
    expected = ikbo_fa.attention(q, kv, idx)
    buf = torch.full((2, *q.shape), float("nan"), dtype=q.dtype)
    q.requires_grad_(True)
    res = ikbo_fa.attention(q, kv, idx, out=buf[1], return_lse=return_lse)
    assert (res[0] if return_lse else res).data_ptr() == buf[1].data_ptr() and torch.equal(buf[1], expected)
    assert buf.requires_grad
    with pytest.raises(RuntimeError, match="ikbo_fa.attention has no backward"):
        buf.float().sum().backward()


def test_gpu_path_size1_dims_with_any_stride(emulated):
    """torch calls a tensor contiguous whatever the strides of its size-1 dims (movedim and
    empty_like make odd ones): the kernel still gets strides a TMA descriptor takes."""
    q, kv, idx, _ = _gpu_path_problem(27, "kv", 6, 2, S_q=1)
    odd_q = q.permute(0, 2, 3, 1).clone(memory_format=torch.contiguous_format).movedim(3, 1)
    assert odd_q.is_contiguous() and odd_q.stride(1) == 1  # S_q = 1 with a stride of one element
    out = torch.empty_like(odd_q)  # keeps that stride
    k1 = kv[0][:, :, :1].permute(0, 1, 3, 2).clone(memory_format=torch.contiguous_format).movedim(3, 2)
    assert k1.is_contiguous() and k1.stride(2) == 1  # H_kv = 1 with a stride of one element
    assert ikbo_fa.attention(odd_q, (k1, k1), idx, out=out) is out
    assert emulated.fwd_calls[-1]["out"].data_ptr() == out.data_ptr()  # a view of out, no copy
    torch.testing.assert_close(out, attention_reference(q, (k1, k1), idx), rtol=1e-2, atol=1e-2)


def test_gpu_path_out_written_in_place_as_torch_would(emulated):
    """The kernel writes out through its pointer: out's version counter still moves (a backward
    that saved out raises), and out is refused where torch refuses an in-place write."""
    q, kv, idx, _ = _gpu_path_problem(28, "kv", B=6, U=2)
    out = torch.zeros_like(q)
    x = torch.ones_like(q, requires_grad=True)
    y = x * out  # saves out for backward
    assert ikbo_fa.attention(q, kv, idx, out=out) is out
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()
    with pytest.raises(RuntimeError, match="out is a leaf tensor that requires grad"):
        ikbo_fa.attention(q, kv, idx, out=torch.zeros_like(q, requires_grad=True))
    with torch.inference_mode():
        inference_out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="out is an inference tensor"):
        ikbo_fa.attention(q, kv, idx, out=inference_out)


def test_gpu_path_large_sq_chunks(emulated):
    q, kv, idx, lengths = _gpu_path_problem(26, "kv", 5, 2, S_q=130, L=7, jagged=True)
    out, lse = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, return_lse=True)
    ref, ref_lse = attention_reference(q, kv, idx, kv_lengths=lengths, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    plan = next(iter(attention_mod._plans.values()))
    assert plan.chunks == 2 and plan.cands_per_tile == 1 and plan.config.s_q == 130


# ------------------------------------------------------------- work-list kernel compile
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_worklist_kernel_compiles_for_sm90a(idx_dtype):
    from ikbo_fa.worklist_sm90 import compile_worklist

    ck = compile_worklist(idx_dtype, keep_ptx=True, ptxas_report=True)
    for instr in ("match.any.sync", "atom.shared.add", "bar.sync", "griddepcontrol.launch_dependents"):
        assert instr in ck.ptx, instr
    assert ck.spill_bytes == 0, ck.ptxas_log
