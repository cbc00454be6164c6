"""GPU tests of the forward kernel's L2 prefetch (``AttentionPolicy.prefetch_blocks``, and
``prefetch_kv_bytes`` for histories of their own lengths): K/V blocks prefetched before the work
list is done change no result, bit for bit, in every split form (none, the workspace split, split
pairs) and over padded, kv_lengths and kv_offsets K/V; K/V written on the stream right before the
call is read new; CUDA-graph replay after new idx, offsets and K/V values.
"""
import pytest
import torch

import ikbo_fa
from attention_inputs import capture_graph, random_jagged_problem, random_problem, run_with_policy, user_groups
from ikbo_fa import AttentionPolicy
from ikbo_fa.config import MAX_PREFETCH_BLOCKS

pytestmark = pytest.mark.gpu
PREFETCH = AttentionPolicy(prefetch_blocks=2)
NAN = float("nan")


# (U, ratio, S_q, L, H, H_kv, D, dtype): a split pair at S_q 1, one round unsplit at S_q 2, the
# workspace split over 8 CTAs (few tiles, long rows), several rounds of the grid with a partial
# last block, grouped heads at D 64 in fp16
SHAPES = [
    (32, 64, 1, 1024, 2, 2, 128, torch.bfloat16),
    (32, 64, 2, 2048, 2, 2, 128, torch.bfloat16),
    (4, 16, 1, 8192, 2, 2, 128, torch.bfloat16),
    (32, 64, 64, 1000, 2, 2, 128, torch.bfloat16),
    (3, 700, 17, 333, 4, 2, 64, torch.float16),
]


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s[:7])))
def test_prefetch_changes_no_result(shape, order):
    U, ratio, S_q, L, H, H_kv, D, dtype = shape
    q, k, v, idx = user_groups(7 + S_q, U, ratio, S_q, L, H, D, order, dtype, H_kv=H_kv)
    base, base_lse, plan0 = run_with_policy(AttentionPolicy(prefetch_blocks=0), q, (k, v), idx)
    assert plan0.prefetch_blocks == 0
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, return_lse=True)
    torch.testing.assert_close(base.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(base_lse, ref_lse, rtol=1e-3, atol=1e-3)
    for blocks in (1, 2, 32):
        out, lse, plan = run_with_policy(AttentionPolicy(prefetch_blocks=blocks), q, (k, v), idx)
        assert plan.prefetch_blocks == blocks and plan.config == plan0.config
        assert torch.equal(out, base) and torch.equal(lse, base_lse), blocks


def test_kv_written_right_before_the_call_is_read_new():
    """K/V written in place on the stream just before the call: the prefetch (issued before the
    kernel waits for the work list) moves lines into L2 only, so the kernel reads the new values."""
    q, k, v, idx = user_groups(11, 32, 64, 1, 1024)
    ikbo_fa.attention(q, (k, v), idx, policy=PREFETCH)  # compiled, the plan kept
    new_k, new_v = torch.randn_like(k), torch.randn_like(v)
    for _ in range(3):
        k.copy_(new_k)
        v.copy_(new_v)
        out = ikbo_fa.attention(q, (k, v), idx, validate=False, policy=PREFETCH)  # no synchronizing check in between
        ref = ikbo_fa.attention_reference(q.float(), (new_k.float(), new_v.float()), idx)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        new_k, new_v = new_v.neg(), new_k * 0.5


def test_graph_replay_with_new_idx_and_kv():
    q, k, v, idx = user_groups(12, 32, 64, 2, 2048, order="shuffled")
    out = torch.full((idx.shape[0], *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
    ikbo_fa.attention(q, (k, v), idx, out=out, policy=PREFETCH)  # compile and plan outside the capture
    graph = capture_graph(lambda: ikbo_fa.attention(q, (k, v), idx, out=out, policy=PREFETCH))
    g = torch.Generator().manual_seed(13)
    for _ in range(2):
        idx.copy_(torch.randint(0, 32, idx.shape, generator=g).cuda())
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype).cuda())
        out.fill_(NAN)
        graph.replay()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


NO_PREFETCH = AttentionPolicy(prefetch_blocks=0, prefetch_kv_bytes=0)


# (U, ratio, S_q, lengths, H, H_kv, D, dtype): short behaviour sequences with a row of no key and
# one of one key (static walk), rows up to 2,000 keys with a split (dynamic walk), grouped heads
# at D 64 in fp16 and 10,000 candidates of one user
JAGGED = [
    (64, 32, 1, [0, 1] + [37 + 3 * i for i in range(62)], 4, 4, 64, torch.bfloat16),
    (8, 16, 4, [2000, 1, 0, 700, 129, 1500, 64, 1999], 2, 2, 128, torch.bfloat16),
    (3, 50, 3, [300, 17, 255], 4, 2, 64, torch.float16),
    (1, 10000, 1, [160], 2, 2, 128, torch.bfloat16),
]


@pytest.mark.parametrize("layout", ["kv_offsets", "kv_lengths"])
@pytest.mark.parametrize("shape", JAGGED, ids=lambda s: f"U{s[0]}-r{s[1]}-sq{s[2]}-max{max(s[3])}-D{s[6]}")
def test_row_prefetch_changes_no_result(shape, layout):
    """Histories of their own lengths: each row's first blocks (read from kv_lengths / kv_offsets
    before the work list is done), as many as the grid's lanes reach (the default, for K/V this
    small) and two a CTA, against none, bit for bit, and against fp32."""
    U, ratio, S_q, lengths, H, H_kv, D, dtype = shape
    B = U * ratio
    if layout == "kv_offsets":
        q, kv, k, v, idx, offsets = random_jagged_problem(21 + S_q, "kv", B, U, S_q, H, H_kv, D, lengths, dtype,
                                                          device="cuda")
        kw = dict(kv_offsets=offsets, max_kv_len=max(lengths))
    else:
        L = max(lengths)
        q, kv, k, v, idx, _ = random_problem(23 + S_q, "kv", B, U, S_q, H, H_kv, D, L, dtype, device="cuda")
        kw = dict(kv_lengths=torch.tensor(lengths, device="cuda"))
    base, base_lse, plan0 = run_with_policy(NO_PREFETCH, q, kv, idx, **kw)
    assert plan0.prefetch_blocks == 0
    for policy, blocks in ((AttentionPolicy(), MAX_PREFETCH_BLOCKS), (AttentionPolicy(prefetch_kv_bytes=0), 2)):
        out, lse, plan = run_with_policy(policy, q, kv, idx, **kw)
        assert plan.prefetch_blocks == blocks and plan.config == plan0.config
        assert torch.equal(out, base) and torch.equal(lse, base_lse)
    ref, ref_lse = ikbo_fa.attention_reference(q.float(), tuple(t.float() for t in kv), idx, return_lse=True, **kw)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_row_prefetch_graph_replay_with_new_offsets_and_kv():
    """One capture; new kv_offsets (the same keys cut into other rows), idx and K values written in
    place before each replay: the prefetch reads the offsets and K/V the replay finds."""
    lengths = [100, 0, 256, 31, 200, 1]
    q, kv, k, v, idx, offsets = random_jagged_problem(31, "kv", 240, 6, 2, 4, 4, 64, lengths, torch.bfloat16,
                                                      device="cuda")
    total = int(offsets[-1])
    kw = dict(max_kv_len=total)  # any cut of the keys below keeps its rows within it
    out = torch.full((idx.shape[0], *q.shape[1:]), NAN, dtype=q.dtype, device=q.device)
    ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, out=out, **kw)  # compile and plan outside the capture
    assert ikbo_fa_attention_plan(q, kv, idx, offsets, out, kw).prefetch_blocks == MAX_PREFETCH_BLOCKS
    graph = capture_graph(lambda: ikbo_fa.attention(q, kv, idx, kv_offsets=offsets, out=out, validate=False, **kw))
    g = torch.Generator().manual_seed(32)
    for _ in range(2):
        cuts = torch.randint(0, total + 1, (5,), generator=g).sort().values
        offsets.copy_(torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(offsets))
        idx.copy_(torch.randint(0, 6, idx.shape, generator=g).to(idx))
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype).cuda())
        out.fill_(NAN)
        graph.replay()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx, kv_offsets=offsets, **kw)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def ikbo_fa_attention_plan(q, kv, idx, offsets, out, kw):
    import importlib

    return importlib.import_module("ikbo_fa.attention").launch_plan(q, kv, idx, kv_offsets=offsets, out=out, **kw)
