"""CPU tests of ikbo_fa: the reference against float64 attention on materialized
tensors, argument validation, and sm_90a compiles of every shipped kernel configuration."""
import importlib
import math

import pytest
import torch

import ikbo_fa
attention_mod = importlib.import_module("ikbo_fa.attention")  # the module, not the function
from ikbo_fa.reference import attention_reference, naive_attention
from ikbo_fa.worklist import kv_worklist, max_tiles_per_head


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


def _problem(seed, *, direction, B, U, S_q, H, H_kv, D, L, dtype=torch.float32, packed=False,
             jagged=False, sort=False):
    g = _gen(seed)
    idx = torch.randint(0, U, (B,), generator=g)
    idx[torch.randperm(B, generator=g)[: min(B, U)]] = torch.arange(min(B, U))  # every user appears
    if sort:
        idx = idx.sort().values
    n_q, n_kv = (B, U) if direction == "kv" else (U, B)
    q = torch.randn(n_q, S_q, H, D, generator=g).to(dtype)
    if packed:
        kv = torch.randn(n_kv, L, 2, H_kv, D, generator=g).to(dtype)
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        k = torch.randn(n_kv, L, H_kv, D, generator=g).to(dtype)
        v = torch.randn(n_kv, L, H_kv, D, generator=g).to(dtype)
        kv = (k, v)
    lengths = None
    if jagged:
        lengths = torch.randint(0, L + 1, (n_kv,), generator=g)
        lengths[0] = 0
        lengths[-1] = L
    return q, kv, k, v, idx.to(torch.int32), lengths


def _materialized_truth(q, k, v, idx, direction, scale, lengths):
    idx = idx.long()
    if direction == "kv":
        qm, km, vm = q, k[idx], v[idx]
        lm = None if lengths is None else lengths[idx]
    else:
        qm, km, vm = q[idx], k, v
        lm = lengths
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
    for instr in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier"):
        assert instr in ck.ptx, instr
    assert ck.spill_bytes == 0, ck.ptxas_log
    # ptxas serializes wgmma when the accumulators do not fit: a silent 2x slowdown.
    assert "wgmma.mma_async instructions are serialized" not in ck.ptxas_log, ck.ptxas_log


@pytest.mark.parametrize("cfg", attention_mod.SHIPPED_CONFIGS, ids=_compile_ids)
def test_shipped_config_compiles_for_sm90a(cfg):
    _check_compiled(cfg)


def test_odd_sq_compiles_for_sm90a():
    from ikbo_fa.fwd_sm90 import FwdConfig

    _check_compiled(FwdConfig("fp16", 64, 100, "q", True, True))
