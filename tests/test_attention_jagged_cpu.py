"""CPU tests of jagged K/V (``kv_offsets``, ``max_kv_len``) in ikbo_fa: the reference against a
float64 loop over each row's keys, against the padded layout with kv_lengths, the checks and
their messages, and the clamp that defines unvalidated offsets. The op-level tests run once
``ikbo_fa.attention`` takes ``kv_offsets`` (CPU tensors run the reference there)."""
import inspect
import math

import pytest
import torch

import ikbo_fa
from attention_inputs import assert_nan_rows_only, jagged_to_padded, random_jagged_problem
from ikbo_fa.checks import check_offsets, resolve_problem
from ikbo_fa.reference import attention_reference


def _op_takes_offsets() -> bool:
    return "kv_offsets" in inspect.signature(ikbo_fa.attention).parameters


needs_op = pytest.mark.skipif(not _op_takes_offsets(), reason="ikbo_fa.attention does not take kv_offsets yet")
FUNCTIONS = [pytest.param(ikbo_fa.attention, marks=needs_op, id="op"),
             pytest.param(attention_reference, id="reference")]


def _float64_jagged(q, k, v, idx, kv_offsets, direction, scale, max_kv_len=None):
    """The jagged formula in float64, one candidate and head at a time; offsets clamped as
    unvalidated calls define them (a no-op on valid offsets). -> (out, lse)."""
    off = [int(x) for x in kv_offsets]
    total = k.shape[0]
    B, (S_q, H, D) = idx.shape[0], q.shape[1:]
    group = H // k.shape[1]
    out = torch.zeros(B, S_q, H, D, dtype=torch.float64)
    lse = torch.full((B, H, S_q), -math.inf, dtype=torch.float64)
    for b in range(B):
        i = int(idx[b])
        q_row, r = (b, i) if direction == "kv" else (i, b)
        start = min(max(off[r], 0), total)
        end = min(max(off[r + 1], start), total)
        if max_kv_len is not None:
            end = min(end, start + max_kv_len)
        if end == start:
            continue  # no keys: output 0, lse -inf
        for h in range(H):
            keys = k[start:end, h // group].double()
            values = v[start:end, h // group].double()
            s = q[q_row, :, h].double() @ keys.T * scale  # [S_q, n]
            lse[b, h] = torch.logsumexp(s, dim=-1)
            out[b, :, h] = torch.softmax(s, dim=-1) @ values
    return out, lse


def _empty_rows(idx, kv_offsets, direction):
    """Candidates whose K/V row has no keys (valid offsets)."""
    lengths = kv_offsets[1:].long() - kv_offsets[:-1].long()
    return lengths[idx.long()] == 0 if direction == "kv" else lengths == 0


CASES = [
    # direction, B, U, S_q, H, H_kv, D, lengths (one per K/V row), packed, offsets dtype
    ("kv", 9, 5, 3, 4, 2, 16, (0, 1, 127, 128, 129), False, torch.int32),
    ("kv", 8, 5, 2, 4, 2, 8, (129, 128, 0, 127, 1), True, torch.int64),
    ("kv", 6, 1, 1, 2, 1, 8, (40,), False, torch.int64),
    ("kv", 3, 3, 2, 4, 2, 8, (5, 0, 9), True, torch.int32),  # ratio 1 (needs broadcast)
    ("q", 5, 2, 2, 4, 2, 8, (0, 1, 127, 128, 129), True, torch.int32),
    ("q", 5, 3, 3, 4, 2, 16, (129, 0, 1, 128, 127), False, torch.int64),
    ("q", 3, 3, 2, 2, 2, 8, (0, 7, 2), False, torch.int64),  # ratio 1 (needs broadcast)
]


def _case_id(c):
    return "-".join(str(x).replace("torch.", "") if not isinstance(x, tuple) else "_".join(map(str, x)) for x in c)


def _make(case, seed, dtype=torch.float32):
    direction, B, U, S_q, H, H_kv, D, lengths, packed, off_dtype = case
    q, kv, k, v, idx, offsets = random_jagged_problem(seed, direction, B, U, S_q, H, H_kv, D, lengths, dtype,
                                                      packed=packed, offsets_dtype=off_dtype)
    return q, kv, k, v, idx, offsets, (direction if B == U else None)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_float64_jagged(case):
    q, kv, k, v, idx, offsets, broadcast = _make(case, 11)
    direction, B, D = case[0], case[1], case[6]
    out, lse = attention_reference(q, kv, idx, kv_offsets=offsets, broadcast=broadcast, return_lse=True)
    ref_o, ref_lse = _float64_jagged(q, k, v, idx, offsets, direction, 1 / math.sqrt(D))
    assert out.shape == (B, *q.shape[1:]) and out.dtype == q.dtype
    assert lse.shape == (B, q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    empty = _empty_rows(idx, offsets, direction)
    assert bool(empty.any()) == (0 in case[7])  # every user has a candidate
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    assert torch.isfinite(out).all() and not lse.isnan().any()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_jagged_equals_padded_with_lengths(case):
    """Padded with NaN past each row's keys: the padded layout reads none of them and agrees."""
    q, kv, k, v, idx, offsets, broadcast = _make(case, 12)
    k_pad, v_pad, lengths = jagged_to_padded(k, v, offsets)
    assert k_pad.isnan().any() or int(lengths.min()) == k_pad.shape[1]
    out, lse = attention_reference(q, kv, idx, kv_offsets=offsets, broadcast=broadcast, return_lse=True)
    pad, pad_lse = attention_reference(q, (k_pad, v_pad), idx, kv_lengths=lengths, broadcast=broadcast,
                                       return_lse=True)
    assert torch.isfinite(pad).all()
    torch.testing.assert_close(out, pad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, pad_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_jagged(dtype):
    case = ("kv", 33, 4, 6, 4, 2, 32, (0, 17, 129, 64), False, torch.int64)
    q, kv, k, v, idx, offsets, _ = _make(case, 13, dtype)
    out = attention_reference(q, kv, idx, kv_offsets=offsets, scale=0.3)
    ref, _ = _float64_jagged(q, k, v, idx, offsets, "kv", 0.3)
    assert out.dtype == dtype
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_offsets_need_not_be_contiguous():
    q, kv, k, v, idx, offsets, _ = _make(CASES[0], 14)
    strided = torch.stack([offsets, torch.full_like(offsets, -7)], dim=1)[:, 0]
    assert not strided.is_contiguous()
    a = attention_reference(q, kv, idx, kv_offsets=offsets)
    b = attention_reference(q, kv, idx, kv_offsets=strided, validate=True)
    assert torch.equal(a, b)


def test_max_kv_len_hint_does_not_change_the_result():
    q, kv, k, v, idx, offsets, _ = _make(CASES[1], 15)
    a = attention_reference(q, kv, idx, kv_offsets=offsets)
    for hint in (129, 130, 10**6):
        torch.testing.assert_close(attention_reference(q, kv, idx, kv_offsets=offsets, max_kv_len=hint,
                                                       validate=True), a, rtol=1e-6, atol=1e-6)


def test_no_keys_at_all():
    """total_L = 0 (every row empty) and max_kv_len = 0: output 0, lse -inf."""
    q = torch.randn(4, 2, 2, 8)
    k = v = torch.randn(0, 1, 8)
    idx = torch.tensor([0, 1, 1, 0])
    out, lse = attention_reference(q, (k, v), idx, kv_offsets=torch.tensor([0, 0, 0]), return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    q, kv, k, v, idx, offsets, _ = _make(CASES[0], 16)
    out, lse = attention_reference(q, kv, idx, kv_offsets=offsets, max_kv_len=0, validate=False, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_problem_fields():
    q, kv, k, v, idx, offsets, _ = _make(CASES[0], 17)
    total = int(offsets[-1])
    common = dict(scale=None, kv_lengths=None, broadcast=None, out=None, validate=True, op="attention_reference")
    p = resolve_problem(q, kv, idx, kv_offsets=offsets, **common)
    assert p.jagged and p.kv_offsets is offsets and p.kv_lengths is None
    assert p.kv_batch == 5 and p.total_kv == total and p.kv_len == total
    assert p.k is k and p.v is v and p.k.shape == (total, 2, 16)
    assert (p.direction, p.batch, p.kv_heads, p.head_dim) == ("kv", 9, 2, 16)
    assert resolve_problem(q, kv, idx, kv_offsets=offsets, max_kv_len=129, **common).kv_len == 129
    packed = torch.stack([k, v], dim=1)
    p = resolve_problem(q, packed, idx, kv_offsets=offsets, **common)
    assert torch.equal(p.k, k) and torch.equal(p.v, v) and p.k.shape == (total, 2, 16)
    k_pad, v_pad, lengths = jagged_to_padded(k, v, offsets, fill=0.0)
    p = resolve_problem(q, (k_pad, v_pad), idx, **{**common, "kv_lengths": lengths})
    assert not p.jagged and p.kv_offsets is None
    assert (p.kv_batch, p.kv_len, p.total_kv) == (5, 129, 5 * 129)


# ------------------------------------------------------------------ checks


def _errors_problem(seed=18, lengths=(3, 5)):
    """bf16, D 64: what the op takes too. KV broadcast, B 6, U 2 (total_L 8 by default)."""
    q, kv, k, v, idx, offsets = random_jagged_problem(seed, "kv", 6, 2, 2, 2, 1, 64, lengths, torch.bfloat16)
    return q, kv, k, v, idx, offsets


@pytest.mark.parametrize("f", FUNCTIONS)
@pytest.mark.parametrize("off_dtype", [torch.int32, torch.int64])
def test_bad_offsets_with_validation(f, off_dtype):
    q, kv, k, v, idx, _ = _errors_problem()

    def call(values, **kw):
        return f(q, kv, idx, kv_offsets=torch.tensor(values, dtype=off_dtype), validate=True, **kw)

    with pytest.raises(ValueError, match=r"^kv_offsets\[2\] = 2 is less than kv_offsets\[1\] = 3: kv_offsets "
                                         r"must not decrease$"):
        call([0, 3, 2])
    with pytest.raises(ValueError, match=r"^kv_offsets\[0\] = 1: kv_offsets must start at 0"):
        call([1, 3, 8])
    with pytest.raises(ValueError, match=r"^kv_offsets\[0\] = -1: kv_offsets must start at 0"):
        call([-1, 3, 8])
    with pytest.raises(IndexError, match=r"^kv_offsets\[2\] = 9 is out of range: offsets must lie in "
                                         r"\[0, total_L\] = \[0, 8\]"):
        call([0, 3, 9])
    with pytest.raises(IndexError, match=r"^kv_offsets\[1\] = 10 is out of range"):  # the first bad position
        call([0, 10, 4])
    with pytest.raises(ValueError, match=r"^row 1 of kv_offsets has 5 keys \(kv_offsets\[2\] - kv_offsets\[1\] = "
                                         r"8 - 3\), more than max_kv_len = 4$"):
        call([0, 3, 8], max_kv_len=4)
    call([0, 3, 8], max_kv_len=5)
    call([0, 0, 8])  # an empty row
    call([0, 3, 3])  # trailing keys that no row uses
    # Validation also checks idx against R = len(kv_offsets) - 1 users.
    with pytest.raises(IndexError, match=r"^idx\[\d+\] = 1 is out of range: values must lie in \[0, U\) = "
                                         r"\[0, 1\), U being the batch of k and v$"):
        call([0, 8])


@pytest.mark.parametrize("f", FUNCTIONS)
def test_validation_through_the_environment(f, monkeypatch):
    q, kv, k, v, idx, _ = _errors_problem()
    bad = torch.tensor([0, 3, 2])
    monkeypatch.setenv("IKBO_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"kv_offsets\[2\]"):
        f(q, kv, idx, kv_offsets=bad)
    monkeypatch.setenv("IKBO_VALIDATE", "0")
    f(q, kv, idx, kv_offsets=bad)


@pytest.mark.parametrize("f", FUNCTIONS)
def test_jagged_argument_errors(f):
    q, kv, k, v, idx, offsets = _errors_problem()
    k4, v4 = k[None].expand(2, 8, 1, 64), v[None].expand(2, 8, 1, 64)
    with pytest.raises(ValueError, match=r"^kv_lengths and kv_offsets were both given"):
        f(q, (k4, v4), idx, kv_offsets=offsets, kv_lengths=torch.tensor([3, 5]))
    with pytest.raises(ValueError, match=r"^k has shape \[2, 8, 1, 64\], the padded layout \[batch, L, H_kv, D\]: "
                                         r"with kv_offsets k must be jagged \[total_L, H_kv, D\]"):
        f(q, (k4, v4), idx, kv_offsets=offsets)
    with pytest.raises(ValueError, match=r"^kv has shape \[2, 8, 2, 1, 64\], the padded layout "
                                         r"\[batch, L, 2, H_kv, D\]: with kv_offsets kv must be jagged "
                                         r"\[total_L, 2, H_kv, D\]"):
        f(q, torch.stack([k4, v4], dim=2), idx, kv_offsets=offsets)
    with pytest.raises(ValueError, match=r"^k must have 4 dimensions \[batch, L, H_kv, D\], got shape "
                                         r"\[8, 1, 64\]; the jagged layout \[total_L, H_kv, D\] needs "
                                         r"kv_offsets \[R \+ 1\]$"):
        f(q, (k, v), idx)
    with pytest.raises(ValueError, match=r"^kv must have 5 dimensions \[batch, L, 2, H_kv, D\], got shape "
                                         r"\[8, 2, 1, 64\]; the jagged layout \[total_L, 2, H_kv, D\] needs "
                                         r"kv_offsets"):
        f(q, torch.stack([k, v], dim=1), idx)
    with pytest.raises(ValueError, match=r"^kv packed as one tensor must have shape \[total_L, 2, H_kv, D\], "
                                         r"got dimension 1 = 3$"):
        f(q, torch.stack([k, v, v], dim=1), idx, kv_offsets=offsets)
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        f(q, (k, v[:7]), idx, kv_offsets=offsets)
    with pytest.raises(ValueError, match=r"^v must have 3 dimensions \[total_L, H_kv, D\], got shape \[8, 64\]$"):
        f(q, (k, v[:, 0]), idx, kv_offsets=offsets)
    with pytest.raises(ValueError, match=r"^kv_offsets must have 1 dimension \[R \+ 1\], got shape \[1, 3\]$"):
        f(q, kv, idx, kv_offsets=offsets[None])
    with pytest.raises(ValueError, match=r"^kv_offsets has shape \[1\]: expected \[R \+ 1\] with R >= 1"):
        f(q, kv, idx, kv_offsets=offsets[:1])
    with pytest.raises(ValueError, match=r"^kv_offsets must not be empty"):
        f(q, kv, idx, kv_offsets=offsets[:0])
    with pytest.raises(TypeError, match=r"^kv_offsets must be int32 or int64, got float32$"):
        f(q, kv, idx, kv_offsets=offsets.float())
    with pytest.raises(TypeError, match=r"^kv_offsets must be int32 or int64, got int16$"):
        f(q, kv, idx, kv_offsets=offsets.to(torch.int16))
    with pytest.raises(TypeError, match=r"^kv_offsets must be a torch.Tensor \[R \+ 1\], got list$"):
        f(q, kv, idx, kv_offsets=[0, 3, 8])
    with pytest.raises(ValueError, match=r"^kv_offsets is on meta but q is on cpu"):
        f(q, kv, idx, kv_offsets=offsets.to("meta"))
    with pytest.raises(ValueError, match=r"^broadcast='q' needs k/v batch = len\(idx\) = 6, got 2 "
                                         r"\(R = len\(kv_offsets\) - 1\)$"):
        f(q, kv, idx, kv_offsets=offsets, broadcast="q")
    with pytest.raises(ValueError, match=r"nor k/v \(R = len\(kv_offsets\) - 1 = 2 rows\) has that batch"):
        f(q[:4], kv, idx, kv_offsets=offsets)
    with pytest.raises(ValueError, match=r"k/v head dimension 32 differs from q's 64"):
        f(q, (k[..., :32], v[..., :32]), idx, kv_offsets=offsets)


@pytest.mark.parametrize("f", FUNCTIONS)
def test_max_kv_len_errors(f):
    q, kv, k, v, idx, offsets = _errors_problem()
    for bad in (True, False, 2.0, "3", torch.tensor(3), [3]):
        with pytest.raises(TypeError, match=r"^max_kv_len must be an int or None, got "):
            f(q, kv, idx, kv_offsets=offsets, max_kv_len=bad)
    for bad in (-1, -(10**20)):
        with pytest.raises(ValueError, match=r"^max_kv_len must be >= 0 \(an upper bound of every row's keys\), "
                                             rf"got {bad}$"):
            f(q, kv, idx, kv_offsets=offsets, max_kv_len=bad)
    k_pad, v_pad, lengths = jagged_to_padded(k, v, offsets, fill=0.0)
    with pytest.raises(ValueError, match=r"^max_kv_len = 5 bounds the rows of jagged k/v: pass it with kv_offsets"):
        f(q, (k_pad, v_pad), idx, kv_lengths=lengths, max_kv_len=5)
    np = pytest.importorskip("numpy")
    f(q, kv, idx, kv_offsets=offsets, max_kv_len=np.int64(5))  # any integer type


def test_check_offsets_directly():
    check_offsets(torch.tensor([0, 0, 4, 4, 9]), 9)
    check_offsets(torch.tensor([0, 0, 4, 4, 9]), 9, 5)
    check_offsets(torch.tensor([0, 2], dtype=torch.int32), 9, 2)
    with pytest.raises(ValueError, match=r"^kv_offsets\[3\] = 3 is less than kv_offsets\[2\] = 4"):
        check_offsets(torch.tensor([0, 0, 4, 3, 9]), 9)
    with pytest.raises(IndexError, match=r"^kv_offsets\[4\] = 10 is out of range"):
        check_offsets(torch.tensor([0, 0, 4, 4, 10]), 9)
    with pytest.raises(ValueError, match=r"^row 3 of kv_offsets has 5 keys"):
        check_offsets(torch.tensor([0, 0, 4, 4, 9]), 9, 4)


# ------------------------------------------------- unvalidated offsets: the clamp


BAD_OFFSETS = [
    # offsets, max_kv_len (total_L = 8 in every case)
    ([5, 2, 100], None),  # decreasing, past the end: row 0 empty, row 1 = keys 2 : 8
    ([-3, 4, 18], None),  # negative start, past the end: rows 0 : 4 and 4 : 8
    ([0, 13, 19], None),  # every offset past the first past the end: rows 0 : 8 and empty
    ([2, 6, 1], None),  # not starting at 0, then decreasing
    ([0, 3, 8], 2),  # valid offsets, rows longer than the hint: their first 2 keys
    ([-5, 7, 9], 3),
    ([0, 3, 8], 0),  # every row cut to nothing
]


@pytest.mark.parametrize("offsets, hint", BAD_OFFSETS, ids=lambda x: str(x))
@pytest.mark.parametrize("off_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("f", FUNCTIONS)
def test_unvalidated_offsets_are_clamped(f, off_dtype, offsets, hint, monkeypatch):
    q, kv, k, v, idx, _ = _errors_problem(19)
    off = torch.tensor(offsets, dtype=off_dtype)
    out, lse = f(q, kv, idx, kv_offsets=off, max_kv_len=hint, validate=False, return_lse=True)
    ref_o, ref_lse = _float64_jagged(q, k, v, idx, off, "kv", 1 / 8, hint)
    assert torch.isfinite(out).all() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_o, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
    no_keys = torch.isneginf(ref_lse[:, 0, 0])
    assert (out[no_keys] == 0).all() and torch.isneginf(lse[no_keys]).all()
    monkeypatch.setenv("IKBO_VALIDATE", "0")  # validate=None with the variable off: the same
    assert torch.equal(f(q, kv, idx, kv_offsets=off, max_kv_len=hint), out)


@pytest.mark.parametrize("direction", ["kv", "q"])
def test_unvalidated_out_of_range_index_jagged(direction):
    case = (direction, 8, 3, 2, 4, 2, 8, (4, 0, 9) if direction == "kv" else (4, 0, 9, 1, 2, 3, 0, 5), False,
            torch.int32)
    q, kv, k, v, idx, offsets, _ = _make(case, 20)
    idx[2] = 3
    idx[5] = -1
    side = "the batch of k and v" if direction == "kv" else "the batch of q"
    with pytest.raises(IndexError, match=rf"^idx\[2\] = 3 is out of range: .*U being {side}$"):
        attention_reference(q, kv, idx, kv_offsets=offsets, validate=True)
    out, lse = attention_reference(q, kv, idx, kv_offsets=offsets, validate=False, return_lse=True)
    bad = torch.zeros(8, dtype=torch.bool)
    bad[[2, 5]] = True
    assert_nan_rows_only(out, lse, bad)
    good = idx.clone()
    good[bad] = 0
    torch.testing.assert_close(out[~bad], attention_reference(q, kv, good, kv_offsets=offsets)[~bad], rtol=0, atol=0)


def test_nan_in_one_row_stays_there():
    """NaN in a user's last key (just before the next user's first) reaches only that user."""
    case = ("kv", 12, 4, 2, 2, 1, 8, (5, 0, 7, 3), False, torch.int64)
    q, kv, k, v, idx, offsets, _ = _make(case, 21)
    k[4] = float("nan")  # user 0's last key
    v[12] = float("nan")  # user 3's first key, right after user 2's last: offsets [0, 5, 5, 12, 15]
    out = attention_reference(q, (k, v), idx, kv_offsets=offsets)
    hit = (idx == 0) | (idx == 3)
    assert out[hit].isnan().all() and torch.isfinite(out[~hit]).all()


# ------------------------------------------------------------------ the op on CPU tensors


@needs_op
@pytest.mark.parametrize("direction", ["kv", "q"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("off_dtype", [torch.int32, torch.int64])
def test_op_on_cpu_runs_the_jagged_reference(direction, packed, off_dtype):
    lengths = (0, 1, 127, 128, 129) if direction == "kv" else (129, 0, 1, 128, 127, 3, 0)
    case = (direction, 7, 5, 3, 4, 2, 64, lengths, packed, off_dtype)
    q, kv, k, v, idx, offsets, _ = _make(case, 22, torch.bfloat16)
    out = torch.full((7, 3, 4, 64), float("nan"), dtype=torch.bfloat16)
    res, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, out=out, return_lse=True)
    assert res is out and not out.isnan().any()
    ref, ref_lse = attention_reference(q, kv, idx, kv_offsets=offsets, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    hinted = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, max_kv_len=129)
    torch.testing.assert_close(hinted, ref, rtol=1e-2, atol=1e-2)
    truth, _ = _float64_jagged(q, k, v, idx, offsets, direction, 1 / 8)
    assert float((out.double() - truth).norm() / truth.norm()) < 1e-2


@needs_op
def test_op_takes_the_reference_signature():
    op = list(inspect.signature(ikbo_fa.attention).parameters)
    assert op == list(inspect.signature(attention_reference).parameters)
    assert op[:3] == ["q", "kv", "idx"]
    assert op[3:] == ["scale", "kv_lengths", "kv_offsets", "max_kv_len", "broadcast", "return_lse", "out",
                      "validate", "work_list", "policy"]


def test_reference_signature():
    params = inspect.signature(attention_reference).parameters
    assert list(params) == ["q", "kv", "idx", "scale", "kv_lengths", "kv_offsets", "max_kv_len", "broadcast",
                            "return_lse", "out", "validate", "work_list", "policy"]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in list(params)[3:])
    assert params["kv_offsets"].default is None and params["max_kv_len"].default is None
