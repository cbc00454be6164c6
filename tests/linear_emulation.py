"""The GPU path of ``ikbo_gemm.linear`` on CPU tensors: its host side runs as on an H200, the
compiled kernel (both phases) replaced by a stand-in that checks what it receives and writes
what the kernel writes."""
from __future__ import annotations

import importlib

import torch

from ikbo_gemm.linear_sm90 import LinearEpilogue, LinearLaunch, LinearOperands
from ikbo_gemm.reference import apply_activation
from lce_emulation import h200_clusters

linear_mod = importlib.import_module("ikbo_gemm.linear")  # the module (the package exports the op under its name)

H200_SMS = 132
TILE_K = 64  # LinearSm90.TILE_K: the user phase splits K in whole k-blocks


class EmulatedLaunches:
    """Stands in for the compiled kernel on CPU tensors. The user phase writes x_user @ w_user.T
    into the fp32 workspace, one slab per slice of K; the candidate phase adds each row's user
    result from those slabs (in order), the bias and the activation in fp32, and rounds once into
    its target (a NaN row for an index outside [0, U)). Launches are recorded (``launches``);
    each callable in ``hooks`` is called at every launch with the kernel's name."""

    def __init__(self):
        self.launches = []
        self.hooks = []

    def kernel(self, cfg):
        return lambda *args: self.launch(cfg, *args)

    def launch(self, cfg, operands: LinearOperands, epilogue: LinearEpilogue, launch: LinearLaunch):
        assert isinstance(operands, LinearOperands) and isinstance(epilogue, LinearEpilogue)
        assert isinstance(launch, LinearLaunch)
        (a, b, idx), (out, ws, bias, a_scale, b_scale), (n_users, n_splits, grid, band_rows) = operands, epilogue, launch
        for hook in self.hooks:
            hook(f"linear-{cfg.phase}")
        fp8 = cfg.dtype == torch.float8_e4m3fn
        tile_k = 2 * TILE_K if fp8 else TILE_K  # FP8 k-blocks: 128 elements
        tma = (a, b) if cfg.phase == "user" else (a, b, out)
        for t in tma:  # what the TMA descriptors need, size-1 dims included (a and b: rows 16-byte pitched)
            assert t.dtype == (cfg.out_dtype or cfg.dtype if t is out else cfg.dtype)
            assert t.data_ptr() % 16 == 0 and (t.is_contiguous() or t is not out)
            assert t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]), t.stride()
        k_align = 16 // a.element_size()  # TMA reads zeros past K: one operand may be padded further
        assert -(-a.shape[1] // k_align) == -(-b.shape[1] // k_align)
        K = min(a.shape[1], b.shape[1])
        a, b = a[:, :K], b[:, :K]
        # FP8: a's and b's row scales (the result's rows and columns); the bias in fp32
        assert (a_scale is not None) == (b_scale is not None) == fp8
        for scale, rows in ((a_scale, a.shape[0]), (b_scale, b.shape[0])):
            assert scale is None or (scale.dtype == torch.float32 and scale.is_contiguous() and scale.shape == (rows,))
        assert not fp8 or bias is None or bias.dtype == torch.float32
        assert ws.dtype == torch.float32 and ws.is_contiguous() and ws.data_ptr() % 16 == 0
        assert ws.shape[0] == n_splits >= 1 and ws.shape[1] >= n_users and ws.shape[2] >= b.shape[0]
        assert idx.dtype == cfg.idx_dtype and idx.is_contiguous()
        assert (bias is not None) == cfg.has_bias
        assert 0 < grid <= H200_SMS and grid % cfg.cluster == 0
        assert band_rows >= 1 and (band_rows == 1 or cfg.banded)  # the walk's order: not the result's
        if cfg.split_k > 1:  # a K-split cluster: every CTA's slice has a k-block, the user phase one slab
            k_blocks = -(-a.shape[1] // tile_k)
            assert (cfg.split_k - 1) * -(-k_blocks // cfg.split_k) < k_blocks
            assert cfg.phase == "cand" or n_splits == 1
        self.launches.append(dict(cfg=cfg, rows=a.shape[0], splits=n_splits, grid=grid, target=out.data_ptr(),
                                  a=a.data_ptr(), band_rows=band_rows))
        N = b.shape[0]
        if cfg.phase == "user":
            assert out is ws and a.shape[0] == n_users
            k_blocks = -(-a.shape[1] // tile_k)
            per_split = -(-k_blocks // n_splits)
            assert (n_splits - 1) * per_split < k_blocks  # every slice has a k-block
            for s in range(n_splits):
                k = slice(s * per_split * tile_k, (s + 1) * per_split * tile_k)
                ws[s, :n_users, :N] = self.scaled(a[:, k].float() @ b[:, k].float().T, a_scale, b_scale)
            return
        assert n_splits == ws.shape[0] and out.shape == (a.shape[0], -(-N // 8) * 8)
        assert bias is None or (bias.is_contiguous() and bias.shape == (N,))
        valid = (idx >= 0) & (idx < n_users)  # in idx's own width: an int64 must not wrap
        users = torch.where(valid, idx, torch.zeros_like(idx)).long()
        acc = self.scaled(a.float() @ b.float().T, a_scale, b_scale)
        for s in range(n_splits):  # the slabs in order
            acc += ws[s, :, :N].index_select(0, users)
        if bias is not None:
            acc += bias.float()
        acc = apply_activation(acc, cfg.activation)
        acc[~valid] = float("nan")
        out.data[:, :N].copy_(acc)  # through the pointer, as the kernel: autograd sees no write


    @staticmethod
    def scaled(acc, row_scale=None, col_scale=None):
        """FP8: sums times their rows' and columns' scales (where given)."""
        if row_scale is not None:
            acc = acc * row_scale[:, None]
        return acc if col_scale is None else acc * col_scale[None, :]


def install(monkeypatch) -> EmulatedLaunches:
    """Route ``ikbo_gemm.linear`` on CPU tensors through its GPU path, with the kernel emulated."""
    kernels = EmulatedLaunches()
    monkeypatch.setattr(linear_mod, "on_gpu", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setattr(linear_mod, "require_sm90", lambda device, op: None)
    monkeypatch.setattr(linear_mod, "sm_count", lambda device: H200_SMS)
    monkeypatch.setattr(linear_mod, "max_active_clusters", h200_clusters)
    monkeypatch.setattr(linear_mod, "_kernel", kernels.kernel)
    return kernels
