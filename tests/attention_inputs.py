"""Random attention problems shared by the CPU and GPU attention tests."""
import torch


def random_problem(seed, direction, B, U, S_q, H, H_kv, D, L, dtype, *, packed=False, jagged=False,
                   sort=False, device="cpu"):
    """q, kv (packed tensor or (k, v)), k, v, idx (int64, every user used), kv_lengths or None.

    ``direction`` "kv": q per candidate [B, ...], K/V per user [U, ...]; "q": the reverse.
    Jagged lengths include a length of 0 (first row) and the full L (last row)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, U, (B,), generator=g)
    idx[torch.randperm(B, generator=g)[: min(B, U)]] = torch.arange(min(B, U))  # every user appears
    if sort:
        idx = idx.sort().values
    n_q, n_kv = (B, U) if direction == "kv" else (U, B)
    q = torch.randn(n_q, S_q, H, D, generator=g).to(dtype=dtype, device=device)
    if packed:
        kv = torch.randn(n_kv, L, 2, H_kv, D, generator=g).to(dtype=dtype, device=device)
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        k = torch.randn(n_kv, L, H_kv, D, generator=g).to(dtype=dtype, device=device)
        v = torch.randn(n_kv, L, H_kv, D, generator=g).to(dtype=dtype, device=device)
        kv = (k, v)
    lengths = None
    if jagged:
        lengths = torch.randint(0, L + 1, (n_kv,), generator=g)
        lengths[0] = 0
        lengths[-1] = L
        lengths = lengths.to(device)
    return q, kv, k, v, idx.to(device), lengths


def materialize(q, k, v, idx, direction, lengths):
    """Per-candidate q, k, v and lengths: the broadcast side gathered with idx."""
    idx = idx.long()
    if direction == "kv":
        return q, k[idx], v[idx], (None if lengths is None else lengths[idx])
    return q[idx], k, v, lengths


def random_jagged_problem(seed, direction, B, U, S_q, H, H_kv, D, lengths, dtype, *, packed=False,
                          offsets_dtype=torch.int32, device="cpu"):
    """q, kv (packed [total_L, 2, H_kv, D] or (k, v) [total_L, H_kv, D]), k, v, idx (int64, every
    user used, in random order), kv_offsets [R + 1] of ``offsets_dtype``.

    ``lengths`` gives each K/V row's keys: R = U entries for direction "kv", B for "q"."""
    n_q, n_kv = (B, U) if direction == "kv" else (U, B)
    lengths = [int(n) for n in lengths]
    assert len(lengths) == n_kv, (len(lengths), n_kv)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, U, (B,), generator=g)
    idx[torch.randperm(B, generator=g)[: min(B, U)]] = torch.arange(min(B, U))  # every user appears
    offsets = torch.tensor([0] + lengths).cumsum(0)
    total = int(offsets[-1])
    q = torch.randn(n_q, S_q, H, D, generator=g).to(dtype=dtype, device=device)
    if packed:
        kv = torch.randn(total, 2, H_kv, D, generator=g).to(dtype=dtype, device=device)
        k, v = kv[:, 0], kv[:, 1]
    else:
        k = torch.randn(total, H_kv, D, generator=g).to(dtype=dtype, device=device)
        v = torch.randn(total, H_kv, D, generator=g).to(dtype=dtype, device=device)
        kv = (k, v)
    return q, kv, k, v, idx.to(device), offsets.to(dtype=offsets_dtype, device=device)


def jagged_to_padded(k, v, kv_offsets, fill=float("nan")):
    """Jagged k, v [total_L, H_kv, D] with (valid) kv_offsets [R + 1] as the padded layout:
    k, v [R, L, H_kv, D] (L the longest row, at least 1) with every key past a row's length set
    to ``fill`` (NaN: a result that is finite read none of it), and kv_lengths [R] (int64)."""
    off = kv_offsets.long().cpu()
    lengths = off[1:] - off[:-1]
    assert int(off[0]) == 0 and bool((lengths >= 0).all()) and int(off[-1]) <= k.shape[0]
    R, L = len(lengths), max(1, int(lengths.max()))
    k_pad = k.new_full((R, L, *k.shape[1:]), fill)
    v_pad = v.new_full((R, L, *v.shape[1:]), fill)
    for r in range(R):
        a, b = int(off[r]), int(off[r + 1])
        k_pad[r, : b - a] = k[a:b]
        v_pad[r, : b - a] = v[a:b]
    return k_pad, v_pad, lengths.to(k.device)


def assert_nan_rows_only(out, lse, bad):
    """Rows ``bad`` (out-of-range indices) are NaN in out and lse; no other row is."""
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[~bad].isnan().any() and not lse[~bad].isnan().any()


def fp32_attention(q, k, v, idx, direction="kv", lengths=None):
    """fp32 attention on the materialized problem -> (out [B, S_q, H, D], lse [B, H, S_q]); keys past a
    row's length masked, rows of no key 0."""
    import math

    qm, km, vm, lm = materialize(q, k, v, idx, direction, lengths)
    group = q.shape[2] // k.shape[2]
    qf = qm.float().transpose(1, 2)
    kf = km.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = vm.float().repeat_interleave(group, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if lm is not None:
        keep = torch.arange(km.shape[1], device=q.device)[None, :] < lm[:, None]
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ vf).transpose(1, 2), torch.logsumexp(s, dim=-1)


def check_graph_replay(policy, q, kv, k, v, idx, n_users):
    """KV broadcast under ``policy``, captured in a CUDA graph: each replay after new idx written in
    place (and out poisoned) matches fp32 attention."""
    import ikbo_fa

    out = torch.full_like(q, float("nan"))
    ikbo_fa.attention(q, kv, idx, out=out, policy=policy)
    graph = capture_graph(lambda: ikbo_fa.attention(q, kv, idx, out=out, policy=policy))
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        idx.copy_(torch.randint(0, n_users, (idx.shape[0],), generator=g).to(idx.device))
        out.fill_(float("nan"))
        graph.replay()
        ref, _ = fp32_attention(q, k, v, idx)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def check_nan_isolation(policy, q, kv, k, v, idx, nan_rows, nan_key, bad_rows):
    """KV broadcast under ``policy``: a NaN in query row (b, 3, head 1) for each b of ``nan_rows``
    changes that row only, bit for bit elsewhere; a NaN key of user 1 at key ``nan_key`` makes its
    candidates NaN, no other; the candidates ``bad_rows`` given out-of-range users (U and -1)
    get NaN rows in out and lse, no other."""
    import ikbo_fa

    clean = ikbo_fa.attention(q, kv, idx, policy=policy)
    for b in nan_rows:
        q_nan = q.clone()
        q_nan[b, 3, 1, 10] = float("nan")
        o = ikbo_fa.attention(q_nan, kv, idx, policy=policy)
        other = torch.ones_like(o, dtype=torch.bool)
        other[b, 3, 1] = False
        assert torch.equal(o[other], clean[other]) and not torch.equal(o[b, 3, 1], clean[b, 3, 1])
    k_nan = k.clone()
    k_nan[1, nan_key, 0, 3] = float("nan")
    o = ikbo_fa.attention(q, (k_nan, v), idx, policy=policy)
    assert o[idx == 1].isnan().all() and not o[idx != 1].isnan().any()
    bad_idx = idx.clone()
    bad_idx[bad_rows[0]], bad_idx[bad_rows[1]] = k.shape[0], -1
    out = torch.full_like(q, float("nan"))
    _, lse = ikbo_fa.attention(q, kv, bad_idx, out=out, return_lse=True, validate=False, policy=policy)
    bad = torch.zeros(idx.shape[0], dtype=torch.bool, device=q.device)
    bad[list(bad_rows)] = True
    assert_nan_rows_only(out, lse, bad)


def check_scores_jump(policy, factor, B, seed=None):
    """KV broadcast at D 64, S_q 64 under ``policy``, keys 100:250 of every user scaled by ``factor``
    (H_kv = H): blocks run from the last keys to the first, so the row max jumps in a later block
    (factor 4: rescaled in the loop; 60: past float32's range, rows recomputed exactly). Out is
    within 1.5x SDPA's error of fp32, lse within 1e-4. Returns the call's plan."""
    q, kv, k, v, idx, _ = random_problem(int(factor) if seed is None else seed, "kv", B, 3, 64, 2, 2, 64, 1000,
                                         torch.bfloat16, device="cuda")
    k[:, 100:250] *= factor
    out, lse, plan = run_with_policy(policy, q, (k, v), idx)
    ref, ref_lse = fp32_attention(q, k, v, idx, "kv", None)
    assert not out.isnan().any()
    qm, km, vm, _ = materialize(q, k, v, idx, "kv", None)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        qm.transpose(1, 2), km.transpose(1, 2), vm.transpose(1, 2)).transpose(1, 2)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    sdpa_err = ((sdpa.float() - ref).norm() / ref.norm()).item()
    assert err <= 1.5 * sdpa_err + 1e-6, (err, sdpa_err)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    return plan


def user_groups(seed, U, ratio, S_q, L, H=2, D=128, order="sorted", dtype=torch.bfloat16, H_kv=None):
    """KV broadcast on the GPU: U users of ``ratio`` candidates each, idx sorted or shuffled ->
    (q [U * ratio, S_q, H, D], k, v [U, L, H_kv, D], idx int64)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(U).repeat_interleave(ratio)
    if order == "shuffled":
        idx = idx[torch.randperm(idx.shape[0], generator=g)]
    q = torch.randn(idx.shape[0], S_q, H, D, generator=g).to(dtype).cuda()
    k, v = (torch.randn(U, L, H_kv or H, D, generator=g).to(dtype).cuda() for _ in range(2))
    return q, k, v, idx.cuda()


def run_with_policy(policy, q, kv, idx, **kw):
    """``ikbo_fa.attention`` with launch policy ``policy`` (an ``ikbo_fa.AttentionPolicy``) -> (out,
    lse, the call's plan); out poisoned with NaN before the call."""
    import importlib

    import ikbo_fa

    module = importlib.import_module("ikbo_fa.attention")
    out = torch.full((idx.shape[0], *q.shape[1:]), float("nan"), dtype=q.dtype, device=q.device)
    _, lse = ikbo_fa.attention(q, kv, idx, out=out, return_lse=True, validate=False, policy=policy, **kw)
    plan = module.launch_plan(q, kv, idx, out=out, return_lse=True, policy=policy, **kw)
    return out, lse, plan


def capture_graph(fn):
    """A CUDA graph of ``fn()`` captured on a side stream (the caller compiles and plans first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph
