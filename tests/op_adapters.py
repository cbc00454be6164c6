"""One adapter per op (lce, linear, attention) for the op-contract suite: make a random problem,
call the op, call its reference, and the op-specific names the shared tests need.

A ``Case`` is one call: the op's arguments by name, the input tensors by the names the op's
messages give them, and the result's shape. The adapters give CPU problems of a small shape and
GPU problems of a shape the kernels are tuned for.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

import ikbo_fa
import ikbo_gemm
from ikbo_gemm.config import LINEAR_SHIPPED_CONFIGS
from attention_inputs import random_problem as attention_problem
from lce_accuracy import UNIT_ROUNDOFF
from lce_inputs import random_problem as lce_problem
from linear_inputs import fp32_linear
from linear_inputs import random_problem as linear_problem


@dataclasses.dataclass
class Case:
    args: dict  # the op's arguments by name
    inputs: dict  # name in the op's messages -> input tensor
    out_shape: tuple
    dtype: torch.dtype
    device: torch.device
    users: int  # U: the batch that idx looks up; idx values must lie in [0, U)


def size1_unit_strides(t: torch.Tensor) -> torch.Tensor:
    """The same values, every size-1 dimension given a stride of one element (torch still calls
    the tensor contiguous; a dense layout would give those dimensions the stride of the next)."""
    ones = [d for d in range(t.dim()) if t.shape[d] == 1]
    order = [d for d in range(t.dim()) if t.shape[d] != 1] + ones
    buf = torch.empty([t.shape[d] for d in order], dtype=t.dtype, device=t.device)
    return buf.permute([order.index(d) for d in range(t.dim())]).copy_(t)


def has_odd_size1_stride(t: torch.Tensor) -> bool:
    """Whether a size-1 dimension of ``t`` has a stride other than the dense one."""
    inner = 1
    for d in range(t.dim() - 1, -1, -1):
        if t.shape[d] == 1 and t.stride(d) != inner:
            return True
        inner *= t.shape[d]
    return False


def poisoned(case: Case) -> torch.Tensor:
    """An output buffer of the case's result, all NaN."""
    return torch.full(case.out_shape, float("nan"), dtype=case.dtype, device=case.device)


def with_odd_size1_strides(op, case: Case) -> tuple[Case, torch.Tensor]:
    """The case with every floating input, and a poisoned out, given unit strides on their
    size-1 dims: still contiguous to torch, but not the dense strides."""
    odd = case
    for name, t in case.inputs.items():
        if t.dtype.is_floating_point:
            odd = op.with_input(odd, name, size1_unit_strides(t))
    assert all(t.is_contiguous() for t in odd.inputs.values())
    assert any(has_odd_size1_stride(t) for t in odd.inputs.values())
    out = size1_unit_strides(poisoned(case))
    assert out.is_contiguous() and has_odd_size1_stride(out)
    return odd, out


class _Adapter:
    """What the adapters do alike; ``op`` and ``reference`` are the subclass's."""

    compile_name = "compile_config"  # the op module's function that compiles a configuration

    def call(self, case: Case, **kw):
        return self.op(**case.args, **kw)

    def expected(self, case: Case, **kw):
        return self.reference(**case.args, **kw)


class _GemmAdapter(_Adapter):
    """What the two GEMM ops' adapters share: a case rebuilt from its arguments, the emulation
    module (``emulation``) that records each launch and its store target, two shipped
    configurations (``shipped``) and the op's kernel cache."""

    emulation = ""  # the module whose install() emulates the op's kernel on CPU tensors
    users_input = ""  # the input whose batch idx looks up
    shipped = ()

    def with_input(self, case: Case, name: str, t: torch.Tensor) -> Case:
        return self._case({**case.args, name: t})

    def without_users(self, case: Case) -> Case:
        """The batch that idx looks up made empty."""
        return self.with_input(case, self.users_input, case.args[self.users_input][:0])

    @staticmethod
    def output(result):
        return result

    def emulate(self, monkeypatch):
        return importlib.import_module(self.emulation).install(monkeypatch)

    @staticmethod
    def launches(emulation) -> int:
        return len(emulation.launches)

    @staticmethod
    def stored_to(emulation) -> int:
        """The address the last launch stored its output to."""
        return emulation.launches[-1]["target"]

    def configs(self):
        """Two configurations of the kernel."""
        return self.shipped[0], self.shipped[1]

    def kernel_for(self, cfg):
        """Look the kernel of ``cfg`` up as the op does."""
        return self.module._kernel(cfg)


class LceAdapter(_GemmAdapter):
    name = "lce"
    module = importlib.import_module("ikbo_gemm.lce")
    package = "ikbo_gemm"
    op = staticmethod(ikbo_gemm.lce)
    reference = staticmethod(ikbo_gemm.lce_reference)
    op_name, reference_name = "ikbo_gemm.lce", "ikbo_gemm.lce_reference"
    looked_up = "the batch of e_user"  # what U is, in the range message
    emulation, users_input, shipped = "lce_emulation", "e_user", ikbo_gemm.SHIPPED_CONFIGS
    compile_name = "compile_lce_config"
    empty_side = "e_user must not be empty"
    grad_input = "w_cand"
    # Options the shared tests run under (each a set of keyword arguments).
    options = ({"schedule": "fused"}, {"schedule": "two_launch"})
    tolerance = dict(rtol=0, atol=0)  # the emulated kernel computes as the reference does
    cpu_dims = dict(B=64, U=5, M=433, N=256, K_user=7, K_cand=9)  # an H200 splits it over two launches
    gpu_dims = dict(B=256, U=26, M=433, N=256, K_user=1184, K_cand=872)
    kernels_per_call = 2  # at gpu_dims: the fused grid and the second launch on the spare SMs

    def case(self, seed, *, device="cpu", dtype=torch.float16, idx_dtype=torch.int32, **dims) -> Case:
        sizes = {**(self.cpu_dims if torch.device(device).type == "cpu" else self.gpu_dims), **dims}
        p = lce_problem(sizes["B"], sizes["U"], sizes["M"], sizes["N"], sizes["K_user"], sizes["K_cand"], dtype,
                        idx_dtype, "shuffled", seed, device)
        return self._case(p._asdict())

    def size1_case(self, seed, *, device="cpu") -> Case:
        """B = U = M = 1."""
        dims = dict(N=16, K_user=24, K_cand=16) if torch.device(device).type == "cpu" else dict(
            N=256, K_user=200, K_cand=136)
        return self.case(seed, device=device, B=1, U=1, M=1, **dims)

    def _case(self, args: dict) -> Case:
        B, M, N = args["e_cand"].shape[0], args["w_cand"].shape[0], args["e_cand"].shape[2]
        return Case(args=args, inputs=dict(args), out_shape=(B, M, N), dtype=args["e_cand"].dtype,
                    device=args["e_cand"].device, users=args["e_user"].shape[0])

    def check_gpu_result(self, out, case: Case):
        from lce_accuracy import assert_matches_reference

        assert_matches_reference(out, case.args)


class LinearAdapter(_GemmAdapter):
    name = "linear"
    module = importlib.import_module("ikbo_gemm.linear")
    package = "ikbo_gemm"
    op = staticmethod(ikbo_gemm.linear)
    reference = staticmethod(ikbo_gemm.linear_reference)
    op_name, reference_name = "ikbo_gemm.linear", "ikbo_gemm.linear_reference"
    compile_name = "compile_linear_config"
    looked_up = "the batch of x_user"
    emulation, users_input, shipped = "linear_emulation", "x_user", LINEAR_SHIPPED_CONFIGS
    empty_side = "x_user must not be empty"
    grad_input = "w_user"
    # The activation changes the result, which check_gpu_result could not tell: it is the case's.
    options = ({},)
    # The emulation sums the user GEMM's K slices in fp32: the result may round one ulp apart.
    tolerance = dict(rtol=2.0**-7, atol=1e-4)
    # K not a multiple of 8 (both pad), two K slices of the user phase, 2-CTA clusters.
    cpu_dims = dict(B=150, U=5, N=24, K_user=196, K_cand=36)
    gpu_dims = dict(B=1500, U=15, N=512, K_user=256, K_cand=320)
    kernels_per_call = 2  # the user phase and the candidate phase

    def case(self, seed, *, device="cpu", dtype=torch.bfloat16, idx_dtype=torch.int32, activation="silu",
             **dims) -> Case:
        s = {**(self.cpu_dims if torch.device(device).type == "cpu" else self.gpu_dims), **dims}
        p = linear_problem(s["B"], s["U"], s["N"], s["K_user"], s["K_cand"], dtype, idx_dtype, seed, device)
        return self._case({**p._asdict(), "activation": activation})

    def size1_case(self, seed, *, device="cpu") -> Case:
        """B = U = 1; K and N multiples of 8, so the kernel reads the inputs and stores into out
        as they are."""
        dims = dict(N=16, K_user=24, K_cand=16) if torch.device(device).type == "cpu" else dict(
            N=256, K_user=200, K_cand=136)
        return self.case(seed, device=device, B=1, U=1, **dims)

    def _case(self, args: dict) -> Case:
        inputs = {k: t for k, t in args.items() if isinstance(t, torch.Tensor)}
        x_cand = args["x_cand"]
        return Case(args=args, inputs=inputs, out_shape=(x_cand.shape[0], args["w_cand"].shape[0]),
                    dtype=x_cand.dtype, device=x_cand.device, users=args["x_user"].shape[0])

    def check_gpu_result(self, out, case: Case):
        ref = fp32_linear(**case.args)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        # One rounding costs u * |x|; the slack covers fp32 accumulation order (and the activation).
        bound = UNIT_ROUNDOFF[case.dtype] * ref.abs() + 2.0**-13 * ref.abs().max() + 1e-6
        bad = ~((out.float() - ref).abs() <= bound)
        assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs off"


class AttentionAdapter(_Adapter):
    name = "attention"
    module = importlib.import_module("ikbo_fa.attention")
    package = "ikbo_fa"
    op = staticmethod(ikbo_fa.attention)
    reference = staticmethod(ikbo_fa.attention_reference)
    op_name, reference_name = "ikbo_fa.attention", "ikbo_fa.attention_reference"
    looked_up = "the batch of k and v"
    empty_side = "k/v must not be empty"
    grad_input = "k"
    options = ({}, {"return_lse": True})
    tolerance = dict(rtol=1e-2, atol=1e-2)  # the emulated kernel: naive attention in fp32
    cpu_dims = dict(B=11, U=3, S_q=3, H=2, H_kv=1, D=64, L=9, jagged=True)
    gpu_dims = dict(B=256, U=4, S_q=64, H=2, H_kv=2, D=128, L=300, jagged=False)
    kernels_per_call = 2  # the work list and the forward kernel

    def case(self, seed, *, device="cpu", dtype=torch.bfloat16, idx_dtype=torch.int64, **dims) -> Case:
        s = {**(self.cpu_dims if torch.device(device).type == "cpu" else self.gpu_dims), **dims}
        q, _, k, v, idx, lengths = attention_problem(seed, "kv", s["B"], s["U"], s["S_q"], s["H"], s["H_kv"], s["D"],
                                                     s["L"], dtype, jagged=s["jagged"], device=device)
        args = dict(q=q, kv=(k, v), idx=idx.to(idx_dtype), kv_lengths=lengths)
        if s["B"] == s["U"]:
            args["broadcast"] = "kv"
        return self._case(args)

    def size1_case(self, seed, *, device="cpu") -> Case:
        """B = U = S_q = H_kv = 1."""
        dims = dict(L=9) if torch.device(device).type == "cpu" else dict(D=128, L=300)
        return self.case(seed, device=device, B=1, U=1, S_q=1, H=2, H_kv=1, jagged=False, **dims)

    def _case(self, args: dict) -> Case:
        q, (k, v) = args["q"], args["kv"]
        inputs = dict(q=q, k=k, v=v, idx=args["idx"])
        if args.get("kv_lengths") is not None:
            inputs["kv_lengths"] = args["kv_lengths"]
        return Case(args=args, inputs=inputs, out_shape=(args["idx"].shape[0], *q.shape[1:]), dtype=q.dtype,
                    device=q.device, users=k.shape[0])

    def with_input(self, case: Case, name: str, t: torch.Tensor) -> Case:
        k, v = case.args["kv"]
        if name == "k":
            return self._case({**case.args, "kv": (t, v)})
        if name == "v":
            return self._case({**case.args, "kv": (k, t)})
        return self._case({**case.args, name: t})

    def without_users(self, case: Case) -> Case:
        """The batch that idx looks up made empty (the direction named: with an empty batch of
        candidates too, both sides would have batch len(idx))."""
        k, v = case.args["kv"]
        args = {**case.args, "kv": (k[:0], v[:0]), "broadcast": "kv"}
        if args.get("kv_lengths") is not None:
            args["kv_lengths"] = args["kv_lengths"][:0]
        return self._case(args)

    @staticmethod
    def output(result):
        return result[0] if isinstance(result, tuple) else result

    def emulate(self, monkeypatch):
        import attention_emulation

        return attention_emulation.install(monkeypatch)

    @staticmethod
    def launches(emulation) -> int:
        return len(emulation.fwd_calls) + emulation.worklist_calls

    @staticmethod
    def stored_to(emulation) -> int:
        return emulation.fwd_calls[-1]["out"].data_ptr()

    def configs(self):
        return ikbo_fa.SHIPPED_CONFIGS[0], ikbo_fa.SHIPPED_CONFIGS[1]

    def kernel_for(self, cfg):
        return self.module._fwd_kernel(cfg)

    def check_gpu_result(self, out, case: Case):
        ref = self.expected(case).float()
        assert torch.isfinite(out).all()
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


OPS = {"lce": LceAdapter(), "linear": LinearAdapter(), "attention": AttentionAdapter()}
# (op, options) pairs: each op under each of its option sets.
OP_OPTIONS = [(name, options) for name, adapter in OPS.items() for options in adapter.options]


def options_id(options: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in options.items()) or "default"
