"""GPU tests of the forward kernel's L2 prefetch (``AttentionPolicy.prefetch_blocks``): K/V blocks prefetched
before the work list is done change no result, bit for bit, in every split form (none, the
workspace split, split pairs); K/V written on the stream right before the call is read new;
CUDA-graph replay after new idx and K/V values.
"""
import pytest
import torch

import ikbo_fa
from attention_inputs import run_with_policy, user_groups
from ikbo_fa import AttentionPolicy

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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        ikbo_fa.attention(q, (k, v), idx, out=out, policy=PREFETCH)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.Generator().manual_seed(13)
    for _ in range(2):
        idx.copy_(torch.randint(0, 32, idx.shape, generator=g).cuda())
        k.copy_(torch.randn(k.shape, generator=g).to(k.dtype).cuda())
        out.fill_(NAN)
        graph.replay()
        ref = ikbo_fa.attention_reference(q.float(), (k.float(), v.float()), idx)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
