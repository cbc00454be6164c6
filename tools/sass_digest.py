"""The SASS of kernel configurations, compiled for sm_90a (no GPU needed), for comparing builds.

    python -m tools.sass_digest write DIR [--ops lce linear attention worklist merge quantize] [--all]
    python -m tools.sass_digest compare DIR_BEFORE DIR_AFTER [--params]

``write`` compiles each configuration, disassembles its cubin with cuobjdump (a CUDA toolkit's,
or that of the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels; ``$CUOBJDUMP``
names it) and writes its SASS, with the
kernel's symbol names normalized (they carry source paths), plus ``digests.json``. ``compare``
names the configurations whose SASS differs. A change that only moves code keeps every digest:
that is the check a structural refactor must pass before it needs a GPU A/B. ``--params`` also
compares the SASS with the kernel-parameter bank's offsets (``c[0x0][0x...]`` operands) replaced
by one placeholder: a change that regroups a kernel's parameters moves them and nothing else.

By default a few configurations per op (the published ones and one of each tile family);
``--all`` takes every shipped configuration.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _cuobjdump() -> str:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not found:
        try:
            import nvidia.cu13  # noqa: F401  (the nvidia-cuda-cuobjdump wheel)

            found = str(Path(nvidia.cu13.__path__[0]) / "bin" / "cuobjdump")
        except ImportError:
            pass
    if not found or not Path(found).exists():
        raise SystemExit("sass_digest: no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                         "or set $CUOBJDUMP)")
    return found


def _configs(ops, everything: bool):
    import torch

    import ikbo_fa
    import ikbo_gemm
    from ikbo_gemm.config import LceConfig, LinearConfig

    if "lce" in ops:
        shipped = [c for c in ikbo_gemm.SHIPPED_CONFIGS if isinstance(c, LceConfig)]
        picked = shipped if everything else [
            LceConfig(dt, torch.int32, w, cn, cb, n) for dt in (torch.float16, torch.bfloat16)
            for w, cn, cb, n in ((152, 2, 4, 128), (224, 4, 2, 64), (128, 1, 1, 64))]
        for c in picked:
            yield f"lce-{c}", lambda c=c: ikbo_gemm.compile_config(c)
    if "linear" in ops:
        shipped = [c for c in ikbo_gemm.SHIPPED_CONFIGS if isinstance(c, LinearConfig)]
        # The plans' most common candidate kernels (bf16 128 x 128 and shared 128 x 256 in 2-CTA
        # clusters with bias and relu, FP8 128 x 128), and about one in 9 of the rest, picked by
        # name: the same ones whatever configurations are added beside them.
        common = [c for c in shipped if c.phase == "cand" and c.cluster_m == 2 and c.split_k == 1 and (
            (c.dtype == torch.bfloat16 and c.has_bias and c.activation == "relu" and c.tile_n in (128, 256))
            or (c.dtype == torch.float8_e4m3fn and (c.tile_m, c.tile_n) == (128, 128) and not c.has_bias))]
        picked = shipped if everything else common + [
            c for c in shipped if c not in common and int(hashlib.sha1(str(c).encode()).hexdigest(), 16) % 9 == 0]
        for c in picked:
            yield str(c), lambda c=c: ikbo_gemm.compile_config(c)
    if "attention" in ops:
        # Named by the configuration alone, so that digests compare across changes of the list.
        for c in ikbo_fa.SHIPPED_CONFIGS:
            yield f"attention-{c}", lambda c=c: ikbo_fa.compile_config(c)
    if "worklist" in ops:
        from ikbo_fa.worklist_sm90 import compile_worklist

        for dt in (torch.int32, torch.int64):
            yield f"worklist-{str(dt)[6:]}", lambda dt=dt: compile_worklist(dt)
            if everything:  # the longest-first group orders
                for keys in ("lengths", "offsets"):
                    yield f"worklist-{str(dt)[6:]}-{keys}", lambda dt=dt, keys=keys: compile_worklist(dt, keys)
    if "merge" in ops:
        from ikbo_fa.merge_sm90 import compile_merge

        for dt in (torch.bfloat16, torch.float16):
            for lse in (False, True):
                yield f"merge-{str(dt)[6:]}{'-lse' if lse else ''}", lambda dt=dt, lse=lse: compile_merge(dt, lse)
    if "quantize" in ops:
        from ikbo_gemm.quantize_sm90 import compile_quantize
        from ikbo_gemm.quantize_staged_sm90 import STAGE_BYTES, compile_quantize_staged

        for dt in (torch.bfloat16, torch.float16, torch.float32) if everything else (torch.bfloat16,):
            for layout in ("same", "transposed"):
                tr = layout == "transposed"
                yield f"quantize-{str(dt)[6:]}-{layout}", lambda dt=dt, tr=tr: compile_quantize(dt, tr)
                for stage in STAGE_BYTES:
                    yield (f"quantize-staged-{str(dt)[6:]}-{layout}-{stage // 1024}k",
                           lambda dt=dt, tr=tr, stage=stage: compile_quantize_staged(dt, tr, stage))


def _sass(cubin: bytes, cuobjdump: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    text = re.sub(r"Function : \S+", "Function : K", text)
    return re.sub(r"\b(_Z\w+|kernel_\w+)", "SYM", text)


def write(out: Path, ops, everything: bool) -> None:
    import cutlass.cute as cute

    cuobjdump = _cuobjdump()
    out.mkdir(parents=True, exist_ok=True)
    compile_ = cute.compile
    cubins = []

    def keep_cubin(fn, *args, options="", **kw):  # the compile the library runs, with its cubin kept
        compiled = compile_(fn, *args, options=f"{options} --keep-cubin", **kw)
        cubins.append(compiled.artifacts.CUBIN)
        return compiled

    cute.compile = keep_cubin
    digests = {}
    try:
        for name, build in _configs(ops, everything):
            build()
            text = _sass(cubins[-1], cuobjdump)
            (out / f"{name}.sass").write_text(text)
            digests[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
            print(name, digests[name], flush=True)
    finally:
        cute.compile = compile_
    (out / "digests.json").write_text(json.dumps(digests, indent=1) + "\n")


_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
_ENCODING = re.compile(r"/\* 0x[0-9a-f]{16} \*/")


def without_param_offsets(sass: str) -> str:
    """``sass`` with every kernel-parameter bank operand (``c[0x0][0x...]``) as ``c[0x0][P]`` and,
    on those lines, the instruction word that encodes the offset dropped (the control word on the
    next line is kept)."""
    return "\n".join(_ENCODING.sub("", _PARAM.sub("c[0x0][P]", line)) if _PARAM.search(line) else line
                     for line in sass.split("\n"))


def compare(before: Path, after: Path, params: bool = False) -> int:
    """Print the configurations whose SASS differs byte for byte and, with ``params``, those that
    still differ once parameter offsets are normalized; nonzero where the chosen check fails."""
    a = json.loads((before / "digests.json").read_text())
    b = json.loads((after / "digests.json").read_text())
    both = sorted(a.keys() & b.keys())
    differ = [k for k in both if a[k] != b[k]]
    for k in sorted(a.keys() ^ b.keys()):
        print(f"only in {'before' if k in a else 'after'}: {k}")
    for k in differ:
        print(f"differs: {k}")
    print(f"strict: {len(both) - len(differ)} of {len(both)} identical")
    if not params:
        return 1 if differ else 0
    still = [k for k in differ if without_param_offsets((before / f"{k}.sass").read_text())
             != without_param_offsets((after / f"{k}.sass").read_text())]
    for k in still:
        print(f"differs beyond parameter offsets: {k}")
    print(f"parameter offsets normalized: {len(both) - len(still)} of {len(both)} identical")
    return 1 if still else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    w.add_argument("--ops", nargs="+", default=["lce", "linear", "attention", "worklist", "merge", "quantize"],
                   choices=["lce", "linear", "attention", "worklist", "merge", "quantize"])
    w.add_argument("--all", action="store_true", help="every shipped configuration")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--params", action="store_true",
                   help="also compare with kernel-parameter offsets (c[0x0][0x...]) normalized; the exit status "
                        "then follows that check")
    args = ap.parse_args(argv)
    if args.cmd == "write":
        write(args.dir, args.ops, args.all)
        return 0
    return compare(args.before, args.after, args.params)


if __name__ == "__main__":
    sys.exit(main())
