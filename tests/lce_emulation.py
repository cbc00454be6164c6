"""The GPU path of ``ikbo_gemm.lce`` on CPU tensors: its host side runs as on an H200, the
compiled kernel replaced by a stand-in that checks what it receives and writes the result."""
from __future__ import annotations

import importlib

import torch

from ikbo_gemm.lce_sm90 import LceEpilogue, LceLaunch, LceOperands

lce_mod = importlib.import_module("ikbo_gemm.lce")  # the module (the package exports the op under its name)


def h200_clusters(device, size):
    """Clusters of ``size`` CTAs resident at once on an H200 (132 SMs; 8-CTA clusters on 120)."""
    return 132 // size if size < 4 else 120 // size


class EmulatedLaunches:
    """Stands in for the compiled kernel on CPU tensors: each launch writes its candidates'
    outputs (when its tile range reaches the candidate tiles) by the reference formula on
    the padded operands it receives, and is recorded (``launches``). Each callable in ``hooks``
    is called at every launch with the kernel's name."""

    def __init__(self):
        self.launches = []
        self.hooks = []
        self.refuse_cooperative = False

    def kernel(self, cfg):
        return lambda *args: self.launch(cfg, *args)

    def launch(self, cfg, operands: LceOperands, epilogue: LceEpilogue, launch: LceLaunch):
        assert isinstance(operands, LceOperands) and isinstance(epilogue, LceEpilogue) and isinstance(launch, LceLaunch)
        w_c, w_u, e_c, e_u, idx = operands
        target, workspace, flags, *scales = epilogue
        fp8 = cfg.dtype == torch.float8_e4m3fn
        tile_begin, tile_end, grid, wait_prior, cooperative = launch
        for hook in self.hooks:
            hook("lce")
        if cooperative and self.refuse_cooperative:  # as the driver does where the grid cannot fit
            raise RuntimeError("cudaErrorCooperativeLaunchTooLarge")
        U, M, n8 = e_u.shape[0], w_c.shape[1], target.shape[2]
        k_align = 16 if fp8 else 8  # 16-byte row pitches
        assert w_c.shape[0] == w_u.shape[0] == 1
        assert n8 % 8 == 0 and target.dtype == (cfg.out_dtype or cfg.dtype)
        for t in (w_c, w_u, e_c, e_u):
            assert t.dtype == cfg.dtype
        for t in (w_c, w_u, e_c, e_u, target):  # what the TMA descriptors need, size-1 dims included
            assert t.data_ptr() % 16 == 0 and (t.is_contiguous() or (fp8 and t.dim() == 3 and t is not target))
            assert t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]), t.stride()
        if fp8:  # e K-major [B, N, K] (rows 16-byte pitched; TMA reads zeros past K, so w may be padded
            # further); one fp32 scale per row of w and batch entry of e
            assert e_c.shape[1] == e_u.shape[1] <= n8
            assert all(-(-e.shape[2] // k_align) == -(-w.shape[2] // k_align) for e, w in ((e_c, w_c), (e_u, w_u)))
            sw_c, sw_u, se_c, se_u = scales
            for t, n in ((sw_c, M), (sw_u, M), (se_c, idx.shape[0]), (se_u, U)):
                assert t.dtype == torch.float32 and t.shape == (n,) and t.is_contiguous()
        else:
            assert all(t is None for t in scales) and e_c.shape[2] == e_u.shape[2] == n8
        assert workspace.dtype == torch.float32 and flags.dtype == torch.int32
        assert workspace.shape == (flags.shape[0], cfg.tile_n * cfg.tile_w)
        user_tiles = -(-U // cfg.cluster_b) * -(-M // cfg.tile_w) * -(-n8 // (cfg.tile_n * cfg.cluster_n))
        self.launches.append(dict(cfg=cfg, cands=idx.shape[0], tiles=(tile_begin, tile_end), wait_prior=wait_prior,
                                  cooperative=cooperative, target=target.data_ptr(), flags=flags.shape[0],
                                  e_cand=e_c.data_ptr()))
        if tile_end > user_tiles and fp8:  # the scaled sums; N past e's rows is zeros
            kc, ku = min(e_c.shape[2], w_c.shape[2]), min(e_u.shape[2], w_u.shape[2])  # past that: zeros
            acc = (w_c[0, :, :kc].float() @ e_c[..., :kc].float().transpose(1, 2)) * sw_c[:, None] * se_c[:, None, None]
            user = (w_u[0, :, :ku].float() @ e_u[..., :ku].float().transpose(1, 2)) * sw_u[:, None] * se_u[:, None, None]
            acc, user = (torch.nn.functional.pad(t, (0, n8 - t.shape[2])) for t in (acc, user))
        elif tile_end > user_tiles:
            acc = w_c[0, :, : e_c.shape[1]].float() @ e_c.float()  # the K tail past e's rows is padding
            user = w_u[0, :, : e_u.shape[1]].float() @ e_u.float()
        if tile_end > user_tiles:
            valid = (idx >= 0) & (idx < U)
            acc += user[torch.where(valid, idx, 0).long()]
            acc[~valid] = float("nan")
            target.data.copy_(acc)  # through the pointer, as the kernel: autograd sees no write


def install(monkeypatch) -> EmulatedLaunches:
    """Route ``ikbo_gemm.lce`` on CPU tensors through its GPU path, with the kernel emulated."""
    kernels = EmulatedLaunches()
    monkeypatch.setattr(lce_mod, "on_gpu", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setattr(lce_mod, "require_sm90", lambda device, op: None)
    monkeypatch.setattr(lce_mod, "max_active_clusters", h200_clusters)
    monkeypatch.setattr(lce_mod, "_kernel", kernels.kernel)
    return kernels
