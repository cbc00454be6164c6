"""GPU tests of short histories of their own lengths in user order (``AttentionPolicy.order_min_keys``:
rows that may hold fewer keys run with the work list of padded K/V, no longest-first order):
the same results, bit for bit, as longest first (``order_min_keys=0``), and the fp32
reference's, over kv_offsets and kv_lengths, at 0 and 1 keys, one candidate, a user of 10,000
candidates, out-of-range indices; CUDA-graph replay with new idx and offsets written in place.
"""
import pytest
import torch

import ikbo_fa
from attention_inputs import capture_graph, random_jagged_problem, random_problem, run_with_policy
from ikbo_fa import AttentionPolicy

pytestmark = pytest.mark.gpu
LONGEST_FIRST = AttentionPolicy(order_min_keys=0)
NAN = float("nan")

# (U, ratio, S_q, lengths, H, H_kv, D, dtype): short behaviour sequences with a row of no key
# and one of one key over several rounds of the grid, grouped heads at D 64 in fp16 with an
# odd S_q, one user of 10,000 candidates, one candidate of one user, a row of exactly 256 keys
SHAPES = [
    (64, 32, 1, [0, 1] + [37 + 3 * i for i in range(62)], 4, 4, 64, torch.bfloat16),
    (64, 32, 4, [0, 1] + [256 - 4 * i for i in range(62)], 4, 4, 64, torch.bfloat16),
    (3, 50, 3, [130, 17, 255], 4, 2, 64, torch.float16),
    (1, 10000, 1, [160], 2, 2, 128, torch.bfloat16),
    (1, 1, 2, [256], 2, 2, 128, torch.bfloat16),
]


def _problem(shape, layout):
    U, ratio, S_q, lengths, H, H_kv, D, dtype = shape
    B = U * ratio
    if layout == "kv_offsets":
        q, kv, k, v, idx, offsets = random_jagged_problem(41 + S_q, "kv", B, U, S_q, H, H_kv, D, lengths, dtype,
                                                          device="cuda")
        return q, kv, idx, dict(kv_offsets=offsets, max_kv_len=max(lengths), broadcast="kv")
    q, kv, k, v, idx, _ = random_problem(43 + S_q, "kv", B, U, S_q, H, H_kv, D, max(lengths), dtype, device="cuda")
    return q, kv, idx, dict(kv_lengths=torch.tensor(lengths, device="cuda"), broadcast="kv")


@pytest.mark.parametrize("layout", ["kv_offsets", "kv_lengths"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"U{s[0]}-r{s[1]}-sq{s[2]}-max{max(s[3])}-D{s[6]}")
def test_user_order_matches_longest_first(shape, layout):
    q, kv, idx, kw = _problem(shape, layout)
    out, lse, plan = run_with_policy(AttentionPolicy(), q, kv, idx, **kw)
    base, base_lse, plan0 = run_with_policy(LONGEST_FIRST, q, kv, idx, **kw)
    assert not plan.ordered and not plan.config.longest_first and plan0.ordered
    assert torch.equal(out, base) and torch.equal(lse, base_lse)
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), tuple(t.float() for t in kv), idx, return_lse=True, **kw)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_out_of_range_indices_stay_their_own():
    """Indices outside [0, U) (validation off) give NaN rows and lse, and no other row changes."""
    q, kv, idx, kw = _problem(SHAPES[0], "kv_offsets")
    bad = torch.zeros_like(idx, dtype=torch.bool)
    bad[::7] = True
    idx = torch.where(bad, torch.where(torch.arange(idx.shape[0], device="cuda") % 2 == 0, -1, 64), idx)
    out, lse, plan = run_with_policy(AttentionPolicy(), q, kv, idx, **kw)
    assert not plan.ordered
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    good = ~bad
    ref, ref_lse = ikbo_fa.attention_reference(q[good].float(), tuple(t.float() for t in kv), idx[good],
                                               return_lse=True, **kw)
    torch.testing.assert_close(out[good].float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[good], ref_lse, rtol=1e-3, atol=1e-3)


def test_graph_replay_with_new_idx_and_offsets():
    """One capture in user order (rows bounded by max_kv_len 256); new kv_offsets (rows of new
    lengths up to 256 over the same keys), idx and K written in place before each replay."""
    lengths = [100, 0, 256, 31, 200, 1]
    q, kv, k, v, idx, offsets = random_jagged_problem(51, "kv", 240, 6, 2, 4, 4, 64, lengths, torch.bfloat16,
                                                      device="cuda")
    kw = dict(max_kv_len=256)
    total = int(offsets[-1])
    out = torch.full((idx.shape[0], *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
    ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, out=out, **kw)  # compile and plan outside the capture
    _, _, plan = run_with_policy(AttentionPolicy(), q, kv, idx, kv_offsets=offsets, **kw)
    assert not plan.ordered
    graph = capture_graph(lambda: ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, out=out, validate=False, **kw))
    g = torch.Generator().manual_seed(52)
    for _ in range(3):
        lens = torch.randint(0, 257, (6,), generator=g)
        lens = (lens * total // max(total, int(lens.sum()))).clamp(max=256)  # within the keys there are
        offsets.copy_(torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(offsets))
        idx.copy_(torch.randint(0, 6, idx.shape, generator=g).to(idx))
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype).cuda())
        out.fill_(NAN)
        graph.replay()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_offsets=offsets, **kw)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("D", [64, 128])
def test_keys_past_a_row_not_finite_are_ignored(D):
    """The V rows past a short row's end are zeroed in shared memory before P V: NaN padding
    (kv_lengths) and a NaN neighbour row (kv_offsets) reach no other row."""
    lengths = [17, 256, 129, 0, 1, 200, 128, 255]
    U, ratio, S_q, H = len(lengths), 20, 3, 2
    q, kv, k, v, idx, _ = random_problem(61, "kv", U * ratio, U, S_q, H, H, D, 256, torch.bfloat16, device="cuda")
    lens = torch.tensor(lengths, device="cuda")
    for u, n in enumerate(lengths):
        k[u, n:] = NAN
        v[u, n:] = NAN
    out, _, plan = run_with_policy(AttentionPolicy(), q, (k, v), idx, kv_lengths=lens)
    assert not plan.ordered and torch.isfinite(out).all()
    ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_lengths=lens)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)

    q, kv, k, v, idx, offsets = random_jagged_problem(62, "kv", U * ratio, U, S_q, H, H, D, lengths,
                                                      torch.bfloat16, device="cuda")
    bad = 5  # its keys NaN: only its candidates see them
    k[int(offsets[bad]):int(offsets[bad + 1])] = NAN
    v[int(offsets[bad]):int(offsets[bad + 1])] = NAN
    kw = dict(kv_offsets=offsets, max_kv_len=256)
    out, _, plan = run_with_policy(AttentionPolicy(), q, kv, idx, **kw)
    assert not plan.ordered
    mine = (idx == bad).cpu()
    assert out[mine].isnan().all() and torch.isfinite(out[~mine]).all()
    ref = ikbo_fa.attention_reference(q.float(), tuple(t.float() for t in kv), idx, **kw)
    torch.testing.assert_close(out[~mine].float(), ref[~mine], rtol=2e-2, atol=2e-2)
