"""Importing the library changes no process-wide setting: a fresh interpreter's whole
environment is the same after ``import cute_kernels, ikbo_gemm, ikbo_fa``, and a compile still
targets sm_90a (each compile names it; nothing is read from CUTE_DSL_ARCH)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import os, sys
before = dict(os.environ)
import cute_kernels, ikbo_gemm, ikbo_fa
import cute_kernels.compile, ikbo_gemm.lce, ikbo_fa.attention
after = dict(os.environ)
changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
print("CHANGED", changed, flush=True)
kernel = ikbo_gemm.compile_config(ikbo_gemm.SHIPPED_CONFIGS[0], keep_ptx=True)
print("TARGET", ".target sm_90a" in kernel.ptx, flush=True)
print("CHANGED AFTER COMPILE", sorted(k for k in after.keys() | os.environ.keys() if after.get(k) != os.environ.get(k)))
"""


def test_import_leaves_the_environment_unchanged_and_compiles_name_sm90a(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}  # nothing to lean on
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["CUTE_KERNELS_CACHE_DIR"] = ""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    p = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert "CHANGED []" in lines, p.stdout
    assert "TARGET True" in lines, p.stdout
    assert "CHANGED AFTER COMPILE []" in lines, p.stdout
