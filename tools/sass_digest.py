"""The SASS of kernel configurations, compiled for sm_90a (no GPU needed), for comparing builds.

    python tools/sass_digest.py write DIR [--ops lce linear attention worklist] [--all]
    python tools/sass_digest.py compare DIR_BEFORE DIR_AFTER

``write`` compiles each configuration, disassembles its cubin with cuobjdump (a CUDA toolkit's,
or that of the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels; ``$CUOBJDUMP``
names it) and writes its SASS, with the
kernel's symbol names normalized (they carry source paths), plus ``digests.json``. ``compare``
names the configurations whose SASS differs. A change that only moves code keeps every digest:
that is the check a structural refactor must pass before it needs a GPU A/B.

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
        for c in shipped if everything else shipped[::9]:
            yield str(c), lambda c=c: ikbo_gemm.compile_config(c)
    if "attention" in ops:
        # Named by the configuration alone, so that digests compare across changes of the list.
        for c in ikbo_fa.SHIPPED_CONFIGS:
            yield f"attention-{c}", lambda c=c: ikbo_fa.compile_config(c)
    if "worklist" in ops:
        from ikbo_fa.worklist_sm90 import compile_worklist

        for dt in (torch.int32, torch.int64):
            yield f"worklist-{str(dt)[6:]}", lambda dt=dt: compile_worklist(dt)


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


def compare(before: Path, after: Path) -> int:
    a = json.loads((before / "digests.json").read_text())
    b = json.loads((after / "digests.json").read_text())
    differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    for k in differ:
        print(f"differs: {k}")
    for k in sorted(a.keys() ^ b.keys()):
        print(f"only in {'before' if k in a else 'after'}: {k}")
    print(f"{len(a.keys() & b.keys()) - len(differ)} of {len(a.keys() & b.keys())} identical")
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    w.add_argument("--ops", nargs="+", default=["lce", "linear", "attention", "worklist"],
                   choices=["lce", "linear", "attention", "worklist"])
    w.add_argument("--all", action="store_true", help="every shipped configuration")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "write":
        write(args.dir, args.ops, args.all)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
