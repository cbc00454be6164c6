"""lce's fused grid on a GPU it does not have to itself.

The fused launch's candidate tiles wait on user tiles that other clusters of the same grid
compute, so the grid must be resident whole. Each case runs in a child process that is killed
after a timeout: a regression shows as a failed test, never as a hung test run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# The child processes need GPU memory and SMs that other workers' tests would hold.
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]

_COMMON = """
import math, time, torch
from ikbo_gemm import lce

def problem(seed, B=1024, U=15, M=433, N=256, K_user=1184, K_cand=872):
    # The published shape: 8-CTA clusters, and a second launch on the SMs they leave.
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = 1 / math.sqrt(K_user + K_cand)
    r = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, device="cuda") * s).half()
    args = dict(w_cand=r(M, K_cand, s=s), w_user=r(M, K_user, s=s), e_cand=r(B, K_cand, N),
                e_user=r(U, K_user, N), idx=(torch.arange(B, device="cuda") * U // B).int())
    user = torch.matmul(args["w_user"].float(), args["e_user"].float())
    ref = torch.matmul(args["w_cand"].float(), args["e_cand"].float()) + user[args["idx"].long()]
    return args, ref

def finished(events, seconds=10.0):
    start = time.time()
    while not all(e.query() for e in events):
        if time.time() - start > seconds:
            return False
        time.sleep(0.01)
    return True

def close(out, ref):
    return float((out.float() - ref).abs().max()) < 5e-2

def check(out, ref, what):
    # Ends the child unless the work queued so far finishes and gives ref.
    event = torch.cuda.Event()
    event.record()
    if not finished([event]):
        print(f"RESULT {what}: hang", flush=True)
        import os
        os._exit(3)
    if not close(out, ref):
        print(f"RESULT {what}: wrong values", flush=True)
        raise SystemExit

def green_context(num_sms=64):
    # A green context of num_sms SMs made current (the child ends where torch has none).
    gc = getattr(torch.cuda, "green_contexts", None)
    if gc is None or not getattr(gc, "SUPPORTED", False):
        print("RESULT skip: no green contexts in this torch", flush=True)
        raise SystemExit
    ctx = gc.GreenContext.create(num_sms=num_sms, device_id=0)
    ctx.set_context()
    return ctx
"""


def _run_child(body: str, directory, timeout: float = 240.0) -> str:
    """The child's last line starting with RESULT (or why there is none). The child runs from a
    file: the DSL compiles kernels from their source."""
    script = directory / "child.py"
    script.write_text(_COMMON + textwrap.dedent(body))
    env = dict(os.environ, IKBO_VALIDATE="0")
    try:
        p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no result in {timeout:.0f} s (hung)"
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT")]
    return lines[-1] if lines else f"child exited {p.returncode}: {p.stderr.strip()[-1500:]}"


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_two_calls_on_two_streams_while_other_work_holds_sms(tmp_path, mode):
    """A kernel holds some SMs while two calls start on streams of different priority, each
    called or replayed from a CUDA graph: the SMs it frees must not leave both grids
    part-resident (each waiting on the other)."""
    result = _run_child("""
        MODE = "<mode>"
        import cutlass.cute as cute
        from cutlass import Int32, Int64
        from cute_kernels import compile_kernel, fake_stream, fake_tensor

        class Hog:  # one CTA per SM (200 KB of shared memory each), spinning for ns nanoseconds
            @cute.kernel
            def kernel(self, dummy: cute.Tensor, ns: Int64):
                start = cute.arch.globaltimer()
                while cute.arch.globaltimer() - start < ns:
                    pass

            @cute.jit
            def __call__(self, dummy: cute.Tensor, ns: Int64, grid: Int32, stream):
                self.kernel(dummy, ns).launch(grid=[grid, 1, 1], block=[32, 1, 1], smem=200 * 1024, stream=stream)

        hog = compile_kernel(Hog(), fake_tensor(Int32, (None,), align=4), Int64(1), Int32(1), fake_stream())
        dummy = torch.zeros(4, dtype=torch.int32, device="cuda")
        (a1, ref1), (a2, ref2) = problem(1), problem(2)
        out1, out2 = lce(**a1), lce(**a2)  # compiled and planned outside the experiment
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        if MODE == "graph":
            capture = torch.cuda.Stream()
            capture.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(capture):
                for graph, args, out in ((g1, a1, out1), (g2, a2, out2)):
                    with torch.cuda.graph(graph, stream=capture):
                        lce(**args, out=out)
            torch.cuda.current_stream().wait_stream(capture)
        torch.cuda.synchronize()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        low, high, side = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-100), torch.cuda.Stream()
        for trial, held in enumerate((sms * 3 // 10, sms // 2, sms * 7 // 10)):
            out1.fill_(float("nan"))
            out2.fill_(float("nan"))
            for s in (low, high, side):
                s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                hog(dummy, 300_000_000, held)
            time.sleep(0.03)  # the hog is resident
            events = []
            for stream, args, out, graph in ((low, a1, out1, g1), (high, a2, out2, g2)):
                with torch.cuda.stream(stream):
                    graph.replay() if MODE == "graph" else lce(**args, out=out)
                    events.append(torch.cuda.Event())
                    events[-1].record()
            if not finished(events):
                print(f"RESULT hang: trial {trial}, {held} SMs held", flush=True)
                import os
                os._exit(3)
            if not (close(out1, ref1) and close(out2, ref2)):
                print(f"RESULT wrong values: trial {trial}", flush=True)
                break
        else:
            print("RESULT ok", flush=True)
    """.replace("<mode>", mode), tmp_path)
    assert result == "RESULT ok"


def test_green_context_with_fewer_sms(tmp_path):
    """In a green context of 64 SMs the fused grid cannot be resident whole: the driver refuses
    it, and the call warns and runs the schedule that needs no co-residency; a graph captured
    there holds that schedule and replays."""
    result = _run_child("""
        import warnings
        args, ref = problem(3)
        lce(**args)  # compiled and planned on the whole GPU
        lce(**args, schedule="two_launch")
        torch.cuda.synchronize()
        ctx = green_context(64)  # kept: the context lives while it is current

        for call in range(2):
            out = torch.full_like(ref, float("nan"), dtype=torch.float16)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                lce(**args, out=out)
            warned = [w for w in seen if "schedule='two_launch'" in str(w.message)]
            if len(warned) != (call == 0):
                print(f"RESULT call {call}: {len(warned)} warnings: {[str(w.message) for w in seen]}", flush=True)
                raise SystemExit
            check(out, ref, f"fallback call {call}")

        # A capture records the cooperative launch unchecked (a fused graph replayed here would
        # hang): the op captures the launches that need no co-residency.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph, out = torch.cuda.CUDAGraph(), torch.full_like(ref, float("nan"), dtype=torch.float16)
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            lce(**args, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        check(out, ref, "captured call")
        print("RESULT ok", flush=True)
    """, tmp_path)
    if result.startswith("RESULT skip"):
        pytest.skip(result[12:])
    assert result == "RESULT ok"


def test_first_call_in_a_green_context(tmp_path):
    """Launch plans are sized for the whole device, whatever context is current at the first
    call: made inside a green context of 64 SMs, the plan still fills the device afterwards."""
    result = _run_child("""
        import warnings
        from cute_kernels import max_active_clusters
        args, ref = problem(4)
        torch.cuda.synchronize()
        ctx = green_context(64)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = lce(**args)
        check(out, ref, "green context")
        if not any("two_launch" in str(w.message) for w in seen):
            print("RESULT no warning in the green context", flush=True)
            raise SystemExit
        ctx.pop_context()
        clusters = max_active_clusters(torch.device("cuda", 0), 8)
        if clusters * 8 < torch.cuda.get_device_properties(0).multi_processor_count * 3 // 4:
            print(f"RESULT sized for the green context: {clusters} clusters of 8", flush=True)
            raise SystemExit
        out = lce(**args)
        torch.cuda.synchronize()
        print("RESULT ok" if close(out, ref) else "RESULT wrong values on the whole device", flush=True)
    """, tmp_path)
    if result.startswith("RESULT skip"):
        pytest.skip(result[12:])
    assert result == "RESULT ok"
