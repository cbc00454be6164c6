"""CPU tests of ikbo_fa: the reference against float64 attention on materialized tensors,
argument validation, and the GPU path's host side with the kernels emulated (scale, index and
length conversions, launch plans). The contract attention shares with lce is in
test_op_contract_cpu.py, the work list in test_worklist_cpu.py, the compiles in
test_compile_sm90a_cpu.py."""
import dataclasses
import math

import pytest
import torch

import ikbo_fa
from attention_emulation import attention_mod, install
from attention_inputs import assert_nan_rows_only, materialize, random_jagged_problem, random_problem
from ikbo_fa import DEFAULT_POLICY, AttentionPolicy
from ikbo_fa.config import MAX_PREFETCH_BLOCKS, MAX_SPLITS, WHOLE_ROW
from ikbo_fa.reference import attention_reference, naive_attention

# The split rule alone (no split_by_cost): split only where the tiles leave half the SMs idle.
RULE = AttentionPolicy(split_by_cost=False)


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
    q, kv, k, v, idx, lengths = _problem(4, direction="kv", B=9, U=2, S_q=3, H=2, H_kv=2, D=64, L=6,
                                         dtype=torch.bfloat16)
    out = torch.full((9, 3, 2, 64), float("nan"), dtype=torch.bfloat16)
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
    q, kv, k, v, idx, _ = _problem(7, direction=direction, B=8, U=3, S_q=2, H=2, H_kv=1, D=64, L=5,
                                   dtype=torch.float16)
    idx[2] = 3
    idx[5] = -1
    side = "the batch of k and v" if direction == "kv" else "the batch of q"
    message = rf"^idx\[2\] = 3 is out of range: values must lie in \[0, U\) = \[0, 3\), U being {side}$"
    with pytest.raises(IndexError, match=message):
        attention_reference(q, kv, idx, validate=True)
    with pytest.raises(IndexError, match=message):
        ikbo_fa.attention(q, kv, idx, validate=True)
    out, lse = attention_reference(q, kv, idx, validate=False, return_lse=True)
    bad = torch.zeros(8, dtype=torch.bool)
    bad[[2, 5]] = True
    assert_nan_rows_only(out, lse, bad)
    good = idx.clone()
    good[bad] = 0
    ref = attention_reference(q, kv, good)
    torch.testing.assert_close(out[~bad], ref[~bad], rtol=0, atol=0)


@pytest.mark.parametrize("f", [ikbo_fa.attention, attention_reference], ids=["op", "reference"])
def test_validation_errors(f):
    q, kv, k, v, idx, _ = _problem(8, direction="kv", B=6, U=2, S_q=2, H=2, H_kv=1, D=64, L=5,
                                   dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q must be"):
        f(q.to(torch.int32), kv, idx)
    with pytest.raises(TypeError, match="k is"):
        f(q, (k.half(), v), idx)
    with pytest.raises(TypeError, match="idx must be"):
        f(q, kv, idx.float())
    with pytest.raises(TypeError, match="idx must be"):
        f(q, kv, [0, 1])
    with pytest.raises(ValueError, match=r"^q must have 4 dimensions \[batch, S_q, H, D\], got shape \[2, 2, 64\]$"):
        f(q[0], kv, idx)
    with pytest.raises(ValueError, match=r"^idx must have 1 dimension \[B\], got shape \[1, 6\]$"):
        f(q, kv, idx[None])
    with pytest.raises(ValueError, match="idx has length 5"):
        f(q, kv, idx[:5])
    with pytest.raises(ValueError, match="not a multiple"):
        f(q[:, :, :1].expand(6, 2, 3, 64).contiguous(), (k.expand(2, 5, 2, 64), v.expand(2, 5, 2, 64)), idx)
    with pytest.raises(ValueError, match="k/v head dimension 32 differs from q's 64"):
        f(q, (k[..., :32], v[..., :32]), idx)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        f(q, (k, v[:, :4]), idx)
    with pytest.raises(ValueError, match="packed"):
        f(q, torch.randn(2, 5, 3, 1, 64, dtype=torch.bfloat16), idx)
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
        f(q, kv, idx, out=torch.empty(6, 2, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must be"):
        f(q, kv, idx, out=torch.empty(6, 2, 2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="device"):
        f(q, kv, idx.to("meta"))
    # Both sides at batch len(idx): the direction must be named.
    sq = torch.randn(2, 2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="broadcast='kv'"):
        f(sq, (k, v), torch.tensor([1, 0]))
    a = f(sq, (k, v), torch.tensor([1, 0]), broadcast="kv")
    b = f(sq, (k, v), torch.tensor([1, 0]), broadcast="q")
    assert not torch.equal(a, b)


@pytest.mark.parametrize("op", [ikbo_fa.attention, attention_reference], ids=["op", "reference"])
def test_scale_that_is_not_a_finite_real(op):
    """A value that is no real number is a TypeError; inf and NaN are bad values (ValueError)."""
    q, kv, k, v, idx, _ = _problem(31, direction="kv", B=6, U=2, S_q=2, H=2, H_kv=1, D=64, L=5,
                                   dtype=torch.bfloat16)
    for bad in (float("nan"), float("inf"), -float("inf"), 10**400):
        with pytest.raises(ValueError, match=r"^scale must be finite, got "):
            op(q, kv, idx, scale=bad)
    for bad in (True, "0.1", 1j, [0.1]):
        with pytest.raises(TypeError, match=r"^scale must be a float or None, got "):
            op(q, kv, idx, scale=bad)


def test_op_takes_only_what_the_kernel_takes():
    """On the CPU as on the GPU the op takes fp16 / bf16 and D in {64, 128}; the reference also
    takes float32 and any D."""
    q, kv, k, v, idx, lengths = _problem(32, direction="kv", B=7, U=3, S_q=2, H=2, H_kv=1, D=8, L=5, jagged=True)
    with pytest.raises(TypeError, match="^q must be float16 or bfloat16, got float32$"):
        ikbo_fa.attention(q, kv, idx, kv_lengths=lengths)
    ref, _ = _materialized_truth(q, k, v, idx, "kv", 1 / math.sqrt(8), lengths)
    torch.testing.assert_close(attention_reference(q, kv, idx, kv_lengths=lengths).double(), ref, rtol=1e-5, atol=1e-5)
    half = [t.bfloat16() for t in (q, k, v)]
    with pytest.raises(ValueError, match=r"head dimension D = 8 is not supported .* call ikbo_fa.attention_reference"):
        ikbo_fa.attention(half[0], (half[1], half[2]), idx, kv_lengths=lengths)
    out = attention_reference(half[0], (half[1], half[2]), idx, kv_lengths=lengths)
    assert out.dtype == torch.bfloat16 and float((out.double() - ref).norm() / ref.norm()) < 1e-2
    with pytest.raises(TypeError, match="^q must be float16 or bfloat16 or float32, got float64$"):
        attention_reference(q.double(), (k.double(), v.double()), idx)
    for d in (64, 128):  # the kernel's head dimensions: the op takes them
        q2, kv2, _, _, idx2, _ = _problem(33, direction="kv", B=7, U=3, S_q=2, H=2, H_kv=1, D=d, L=5,
                                          dtype=torch.float16)
        assert torch.equal(ikbo_fa.attention(q2, kv2, idx2), attention_reference(q2, kv2, idx2))


# ------------------------------------------ the GPU path's host side, kernels emulated


@pytest.fixture
def emulated(monkeypatch):
    return install(monkeypatch)


def _gpu_path_problem(seed, direction, B, U, idx_dtype=torch.int32, S_q=3, L=9, jagged=False, packed=False):
    q, kv, k, v, idx, lengths = _problem(seed, direction=direction, B=B, U=U, S_q=S_q, H=2, H_kv=1, D=64, L=L,
                                         dtype=torch.bfloat16, jagged=jagged, packed=packed)
    return q, kv, idx.to(idx_dtype), lengths


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
        for bad in (10**400, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="scale must be finite"):
                op(q, kv, idx, scale=bad)
        for bad in (True, "0.1"):
            with pytest.raises(TypeError, match="scale must be a float or None"):
                op(q, kv, idx, scale=bad)
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(ikbo_fa.attention(q, kv, idx, scale=np.float32(0.25)),
                               attention_reference(q, kv, idx, scale=0.25), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("direction", ["kv", "q"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("use_kernel_worklist", [True, False])
def test_gpu_path_matches_reference_out_of_range_unvalidated(emulated, monkeypatch, direction, idx_dtype,
                                                             use_kernel_worklist):
    policy = AttentionPolicy(worklist_kernel=use_kernel_worklist)
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
        out, lse = ikbo_fa.attention(q, kv, bad_idx, kv_lengths=lengths, return_lse=True, validate=False,
                                     policy=policy)
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
    with pytest.raises(ValueError, match="scale must be finite"):  # checked on the cached plan too
        ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, scale=float("inf"))
    with pytest.raises(TypeError, match="scale must be a float or None"):
        ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, scale="0.5")
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


def test_gpu_path_large_sq_chunks(emulated):
    q, kv, idx, lengths = _gpu_path_problem(26, "kv", 5, 2, S_q=130, L=7, jagged=True)
    out, lse = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, return_lse=True)
    ref, ref_lse = attention_reference(q, kv, idx, kv_lengths=lengths, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    plan = attention_mod.launch_plan(q, kv, idx, kv_lengths=lengths, return_lse=True)
    assert plan.rows_per_cand == 130 and plan.config.s_q == 130


@pytest.mark.parametrize("direction", ["kv", "q"])
@pytest.mark.parametrize("offsets_dtype, packed, validate", [(torch.int32, False, True), (torch.int64, True, False)])
def test_gpu_path_jagged(emulated, direction, offsets_dtype, packed, validate):
    """Jagged K/V reach the kernel as one packed batch row with int32 offsets and the length hint."""
    B, U = 11, 4
    lengths = [0, 5, 1, 9] if direction == "kv" else [3, 0, 7, 1, 2, 9, 4, 1, 1, 5, 6]
    q, kv, k, v, idx, offsets = random_jagged_problem(41, direction, B, U, 3, 2, 1, 64, lengths, torch.bfloat16,
                                                      packed=packed, offsets_dtype=offsets_dtype)
    out, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, max_kv_len=9, return_lse=True, validate=validate)
    ref, ref_lse = attention_reference(q, kv, idx, kv_offsets=offsets, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    call = emulated.fwd_calls[-1]
    assert call["k"].shape == (1, sum(lengths), 1, 64) and call["max_keys"] == 9
    assert call["offsets"].dtype == torch.int32
    if offsets_dtype == torch.int32:
        assert call["offsets"] is offsets  # used as given: the kernel clamps


def test_gpu_path_jagged_without_keys(emulated):
    """Jagged K/V with no key row at all: no launch, outputs 0 and log-sum-exp -inf."""
    q = torch.randn(3, 2, 2, 64).bfloat16()
    k = torch.empty(0, 1, 64, dtype=torch.bfloat16)
    out, lse = ikbo_fa.attention(q, (k, k), torch.tensor([0, 1, 0]), kv_offsets=torch.tensor([0, 0, 0]),
                                 return_lse=True)
    assert not emulated.fwd_calls and (out == 0).all() and torch.isneginf(lse).all()


# ------------------------------------------ split-KV: a row's keys over several CTAs


def test_kv_splits_fill_idle_sms_only():
    """The rule without split_by_cost: split only where the tiles leave half the SMs idle."""
    assert attention_mod.kv_splits(32, 2, 8192, 132, RULE) == (2, 4096)  # S_q 1, ratio 64: 64 tiles
    assert DEFAULT_POLICY.split_min_keys == 512
    assert attention_mod.kv_splits(4, 2, 1500, 132, RULE) == (2, 768)  # at least 512 keys a split
    assert attention_mod.kv_splits(4, 2, 8192, 132, RULE) == (8, 1024)
    assert attention_mod.kv_splits(2, 1, 1000 * 1000, 132, RULE) == (8, 125056)  # at most 8 splits
    assert attention_mod.kv_splits(32, 2, 1000, 132, RULE) == (1, 0)  # too few keys
    assert attention_mod.kv_splits(40, 2, 8192, 132, RULE) == (1, 0)  # more than half the SMs busy


@pytest.mark.parametrize("blocks", [0, 2, 32])
def test_gpu_path_prefetch_by_kv_layout(emulated, blocks):
    """What the kernel is asked to prefetch into L2 (each row's first blocks, this many a CTA): KV
    broadcast policy.prefetch_blocks, over histories of their own lengths whose K and V take at
    most policy.prefetch_kv_bytes the most (MAX_PREFETCH_BLOCKS); Q broadcast none."""
    policy = AttentionPolicy(prefetch_blocks=blocks)
    q, kv, idx, lengths = _gpu_path_problem(50, "kv", 9, 3, jagged=True)
    torch.testing.assert_close(ikbo_fa.attention(q, kv, idx, policy=policy), attention_reference(q, kv, idx),
                               rtol=1e-2, atol=1e-2)
    assert emulated.fwd_calls[-1]["prefetch_blocks"] == blocks
    kv_bytes = sum(t.numel() * t.element_size() for t in kv)
    for cap, want in ((kv_bytes, MAX_PREFETCH_BLOCKS), (kv_bytes - 1, blocks), (0, blocks)):
        capped = AttentionPolicy(prefetch_blocks=blocks, prefetch_kv_bytes=cap)
        ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, policy=capped)
        assert emulated.fwd_calls[-1]["prefetch_blocks"] == want, cap
    k = torch.randn(9, 1, 64).bfloat16()
    offsets = torch.tensor([0, 4, 4, 9])
    ikbo_fa.attention(q, (k, k.clone()), idx, kv_offsets=offsets, policy=policy)
    assert emulated.fwd_calls[-1]["prefetch_blocks"] == MAX_PREFETCH_BLOCKS  # 2 x 9 x 64 x 2 bytes
    q, kv, idx, _ = _gpu_path_problem(51, "q", 9, 3)
    ikbo_fa.attention(q, kv, idx, policy=policy)
    assert emulated.fwd_calls[-1]["prefetch_blocks"] == 0


def test_kv_splits_by_cost():
    """policy.split_by_cost: the split count of least split_cost (S_q 1, 4 and 64 at B 2048, ratio 64)."""
    policy = AttentionPolicy(split_by_cost=True, tile_blocks=1, pair_merge_blocks=1, merge_blocks=2)  # unit costs
    cost = attention_mod.split_cost
    # 160 tiles, 64 key blocks: one split takes two rounds of 65 blocks, four splits five of 17
    assert cost(160, 8192, 132, 1, policy) == 2 * (64 + 1) and cost(160, 8192, 132, 4, policy) == 5 * (16 + 1) + 2
    assert cost(160, 1024, 132, 4, policy) == float("inf")  # splits of 256 keys
    # the cost constants are the policy's: a dearer merge launch, a dearer tile
    assert cost(160, 8192, 132, 4, AttentionPolicy(tile_blocks=1, merge_blocks=9)) == 5 * (16 + 1) + 9
    assert cost(160, 8192, 132, 2, AttentionPolicy(tile_blocks=3, pair_merge_blocks=4)) == 3 * (32 + 3) + 4
    assert attention_mod.kv_splits(80, 2, 8192, 132, policy) == (4, 2048)
    assert attention_mod.kv_splits(32, 2, 1024, 132, policy) == (2, 512)  # the split pair, as without it
    assert attention_mod.kv_splits(1040, 2, 8192, 132, policy) == (1, 0)  # full rounds: no split
    assert attention_mod.kv_splits(80, 2, 8192, 132, AttentionPolicy(split_kv=False)) == (1, 0)


def test_default_split_costs():
    """DEFAULT_POLICY splits by cost with the H100-fitted costs (B 2048, ratio 64, H 2 unless said):
    as the half-idle rule at S_q 1 and 2 and at L 1024; at L 8192 S_q 4 four ways and S_q 8 and 16
    in pairs; eight users of 16,384 keys (B 4096, H 4) eight ways; the published shape not at all."""
    assert DEFAULT_POLICY.split_by_cost
    rule = AttentionPolicy(split_by_cost=False)
    splits = lambda batch, users, s_q, heads, keys, policy=DEFAULT_POLICY: attention_mod.problem_splits(
        batch, users, s_q, heads, keys, 132, policy)[0]
    for keys in (1024, 8192):
        for s_q in (1, 2):
            assert splits(2048, 32, s_q, 2, keys) == splits(2048, 32, s_q, 2, keys, rule)
    assert [splits(2048, 32, s_q, 2, 1024) for s_q in (1, 2, 4, 8, 64)] == [2, 1, 1, 1, 1]
    assert [splits(2048, 32, s_q, 2, 8192) for s_q in (4, 8, 16, 64)] == [4, 2, 2, 1]
    assert splits(4096, 8, 1, 4, 16384) == 8 and splits(4096, 8, 1, 4, 16384, rule) == 1
    assert all(splits(2048, 32, 64, 2, keys) == 1 for keys in (512, 1024, 2048))


def test_uneven_split_cost():
    """Rows of uneven length: the mean over the SMs of every piece, or the longest piece, plus
    the merge; a row shorter than a piece stays one piece."""
    policy = AttentionPolicy(tile_blocks=1, pair_merge_blocks=1, merge_blocks=2)
    cost = attention_mod.uneven_split_cost
    # 64 tiles over 32 rows of 4,096 keys on average (8,192 at most): the longest piece bounds it
    assert cost(64, 32, 32 * 4096, 8192, 132, 1, policy) == 64 + 1
    assert cost(64, 32, 32 * 4096, 8192, 132, 4, policy) == 16 + 1 + 2
    # 1,056 tiles: the mean bounds it (two tiles a row, 2 * 32 blocks each, plus a piece's cost)
    mean = (1056 / 32 * 32 * 4096 / 128 + 1056 / 32 * (32 + 32 * 4096 / 8192) * 1) / 132
    assert cost(1056, 32, 32 * 4096, 8192, 132, 1, policy) == pytest.approx(mean)
    assert cost(64, 32, 32 * 4096, 1024, 132, 4, policy) == float("inf")  # splits of 256 keys


def test_splits_of_jagged_rows_under_the_static_walk():
    """Jagged K/V (the rows' total keys given), static walk: the fewer of the count split_cost takes
    for rows of max_kv_len keys and the count of least uneven_split_cost; the seven shapes timed on
    the H100."""
    static = AttentionPolicy(dynamic_walk=False)
    splits = lambda batch, users, s_q, heads, keys, total, policy=static: attention_mod.problem_splits(
        batch, users, s_q, heads, keys, 132, policy, total)[0]
    old = AttentionPolicy(split_by_total_keys=False, dynamic_walk=False)
    assert DEFAULT_POLICY.split_by_total_keys
    uniform, lognormal = 129159, 58843  # 32 rows of up to 8,192 keys
    assert [splits(2048, 32, s_q, 2, 8192, uniform) for s_q in (1, 4, 16)] == [2, 2, 1]
    assert [splits(2048, 32, s_q, 2, 8192, uniform, old) for s_q in (1, 4, 16)] == [2, 4, 2]
    assert [splits(2048, 32, s_q, 2, 8192, lognormal) for s_q in (1, 16)] == [2, 1]
    assert splits(4096, 8, 1, 4, 32768, 43579) == 6 and splits(4096, 8, 1, 4, 32768, 43579, old) == 8
    assert splits(10400, 8, 1, 6, 32768, 43579) == 1
    # rows all max_kv_len long, or no total given: as padded rows
    assert splits(2048, 32, 4, 2, 8192, 32 * 8192) == splits(2048, 32, 4, 2, 8192, None) == 4


def test_default_splits_of_jagged_rows():
    """Jagged K/V under the dynamic walk: the count of least uneven_split_cost alone, never a split
    pair (its walk is static); rows all max_kv_len long, or no total given: as padded rows."""
    problem_splits = lambda batch, users, s_q, heads, keys, total: attention_mod.problem_splits(
        batch, users, s_q, heads, keys, 132, DEFAULT_POLICY, total)
    assert DEFAULT_POLICY.dynamic_walk
    lognormal = 58843  # 32 rows of up to 8,192 keys
    for s_q in (1, 2, 4, 8, 16, 64):
        n, per, pair = problem_splits(2048, 32, s_q, 2, 8192, lognormal)
        tiles = (-(-2048 * s_q // 128) + attention_mod.max_tiles_per_head(2048, 32, s_q)) // 2
        costs = [attention_mod.uneven_split_cost(tiles * 2, 32, lognormal, 8192, 132, m,
                                                 AttentionPolicy(split_pair=False)) for m in range(1, 9)]
        assert n == 1 + costs.index(min(costs)) and not pair
        assert per == (0 if n == 1 else -(-8192 // (n * 128)) * 128)
    assert [problem_splits(2048, 32, s_q, 2, 8192, lognormal)[0] for s_q in (1, 4, 16)] == [8, 4, 1]
    assert problem_splits(2048, 32, 1, 2, 1024, 16156)[0] == 1  # L 1024: no split
    assert problem_splits(2048, 32, 1, 2, 8192, 32 * 8192) == problem_splits(2048, 32, 1, 2, 8192, None) == (
        2, 4096, True)


@pytest.mark.parametrize("n_splits", [2, 3])
def test_merge_splits_is_attention_over_all_keys(n_splits):
    """Partial (out, lse) over key ranges merge into attention over all keys; a row with no key
    in a range, or in any, and a NaN row come out as the reference has them."""
    g = torch.Generator().manual_seed(40 + n_splits)
    B, S, H, D, L = 5, 3, 2, 8, 12
    q, k, v = (torch.randn(B, n, H, D, generator=g) for n in (S, L, L))
    lengths = torch.tensor([12, 7, 0, 1, 12])
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), 0.3, lengths)
    per = -(-L // n_splits)
    parts = [naive_attention(q, k[:, i * per:(i + 1) * per], v[:, i * per:(i + 1) * per], 0.3,
                             (lengths - i * per).clamp(0, per)) for i in range(n_splits)]
    ws_o = torch.cat([o for o, _ in parts], dim=2).bfloat16()
    ws_lse = torch.cat([lse for _, lse in parts], dim=1)
    ws_o[4, :, H - 1::H] = float("nan")  # row 4, head H - 1, in every split
    ws_lse[4, H - 1::H] = float("nan")
    ws_o[2] = float("nan")  # no key: the outputs of splits of lse -inf are not read
    out, lse = torch.full((B, S, H, D), 7.0, dtype=torch.bfloat16), torch.full((B, H, S), 7.0)
    attention_mod.merge_splits(ws_o, ws_lse, n_splits, out, lse)
    ok = torch.ones(B, dtype=torch.bool)
    ok[4] = False
    torch.testing.assert_close(out[ok].double(), ref[ok], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[ok].double(), ref_lse[ok], rtol=1e-5, atol=1e-5)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    assert out[4, :, H - 1].isnan().all() and not out[4, :, 0].isnan().any()
    # A row whose split-0 lse holds WHOLE_ROW was written by the attention kernel: left alone.
    ws_lse.view(torch.int32)[1, 0, 2] = WHOLE_ROW  # row 1, head 0, query 2
    kept = out.clone(), lse.clone()
    out[1, 2, 0], lse[1, 0, 2] = 5.0, 5.0
    attention_mod.merge_splits(ws_o, ws_lse, n_splits, out, lse)
    assert (out[1, 2, 0] == 5.0).all() and lse[1, 0, 2] == 5.0
    out[1, 2, 0], lse[1, 0, 2] = kept[0][1, 2, 0], kept[1][1, 0, 2]
    torch.testing.assert_close(out, kept[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, kept[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("lengths_kind", ["none", "kv_lengths", "jagged"])
def test_gpu_path_splits_keys_where_tiles_are_few(emulated, monkeypatch, lengths_kind):
    """B 256 at ratio 64, S_q 1, L 2048, with splits of at least 512 keys: 4 users, a few
    tiles, so each row's keys go over 4 CTAs; the merged result is the reference's, and
    without splitting the same."""
    policy = AttentionPolicy(split_min_keys=512, split_by_cost=False)
    B, U, L = 256, 4, 2048
    q, kv, idx, lengths = _gpu_path_problem(41, "kv", B, U, S_q=1, L=L, jagged=lengths_kind == "jagged")
    kw = {}
    if lengths_kind == "kv_lengths":
        kw["kv_lengths"] = torch.tensor([L, 1, 0, 1300], dtype=torch.int32)
    elif lengths_kind == "jagged":
        lens = torch.tensor([L, 1, 0, 1300])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        g = torch.Generator().manual_seed(42)
        kv = tuple(torch.randn(int(offsets[-1]), 1, 64, generator=g).bfloat16() for _ in range(2))
        kw.update(kv_offsets=offsets, max_kv_len=L)
    out, lse = ikbo_fa.attention(q, kv, idx, return_lse=True, policy=policy, **kw)
    call = emulated.fwd_calls[-1]
    assert call["n_splits"] == 4 and call["split_keys"] == 512 and call["out"].shape[2] == 4 * 2
    assert emulated.merge_calls == 1
    ref, ref_lse = attention_reference(q, kv, idx, return_lse=True, **kw)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    # Rows of one split (1 and 0 keys) go to out directly where the histories have lengths.
    assert call["whole_rows_out"] == (lengths_kind != "none")
    whole = ikbo_fa.attention(q, kv, idx, policy=AttentionPolicy(split_kv=False), **kw)
    assert emulated.fwd_calls[-1]["n_splits"] == 1
    torch.testing.assert_close(out, whole, rtol=2e-2, atol=2e-2)
    for p in (policy, dataclasses.replace(policy, whole_rows_out=False)):  # without lse; through the merge
        torch.testing.assert_close(ikbo_fa.attention(q, kv, idx, policy=p, **kw), out, rtol=0, atol=0)


def test_a_policy_change_builds_a_new_plan(emulated, monkeypatch):
    """A policy reaches the compile key (split_pair: two splits in a cluster or through the
    workspace); another policy builds a new plan instead of reusing the old one."""
    pair, no_pair = RULE, AttentionPolicy(split_by_cost=False, split_pair=False)
    configs = []
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: configs.append(cfg) or emulated.fwd_for(cfg))
    q, kv, idx, _ = _gpu_path_problem(44, "kv", 2048, 32, S_q=1, L=1024)  # two splits of 512 keys
    first = ikbo_fa.attention(q, kv, idx, policy=pair)
    again = ikbo_fa.attention(q, kv, idx, policy=no_pair)
    assert len(emulated.builds) == 2 and len(attention_mod._plans) == 2
    assert [(c.split_pair, c.split_kv) for c in configs] == [(True, False), (False, True)]
    torch.testing.assert_close(first, again, rtol=2e-2, atol=2e-2)
    ikbo_fa.attention(q, kv, idx, policy=AttentionPolicy.parse("split_by_cost=0"))  # equal to pair
    assert len(emulated.builds) == 2 and len(attention_mod._plans) == 2  # an equal policy: the plan is reused
    ikbo_fa.attention(q, kv, idx)  # DEFAULT_POLICY (split by cost): a plan of its own, two splits in a pair too
    assert len(emulated.builds) == 3 and len(attention_mod._plans) == 3
    assert [(c.split_pair, c.split_kv) for c in configs[2:]] == [(True, False)]
    assert attention_mod.launch_plan(q, kv, idx, policy=no_pair).policy == no_pair


def test_policy_parse_and_checks():
    assert AttentionPolicy.parse("") == DEFAULT_POLICY
    p = AttentionPolicy.parse(" split_pair=0, prefetch_blocks=4,worklist_kernel=TRUE")
    assert p == AttentionPolicy(split_pair=False, prefetch_blocks=4) and p.spec() == "split_pair=0,prefetch_blocks=4"
    assert AttentionPolicy.parse(p.spec()) == p and DEFAULT_POLICY.spec() == ""
    with pytest.raises(ValueError, match="split_kv, split_min_keys"):  # lists the fields
        AttentionPolicy.parse("_SPLIT_PAIR=0")
    for bad, match in (("split_pair", "not NAME=VALUE"), ("split_pair=yes", "takes 0, 1, true or false"),
                       ("split_min_keys=1k", "takes an integer"), ("prefetch_blocks=33", "at most 32"),
                       ("merge_blocks=-1", "must be >= 0"), ("split_min_keys=0", "must be >= 1")):
        with pytest.raises(ValueError, match=match):
            AttentionPolicy.parse(bad)
    for bad in (dict(split_pair=1), dict(prefetch_blocks=True), dict(split_min_keys=512.0)):
        with pytest.raises(TypeError, match=f"AttentionPolicy.{next(iter(bad))} must be"):
            AttentionPolicy(**bad)
    q, kv, idx, _ = _gpu_path_problem(45, "kv", 6, 2)
    for op in (ikbo_fa.attention, ikbo_fa.work_list):
        args = (q, kv, idx) if op is ikbo_fa.attention else (idx, 2)
        with pytest.raises(TypeError, match="policy must be an ikbo_fa.AttentionPolicy"):
            op(*args, policy={"split_pair": False})
    torch.testing.assert_close(attention_reference(q, kv, idx, policy=DEFAULT_POLICY), attention_reference(q, kv, idx))


@pytest.mark.parametrize("lengths_kind", ["none", "kv_lengths", "jagged"])
@pytest.mark.parametrize("return_lse", [True, False])
def test_split_pair_where_two_splits(emulated, monkeypatch, lengths_kind, return_lse):
    """policy.split_pair: where a problem splits in two, the kernel takes both splits in a cluster
    (split_pair) and writes out and lse itself: no workspace, no merge launch, an even grid of at
    most two CTAs per resident cluster; where it splits in more, the workspace path stays."""
    # the static walk: under the dynamic one jagged rows split without pairs
    policy = AttentionPolicy(split_min_keys=512, split_pair=True, dynamic_walk=False)
    configs = []
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: configs.append(cfg) or emulated.fwd_for(cfg))
    B, U, L = 2048, 32, 1024  # 64 (user, head) tiles on 132 SMs: two splits of 512 keys
    q, kv, idx, _ = _gpu_path_problem(43, "kv", B, U, S_q=1, L=L)
    kw = {}
    if lengths_kind == "kv_lengths":
        kw["kv_lengths"] = torch.randint(0, L + 1, (U,), dtype=torch.int32)
    elif lengths_kind == "jagged":
        lens = torch.randint(0, L + 1, (U,))
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        g = torch.Generator().manual_seed(42)
        kv = tuple(torch.randn(int(offsets[-1]), 1, 64, generator=g).bfloat16() for _ in range(2))
        kw.update(kv_offsets=offsets, max_kv_len=L)
    res = ikbo_fa.attention(q, kv, idx, return_lse=return_lse, policy=policy, **kw)
    (cfg,), call = configs, emulated.fwd_calls[-1]
    assert cfg.split_pair and not cfg.split_kv and cfg.return_lse == return_lse
    assert call["n_splits"] == 2 and call["split_keys"] == 512 and call["out"].shape[2] == 2
    assert call["n_ctas"] % 2 == 0 and emulated.merge_calls == 0
    ref = attention_reference(q, kv, idx, return_lse=return_lse, **kw)
    for got, want in zip(res if return_lse else (res,), ref if return_lse else (ref,)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(attention_mod, "max_active_clusters", lambda device, size: 5)
    attention_mod._plans.clear()  # plans hold the grid of the device they were built on
    ikbo_fa.attention(q, kv, idx, return_lse=return_lse, policy=policy, **kw)
    assert emulated.fwd_calls[-1]["n_ctas"] == 10  # as many clusters as can be resident


def test_split_pair_not_past_two_splits(emulated, monkeypatch):
    configs = []
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: configs.append(cfg) or emulated.fwd_for(cfg))
    q, kv, idx, _ = _gpu_path_problem(41, "kv", 256, 4, S_q=1, L=2048)  # four splits
    ikbo_fa.attention(q, kv, idx, policy=AttentionPolicy(split_by_cost=False, split_pair=True))
    assert configs[-1].split_kv and not configs[-1].split_pair and emulated.merge_calls == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_lse", [True, False])
def test_merge_kernel_compiles_for_sm90a(dtype, with_lse):
    from ikbo_fa.merge_sm90 import compile_merge

    ck = compile_merge(dtype, with_lse, keep_ptx=True, ptxas_report=True)
    # 16-byte loads of every split's part, unrolled, and one 16-byte store per thread
    for instr in (".target sm_90a", "griddepcontrol.wait", "ex2.approx", "ld.global.v4", "st.global.v4"):
        assert instr in ck.ptx, instr
    assert ck.ptx.count("ld.global.v4") == MAX_SPLITS
    assert ("lg2.approx" in ck.ptx) == with_lse  # the lse is computed only where it is written
    assert ck.spill_bytes == 0, ck.ptxas_log


@pytest.mark.parametrize("L, dynamic", [(256, False), (257, True)])
def test_dynamic_walk_where_rows_may_be_long(emulated, L, dynamic):
    """Rows of their own lengths run longest first (perm) and their tiles come from the counter
    (AttentionConfig.dynamic_walk) where a row may hold policy.order_min_keys and
    policy.dynamic_min_keys keys or more; shorter rows run in user order with the static walk, as
    padded K/V does; dynamic_walk=False and order_min_keys=0 pick the rest. Results are the
    reference's every way."""
    q, kv, idx, lengths = _gpu_path_problem(44, "kv", 40, 5, S_q=2, L=L, jagged=True)
    lengths = lengths.to(torch.int32)
    for policy, ordered, want in ((None, dynamic, dynamic), (AttentionPolicy(dynamic_walk=False), dynamic, False),
                                  (AttentionPolicy(order_min_keys=0), True, dynamic),
                                  (AttentionPolicy(order_min_keys=0, dynamic_walk=False), True, False)):
        res = ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, policy=policy)
        cfg = attention_mod.launch_plan(q, kv, idx, kv_lengths=lengths, policy=policy).config
        assert cfg.ordered == ordered and cfg.longest_first == ordered and cfg.dynamic_walk == want
        assert (emulated.fwd_calls[-1]["perm"] is not None) == ordered and emulated.fwd_calls[-1]["n_ctas"] >= 1
        torch.testing.assert_close(res, attention_reference(q, kv, idx, kv_lengths=lengths), rtol=2e-2, atol=2e-2)
    assert not attention_mod.launch_plan(q, kv, idx).config.dynamic_walk  # padded, no lengths: not ordered


@pytest.mark.parametrize("max_kv_len, ordered", [(None, True), (256, False), (257, True)])
def test_jagged_rows_in_user_order_where_short(emulated, max_kv_len, ordered):
    """kv_offsets: rows bounded below policy.order_min_keys (by max_kv_len, or by all of K/V)
    run in user order with the work list of padded K/V; a work list given with the call keeps
    its own order (built with kv_offsets: longest first). Results are the reference's."""
    rng = torch.Generator().manual_seed(45)
    U, H, D, B = 6, 2, 64, 50
    lens = torch.randint(1, 257 if max_kv_len is None else max_kv_len + 1, (U,), generator=rng)
    if max_kv_len is not None:
        lens[2] = max_kv_len
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    n = int(offsets[-1])
    if max_kv_len is None:  # all of K/V bounds a row: short only where it holds under 257 keys
        ordered = n >= 257
    q = torch.randn(B, 3, H, D, generator=rng).to(torch.bfloat16)
    kv = torch.randn(n, 2, H, D, generator=rng).to(torch.bfloat16)
    idx = torch.randint(0, U, (B,), generator=rng)
    kw = dict(kv_offsets=offsets, max_kv_len=max_kv_len)
    want = attention_reference(q, kv, idx, **kw)
    cfg = attention_mod.launch_plan(q, kv, idx, **kw).config
    assert cfg.ordered == ordered and cfg.jagged
    out = torch.full_like(want, float("nan"))
    ikbo_fa.attention(q, kv, idx, out=out, **kw)
    assert (emulated.fwd_calls[-1]["perm"] is not None) == ordered
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    wl = ikbo_fa.work_list(idx, U, 3, **kw)
    assert wl.perm is not None and attention_mod.launch_plan(q, kv, idx, work_list=wl, **kw).config.ordered
    out.fill_(float("nan"))
    ikbo_fa.attention(q, kv, idx, out=out, work_list=wl, **kw)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lse_scratch", [False, True])
@pytest.mark.parametrize("B, S_q, H, D, n", [(3, 1, 2, 64, 2), (5, 17, 3, 128, 8), (1, 7, 1, 64, 3)])
def test_split_workspace_is_one_allocation_of_disjoint_parts(B, S_q, H, D, n, lse_scratch):
    """The workspace, and whole_rows_out's unread lse where the caller asks for none, come from one
    allocation: disjoint, of the kernels' shapes, ws_o on a 16-byte boundary."""
    import types

    plan = types.SimpleNamespace(out_shape=(B, S_q, H, D), n_splits=n, dtype=torch.bfloat16, device="cpu")
    ws_o, ws_lse, scratch = attention_mod._split_workspace(plan, lse_scratch)
    assert ws_o.shape == (B, S_q, n * H, D) and ws_o.dtype == torch.bfloat16 and ws_o.is_contiguous()
    assert ws_lse.shape == (B, n * H, S_q) and ws_lse.dtype == torch.float32 and ws_lse.is_contiguous()
    assert (scratch is not None) == lse_scratch
    parts = [ws_lse, ws_o] + ([scratch] if lse_scratch else [])
    if lse_scratch:
        assert scratch.shape == (B, H, S_q) and scratch.dtype == torch.float32 and scratch.is_contiguous()
    base = ws_lse.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in parts)
    assert (ws_o.data_ptr() - base) % 16 == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parts)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_tail_splits_where_the_last_round_is_part_full():
    """policy.tail_split: over padded K/V whose tiles fill whole rounds of the grid and part of one
    more, the last round's tiles split (B 2048, ratio 64, H 2, D 128); not where the tiles fill
    rounds exactly or less than one, not past the workspace budget, not against 192-key blocks at a
    small gain, and never with the policy off."""
    on = AttentionPolicy(tail_split=True)

    def tail(s_q, keys, heads=2, d=128, policy=on, wide=False):
        n, _, pair = attention_mod.problem_splits(2048, 32, s_q, heads, keys, 132, policy)
        return attention_mod.tail_splits(2048, 32, s_q, heads, keys, 132, 2048 * s_q * heads * d * 2, policy,
                                         (n, pair), wide)
    # S_q 16, L 1024: 544 tiles, four rounds and 16 tiles; those split 8 ways, a block each, where
    # the unsplit plan may be replaced (by default only plans that split every row)
    assert tail(16, 1024) == (1, 0)
    every = AttentionPolicy(tail_split=True, tail_split_from=1)
    assert tail(16, 1024, policy=every) == (8, 128)
    assert tail(16, 4096) == (8, 512)  # in place of the split pair
    assert tail(16, 4096, policy=DEFAULT_POLICY) == (8, 512)  # on by default
    cost = attention_mod.tail_split_cost
    assert cost(544, 1024, 132, 8, DEFAULT_POLICY) == 4 * (8 + 2) + 1 * (1 + 2) + DEFAULT_POLICY.tail_merge_blocks
    assert cost(544, 1024, 132, 8, DEFAULT_POLICY) < attention_mod.split_cost(544, 1024, 132, 1, DEFAULT_POLICY)
    assert tail(4, 1024, policy=every) == (4, 256) and tail(4, 1024) == (1, 0)
    assert [tail(s_q, 8192)[0] for s_q in (4, 8, 16, 17)] == [4, 5, 8, 5]  # four splits or pairs before
    assert tail(32, 1024, policy=every) == (1, 0)  # 1,056 tiles: eight whole rounds
    assert tail(1, 1024) == (1, 0) and tail(2, 1024) == (1, 0)  # less than a round: problem_splits decides
    assert tail(64, 2048, policy=every) == (1, 0)  # the published shape: its last round is too full to gain
    assert tail(16, 4096, policy=AttentionPolicy(tail_split=False)) == (1, 0)
    assert tail(16, 4096, policy=AttentionPolicy(tail_split=True, split_kv=False)) == (1, 0)
    # the workspace: every row of out once a split; a budget of four outputs takes four splits
    budget = AttentionPolicy(tail_split=True, tail_split_from=1, tail_split_bytes=4 * 2048 * 16 * 2 * 128 * 2)
    assert tail(16, 1024, policy=budget) == (4, 256)
    assert tail(16, 1024, policy=AttentionPolicy(tail_split=True, tail_split_from=1,
                                                 tail_split_bytes=2048 * 16 * 2 * 128 * 2)) == (1, 0)


def test_tail_split_on_the_gpu_path(emulated, monkeypatch):
    """The op takes the tail split where tail_splits does: a split_kv configuration with
    tail_split and whole_rows_out, the merge launched; the whole rounds' tiles write out directly
    (emulated by the scheduler's host twin); results are the reference's, with and without lse,
    and with out-of-range indices. Rows of their own lengths never take it."""
    configs = []
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: configs.append(cfg) or emulated.fwd_for(cfg))
    policy = AttentionPolicy(tail_split=True, tail_merge_blocks=0, tail_split_from=1, d64_tile_m=128)
    B, U, S_q, L = 300, 3, 64, 300  # 300 tiles of 128 rows over both heads: two rounds of 132 and 36 tiles
    q, kv, idx, _ = _gpu_path_problem(46, "kv", B, U, S_q=S_q, L=L)
    idx[[5, 77]] = torch.tensor([-1, U], dtype=idx.dtype)
    bad = torch.zeros(B, dtype=torch.bool)
    bad[[5, 77]] = True
    for return_lse in (True, False):
        res = ikbo_fa.attention(q, kv, idx, return_lse=return_lse, policy=policy, validate=False)
        cfg, call = configs[-1], emulated.fwd_calls[-1]
        assert cfg.tail_split and cfg.split_kv and cfg.whole_rows_out and call["n_ctas"] == 132
        assert call["n_splits"] == 3 and call["split_keys"] == 128
        ref = attention_reference(q, kv, idx.clamp(0, U - 1), return_lse=return_lse)
        for got, want in zip(res if return_lse else (res,), ref if return_lse else (ref,)):
            assert got[bad].isnan().all()
            torch.testing.assert_close(got[~bad], want[~bad], rtol=2e-2, atol=2e-2)
    assert emulated.merge_calls == 2
    ikbo_fa.attention(q, kv, idx, policy=AttentionPolicy(tail_split=False, tail_split_from=1, d64_tile_m=128),
                      validate=False)
    assert not configs[-1].tail_split and not configs[-1].split_kv
    lengths = torch.randint(0, L + 1, (U,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    ikbo_fa.attention(q, kv, idx, kv_lengths=lengths, policy=policy, validate=False)
    assert not configs[-1].tail_split


@pytest.mark.parametrize("s_q", [1, 4, 17, 64])
def test_192_row_tiles_on_the_gpu_path(emulated, monkeypatch, s_q):
    """192-row tiles (here at any shape: policy.d64_tall_gain 100): D 64 KV broadcast takes tiles of
    192 query rows, the work list (kernel or torch definition) counting them so; padded,
    kv_lengths and jagged K/V, the last round split, out-of-range indices, all as the reference.
    D 128, Q broadcast, a given work list (it counts 128-row tiles) and d64_tile_m 128 keep 128."""
    configs = []
    monkeypatch.setattr(attention_mod, "_fwd_kernel", lambda cfg: configs.append(cfg) or emulated.fwd_for(cfg))
    wide = AttentionPolicy(d64_tall_gain=100)
    B, U, L = 230, 3, 300
    q, kv, idx, _ = _gpu_path_problem(47 + s_q, "kv", B, U, S_q=s_q, L=L)
    idx[[3, 100]] = torch.tensor([-1, U], dtype=idx.dtype)
    bad = torch.zeros(B, dtype=torch.bool)
    bad[[3, 100]] = True
    lengths = torch.randint(0, L + 1, (U,), dtype=torch.int32, generator=torch.Generator().manual_seed(s_q))
    tail = dataclasses.replace(wide, tail_split_from=1, tail_merge_blocks=0, tail_split_tall=True)
    torch_worklist = dataclasses.replace(wide, worklist_kernel=False)
    for policy, kw in ((wide, {}), (wide, dict(kv_lengths=lengths)), (torch_worklist, {}), (tail, {})):
        out, lse = ikbo_fa.attention(q, kv, idx, return_lse=True, policy=policy, validate=False, **kw)
        cfg = configs[-1]
        assert cfg.tile_m == 192 and cfg.key_block == 128 and not cfg.split_pair, cfg
        if policy.worklist_kernel:
            assert emulated.worklist_tile_rows == 192
        ref = attention_reference(q, kv, idx.clamp(0, U - 1), return_lse=True, **kw)
        assert out[bad].isnan().all() and lse[bad].isnan().all()
        torch.testing.assert_close(out[~bad], ref[0][~bad], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse[~bad], ref[1][~bad], rtol=2e-2, atol=2e-2)
    # jagged K/V
    qj, kvj, _, _, idxj, offsets = random_jagged_problem(48 + s_q, "kv", B, U, s_q, 2, 1, 64, [0, 257, 40],
                                                         torch.bfloat16)
    idxj = idxj.to(torch.int32)
    out = ikbo_fa.attention(qj, kvj, idxj, kv_offsets=offsets, policy=wide, validate=False)
    assert configs[-1].tile_m == 192 and configs[-1].jagged
    torch.testing.assert_close(out, attention_reference(qj, kvj, idxj, kv_offsets=offsets), rtol=2e-2, atol=2e-2)
    # a given work list counts 128-row tiles: the call keeps them
    wl = ikbo_fa.work_list(idx.clamp(0, U - 1), U, s_q)
    out = ikbo_fa.attention(q, kv, idx.clamp(0, U - 1), policy=wide, work_list=wl, validate=False)
    assert configs[-1].tile_m == 128
    torch.testing.assert_close(out, attention_reference(q, kv, idx.clamp(0, U - 1)), rtol=2e-2, atol=2e-2)
    q128, kv128, _, _, idx128, _ = _problem(49, direction="kv", B=20, U=2, S_q=s_q, H=2, H_kv=1, D=128, L=40,
                                            dtype=torch.bfloat16)
    ikbo_fa.attention(q128, kv128, idx128, policy=wide, validate=False)
    assert configs[-1].tile_m == 128
    qq, kvq, idxq, _ = _gpu_path_problem(50, "q", 20, 4, S_q=s_q, L=30)
    ikbo_fa.attention(qq, kvq, idxq, policy=wide, validate=False)
    assert configs[-1].tile_m == 128 and configs[-1].direction == "q"
    ikbo_fa.attention(q, kv, idx, policy=AttentionPolicy(d64_tile_m=128), validate=False)
    assert configs[-1].tile_m == 128
    ikbo_fa.attention(q, kv, idx, validate=False)  # the default: by the cost; one round of the grid either way
    assert configs[-1].tile_m == attention_mod.problem_tile_rows(B, U, s_q, 2, 132) == 128


def test_192_row_tiles_where_they_cost_less():
    """192-row tiles where they take fewer rounds of the grid for their rows (B 2048, ratio 64, H 2:
    S_q >= 4), not where both fit one round (S_q 1 to 3: the shorter tiles finish first; one user
    of 4,096 at S_q 1) nor where a user's run fills little of a tile (S_q 64 at ratio 1);
    d64_tile_m 128 turns them off."""
    def pick(b, u, s_q, h=2, policy=DEFAULT_POLICY):
        return attention_mod.problem_tile_rows(b, u, s_q, h, 132, policy)
    assert [pick(2048, 32, s_q) for s_q in (1, 2, 3, 4, 16, 17, 64)] == [128, 128, 128, 192, 192, 192, 192]
    assert pick(2048, 32, 3, h=8) == 192  # four rounds of 128-row tiles, three of 192
    assert pick(4096, 1, 1) == 128 and pick(2048, 2048, 64) == 128 and pick(2048, 2048, 128) == 128
    assert pick(2048, 32, 16, policy=AttentionPolicy(d64_tile_m=128)) == 128
    assert DEFAULT_POLICY.d64_tile_m == 192


def test_192_row_tiles_count_in_the_plan():
    """The split plan counts 192-row tiles, and never pairs their splits."""
    # B 2048, 32 users, S_q 4: the mean of the dense count (43 tiles of 192 rows, 64 of 128) and
    # the bound (a partly filled tile more per user)
    assert attention_mod.mean_tiles_per_head(2048, 32, 4, 192) == (43 + 43 + 33) // 2
    assert attention_mod.mean_tiles_per_head(2048, 32, 4) == (64 + 64 + 33) // 2
    on = DEFAULT_POLICY
    # B 512, 8,192 keys: both split two ways, 192-row tiles over a workspace (never a split pair)
    assert attention_mod.problem_splits(512, 32, 4, 2, 8192, 132, on, None, 192) == (2, 4096, False)
    assert attention_mod.problem_splits(512, 32, 4, 2, 8192, 132, on) == (2, 4096, True)
    # B 2048: 59 tiles of 192 rows a head fill one round of the grid, unsplit; 80 of 128 split
    assert attention_mod.problem_splits(2048, 32, 4, 2, 8192, 132, on, None, 192) == (1, 0, False)
    assert attention_mod.problem_splits(2048, 32, 4, 2, 8192, 132, on)[0] == 4
    # the last round's split on 192-row tiles with tail_split_tall, on by default (B 2000, 20
    # users, S_q 16, 4,096 keys: 354 tiles, two rounds and 90)
    tall = AttentionPolicy(tail_split_from=1, tail_merge_blocks=0)
    args = (2000, 20, 16, 2, 4096, 132, 2000 * 16 * 2 * 64 * 2)
    assert attention_mod.tail_splits(*args, tall, (1, False), False, 192) == (4, 1024)
    assert attention_mod.tail_splits(*args, dataclasses.replace(tall, tail_split_tall=False), (1, False), False,
                                     192) == (1, 0)
