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
