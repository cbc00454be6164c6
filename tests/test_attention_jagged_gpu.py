"""GPU tests of jagged K/V (``kv_offsets``, ``max_kv_len``) in ikbo_fa.attention on sm_90: against
fp32 attention on the materialized padded layout with the error budget of test_attention_gpu.py
(1.5x torch SDPA's error in the same dtype), keys outside a row never read (the next row's
first keys, unused keys at the end, memory past the tensor, keys past the hint), offsets and
idx rewritten under CUDA-graph replay, and the checks and the clamp of unvalidated offsets."""
import math

import pytest
import torch

import ikbo_fa
from attention_inputs import jagged_to_padded, materialize, random_jagged_problem
from test_attention_gpu import _attention_fp32, _rel, _sdpa

pytestmark = pytest.mark.gpu

NAN = float("nan")


def _lengths(pattern, n):
    """``n`` row lengths cycling through ``pattern``."""
    return [pattern[i % len(pattern)] for i in range(n)]


def _make(direction, B, U, S_q, H, H_kv, D, pattern, dtype, *, packed, seed, offsets_dtype=torch.int64):
    lengths = _lengths(pattern, U if direction == "kv" else B)
    return random_jagged_problem(seed, direction, B, U, S_q, H, H_kv, D, lengths, dtype, packed=packed,
                                 offsets_dtype=offsets_dtype, device="cuda")


def _padded_truth_inputs(k, v, offsets, max_kv_len=None):
    """Padded k, v [R, L, H_kv, D] and lengths [R] of valid offsets, rows cut at ``max_kv_len``;
    every key past a row's (cut) length is 0, so the fp32 and SDPA evaluations, which mask only
    the scores, see no NaN there."""
    k_pad, v_pad, lengths = jagged_to_padded(k, v, offsets, fill=0.0)
    if max_kv_len is not None:
        lengths = lengths.clamp(max=max_kv_len)
    gone = torch.arange(k_pad.shape[1], device=k.device)[None, :] >= lengths[:, None]
    return k_pad.masked_fill(gone[..., None, None], 0.0), v_pad.masked_fill(gone[..., None, None], 0.0), lengths


def _check(out, lse, q, k, v, idx, offsets, direction, scale, max_kv_len=None):
    """``out`` (and ``lse`` where given) against fp32 attention: rows without keys exactly 0 and
    -inf, the others within 1.5x SDPA's error, lse to 1e-4."""
    k_pad, v_pad, lengths = _padded_truth_inputs(k, v, offsets, max_kv_len)
    qm, km, vm, lm = materialize(q, k_pad, v_pad, idx, direction, lengths)
    ref, ref_lse = _attention_fp32(qm, km, vm, scale, lm)
    assert not out.isnan().any()
    empty = lm == 0
    assert (out[empty] == 0).all()
    if lse is not None:
        assert torch.isneginf(lse[empty]).all()
    keep = ~empty
    if not keep.any():
        return
    err = _rel(out[keep], ref[keep])
    sdpa_err = _rel(_sdpa(qm, km, vm, scale, lm)[keep], ref[keep])
    assert err <= 1.5 * sdpa_err + 1e-6, (err, sdpa_err)
    if lse is not None:
        torch.testing.assert_close(lse[keep], ref_lse[keep], rtol=1e-4, atol=1e-4)


CASES = [
    # direction, B, U, S_q, H, H_kv, D, length pattern (cycled over the K/V rows), dtype, packed,
    # offsets dtype, lse
    ("kv", 512, 6, 64, 4, 2, 128, (0, 1, 127, 128, 129, 300), torch.bfloat16, True, torch.int64, True),
    ("kv", 300, 5, 32, 2, 2, 64, (129, 0, 128, 1, 127), torch.float16, False, torch.int64, True),
    ("kv", 1000, 40, 8, 2, 1, 128, (17, 129, 0, 256, 1, 128, 77, 127), torch.bfloat16, False, torch.int32, False),
    ("kv", 16, 2, 16, 2, 1, 128, (32768, 5), torch.bfloat16, False, torch.int64, True),  # one long row
    ("kv", 6, 6, 1, 2, 2, 64, (0, 1, 127, 128, 129, 7), torch.bfloat16, True, torch.int64, True),  # ratio 1
    ("q", 64, 4, 100, 4, 2, 64, (0, 1, 127, 128, 129), torch.float16, True, torch.int64, True),
    ("q", 200, 8, 64, 2, 1, 128, (129, 128, 127, 1, 0, 64, 300), torch.bfloat16, False, torch.int32, False),
    ("q", 3, 2, 16, 2, 2, 128, (32768, 0, 129), torch.bfloat16, False, torch.int64, True),  # one long row
]


def _id(c):
    return "-".join(str(x).replace("torch.", "") if not isinstance(x, tuple) else "_".join(map(str, x)) for x in c)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_fp32_within_sdpa_error_jagged(case):
    direction, B, U, S_q, H, H_kv, D, pattern, dtype, packed, off_dtype, want_lse = case
    q, kv, k, v, idx, offsets = _make(direction, B, U, S_q, H, H_kv, D, pattern, dtype, packed=packed,
                                      seed=B + 7 * S_q + len(pattern), offsets_dtype=off_dtype)
    out = torch.full((B, S_q, H, D), NAN, dtype=dtype, device="cuda")
    broadcast = direction if B == U else None
    res = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, broadcast=broadcast, out=out, return_lse=want_lse)
    lse = None
    if want_lse:
        res, lse = res
    assert res is out
    _check(out, lse, q, k, v, idx, offsets, direction, 1.0 / math.sqrt(D))


def test_unsorted_equals_sorted_jagged():
    q, kv, k, v, idx, offsets = _make("kv", 1000, 16, 64, 2, 2, 128, (333, 0, 129, 1, 128, 500), torch.bfloat16,
                                      packed=False, seed=6)
    out = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets)
    perm = torch.argsort(idx, stable=True)
    out_sorted = ikbo_fa.attention(q[perm], kv, idx[perm], kv_offsets=offsets)
    torch.testing.assert_close(out[perm], out_sorted, rtol=0, atol=0)


# ------------------------------------------------------ keys outside a row are never read

ISOLATION_LENGTHS = (50, 130, 0, 77, 129)  # offsets [0, 50, 180, 180, 257, 386]


def _owner(offsets, pos):
    """The row whose keys include key ``pos``."""
    return int(torch.searchsorted(offsets.long(), torch.tensor([pos], device=offsets.device), right=True)) - 1


@pytest.mark.parametrize("key", ["inside", 50, 180, 257])
def test_nan_in_one_user_stays_in_that_user_jagged(key):
    """NaN in one key (inside user 1's rows, or the first key after a user's last: the next
    user's first, also after an empty user) reaches that key's user only."""
    B, U, S_q, H, D = 256, 5, 64, 2, 128
    q, kv, k, v, idx, offsets = _make("kv", B, U, S_q, H, H, D, ISOLATION_LENGTHS, torch.bfloat16, packed=False,
                                      seed=4)
    pos = 50 + 13 if key == "inside" else key
    k[pos] = NAN
    v[pos] = NAN
    owner = _owner(offsets, pos)
    out = ikbo_fa.attention(q, (k, v), idx, kv_offsets=offsets)
    hit = idx == owner
    assert hit.any() and out[hit].isnan().all()
    assert torch.isfinite(out[~hit]).all()
    lengths = offsets[1:] - offsets[:-1]
    assert (out[lengths[idx] == 0] == 0).all()


@pytest.mark.parametrize("packed", [False, True])
def test_keys_past_the_last_row_are_never_read(packed):
    """NaN in the keys after kv_offsets[R] (inside k / v) and in the memory right after k / v
    (the tensors are views of a larger NaN-filled buffer): no output reads them."""
    B, U, S_q, H, H_kv, D = 256, 5, 32, 4, 2, 128
    q, kv, k, v, idx, offsets = _make("kv", B, U, S_q, H, H_kv, D, ISOLATION_LENGTHS, torch.bfloat16,
                                      packed=packed, seed=5)
    used = k.shape[0]
    unused, past = 7, 200  # keys of the tensor that no row uses; rows of memory past the tensor
    if packed:
        store = torch.full((used + unused + past, 2, H_kv, D), NAN, dtype=torch.bfloat16, device="cuda")
        store[:used] = kv
        kv = store[: used + unused]
        k, v = kv[:, 0], kv[:, 1]
    else:
        stores = [torch.full((used + unused + past, H_kv, D), NAN, dtype=torch.bfloat16, device="cuda")
                  for _ in range(2)]
        stores[0][:used], stores[1][:used] = k, v
        k, v = stores[0][: used + unused], stores[1][: used + unused]
        kv = (k, v)
    out, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, return_lse=True)
    assert torch.isfinite(out).all()
    _check(out, lse, q, k, v, idx, offsets, "kv", 1.0 / math.sqrt(D))


@pytest.mark.parametrize("direction", ["kv", "q"])
def test_max_kv_len_hint(direction):
    """A hint at or above the longest row gives the same result; a hint below it (validation off)
    reads each row's first max_kv_len keys only (NaN past them), and validated raises."""
    B, U = (256, 6) if direction == "kv" else (48, 4)
    pattern = (0, 1, 127, 128, 129, 300)
    q, kv, k, v, idx, offsets = _make(direction, B, U, 32, 2, 1, 128, pattern, torch.bfloat16, packed=False,
                                      seed=7)
    scale = 1.0 / math.sqrt(128)
    plain = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets)
    for hint in (300, 301, 4096):
        out, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, max_kv_len=hint, return_lse=True)
        _check(out, lse, q, k, v, idx, offsets, direction, scale)
        assert _rel(out, plain.float()) < 1e-2
    hint = 128
    rows = offsets[1:] - offsets[:-1]
    r = int(torch.nonzero(rows > hint)[0, 0])
    with pytest.raises(ValueError, match=rf"^row {r} of kv_offsets has {int(rows[r])} keys .* more than "
                                         rf"max_kv_len = {hint}$"):
        ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, max_kv_len=hint, validate=True)
    for row in range(len(rows)):  # keys past the hint: NaN
        start, n = int(offsets[row]), int(rows[row])
        if n > hint:
            k[start + hint:start + n] = NAN
            v[start + hint:start + n] = NAN
    out = torch.full_like(plain, NAN)
    _, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, max_kv_len=hint, validate=False, out=out,
                               return_lse=True)
    _check(out, lse, q, k, v, idx, offsets, direction, scale, max_kv_len=hint)
    ref = ikbo_fa.attention_reference(q, kv, idx, kv_offsets=offsets, max_kv_len=hint, validate=False)
    assert _rel(out, ref.float()) < 1e-2


# ------------------------------------------------------------------ CUDA graphs


@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("direction", ["kv", "q"])
@pytest.mark.parametrize("hint", [None, 300])
def test_cuda_graph_replay_with_new_offsets_and_idx(direction, hint, int_dtype):
    """Captured once; new idx, offsets (other row lengths, same total_L, once ending before it)
    and q / k / v values copied into the captured tensors: each replay gives their result.
    idx and offsets of ``int_dtype``: int64 offsets (and Q broadcast's int64 idx) go through int32
    copies made inside the graph; int32 ones are read from the captured tensors themselves."""
    B, U, S_q, H, H_kv, D = (256, 6, 32, 2, 1, 128) if direction == "kv" else (48, 4, 32, 2, 1, 128)
    pattern = (300, 129, 128, 127, 1, 0)
    q, kv, k, v, idx, offsets = _make(direction, B, U, S_q, H, H_kv, D, pattern, torch.bfloat16, packed=True,
                                      seed=8, offsets_dtype=int_dtype)
    idx = idx.to(int_dtype)
    R, total = offsets.shape[0] - 1, k.shape[0]
    out = torch.full((B, S_q, H, D), NAN, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(0)

    def call():
        nonlocal lse
        _, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, max_kv_len=hint, out=out, return_lse=True,
                                   validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile outside the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()

    base = torch.tensor(_lengths(pattern, R))
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        lengths = base[torch.randperm(R, generator=g)]
        if seed == 2:
            lengths[int(lengths.argmax())] -= 5  # the rows end 5 keys before total_L
        new_offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        assert int(new_offsets[-1]) <= total and (hint is None or int(lengths.max()) <= hint)
        offsets.copy_(new_offsets)
        idx.copy_(torch.randint(0, U, (B,), generator=g))
        q.copy_(torch.randn(q.shape, generator=g))
        kv.copy_(torch.randn(kv.shape, generator=g))
        kv[int(new_offsets[-1]):] = NAN  # keys that no row uses
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, lse, q, k, v, idx, offsets, direction, 1.0 / math.sqrt(D), max_kv_len=hint)


# ------------------------------------------------------------------ checks and the clamp


@pytest.mark.parametrize("off_dtype", [torch.int32, torch.int64])
def test_bad_offsets_validated_or_clamped(off_dtype):
    B, U, S_q, H, D = 64, 3, 32, 2, 128
    q, kv, k, v, idx, _ = _make("kv", B, U, S_q, H, H, D, (100, 0, 200), torch.bfloat16, packed=False, seed=9)

    def offsets(values):
        return torch.tensor(values, dtype=off_dtype, device="cuda")

    with pytest.raises(ValueError, match=r"^kv_offsets\[2\] = 100 is less than kv_offsets\[1\] = 150"):
        ikbo_fa.attention(q, kv, idx, kv_offsets=offsets([0, 150, 100, 300]), validate=True)
    with pytest.raises(ValueError, match=r"^kv_offsets\[0\] = 5: kv_offsets must start at 0"):
        ikbo_fa.attention(q, kv, idx, kv_offsets=offsets([5, 100, 100, 300]), validate=True)
    with pytest.raises(IndexError, match=r"^kv_offsets\[3\] = 301 is out of range"):
        ikbo_fa.attention(q, kv, idx, kv_offsets=offsets([0, 100, 100, 301]), validate=True)
    for bad in ([0, 150, 100, 300], [-7, 100, 100, 999], [40, 10, 250, 260], [300, 300, 0, 2**31 - 1]):
        off = offsets(bad)
        out = torch.full((B, S_q, H, D), NAN, dtype=torch.bfloat16, device="cuda")
        _, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=off, validate=False, out=out, return_lse=True)
        ref, ref_lse = ikbo_fa.attention_reference(q, kv, idx, kv_offsets=off, validate=False, return_lse=True)
        assert not out.isnan().any() and not lse.isnan().any()
        empty = torch.isneginf(ref_lse[:, 0, 0])
        assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
        if (~empty).any():
            assert _rel(out[~empty], ref[~empty].float()) < 1e-2
            torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("S_q, B, U, H", [(1, 700, 9, 3), (17, 500, 25, 2)])
def test_longest_first_walk_on_a_small_grid(monkeypatch, fresh_attention_plans, S_q, B, U, H):
    """Histories of very different lengths on a grid of 7 CTAs: many rounds of the walk, the odd
    ones turned back, the last one partial; every tile once (NaN-poisoned out), against fp32."""
    attention_mod = __import__("importlib").import_module("ikbo_fa.attention")
    monkeypatch.setattr(attention_mod, "sm_count", lambda device: 7)
    q, kv, k, v, idx, offsets = _make("kv", B, U, S_q, H, H, 64, (0, 1, 129, 2000, 50, 700, 128, 3000, 3),
                                      torch.bfloat16, packed=False, seed=S_q + U, offsets_dtype=torch.int32)
    idx = idx[torch.randperm(B, device="cuda")]
    out = torch.full((B, S_q, H, 64), NAN, dtype=torch.bfloat16, device="cuda")
    _, lse = ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, out=out, return_lse=True)
    plan = attention_mod.launch_plan(q, kv, idx, kv_offsets=offsets, out=out, return_lse=True)
    assert plan.ordered and plan.n_ctas == 7
    _check(out, lse, q, k, v, idx, offsets, "kv", 1.0 / math.sqrt(64))
