"""Shared benchmark machinery: device checks, timing, ceilings, environment, results and the run.

Timing modes (``--timing``, docs/benchmarks.md): providers timed in turns (``bench_interleaved``),
each alone back to back at the power limit (``sustained``), or as CUDA-graph replays in turns
(``bench_graph_interleaved``); a mode's row fields carry its suffix (``SUFFIX``), so that the
modes share one row.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import importlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from perf.providers import INSTALL_HINT, LIBS, needed

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "perf" / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------- device checks

def require_hopper_or_exit(*, name: str) -> None:
    """Exit with status 2 and one line on stderr unless torch is a CUDA build with an sm_90 GPU."""
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
        missing = f"none found (torch {torch.__version__}, {build})"
    elif torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        missing = f"found {torch.cuda.get_device_name()} (sm_{major}{minor})"
    else:
        return
    print(f"{name}: needs a Hopper (sm_90) GPU; {missing}. Run it on an H100/H200 after `{INSTALL_HINT}`.",
          file=sys.stderr, flush=True)
    raise SystemExit(2)


def start_benchmark(name: str) -> None:
    """Exit with status 2 unless the benchmark can run here; then no host-synchronizing index checks
    in timed calls, fp32 references in fp32, and no disk cache of compiled kernels, ours or
    Inductor's (a first call compiles, as the compile columns say)."""
    require_hopper_or_exit(name=name)
    os.environ["IKBO_VALIDATE"] = "0"
    os.environ["CUTE_KERNELS_CACHE_DIR"] = ""
    torch.backends.cuda.matmul.allow_tf32 = False
    for module in ("torch.compiler.config", "torch._inductor.config"):  # the newer home first
        with contextlib.suppress(ImportError, AttributeError):
            setattr(importlib.import_module(module), "force_disable_caches", True)
            return


# --------------------------------------------------------------------------- workloads

def user_counts(B: int, ratio: int, rng=None) -> list[int]:
    """Candidates per user: ``ratio`` each (``ratio`` or ``ratio + 1`` drawn from the numpy
    Generator ``rng`` when given); the last user gets the remainder. Sums to B."""
    if B < 1 or ratio < 1:
        raise ValueError(f"need B >= 1 and ratio >= 1, got B={B}, ratio={ratio}")
    counts, left = [], B
    while left > 0:
        counts.append(min(left, ratio if rng is None else ratio + int(rng.integers(0, 2))))
        left -= counts[-1]
    return counts


def make_idx(counts: Sequence[int], order: str = "sorted", rng=None) -> torch.Tensor:
    """int32 [B] candidate -> user index on the CPU; ``order`` "sorted" groups candidates by
    user, "shuffled" permutes them (needs ``rng``)."""
    idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts)))
    if order == "shuffled":
        idx = idx[torch.from_numpy(rng.permutation(len(idx)))]
    elif order != "sorted":
        raise ValueError(f"order must be 'sorted' or 'shuffled', got {order!r}")
    return idx.to(torch.int32)


def per_problem(make: Callable) -> Callable:
    """``make(p, ...)`` run once per problem, its result kept in ``p.cache`` (cleared at the
    problem's end): static weights, index metadata, copies made beforehand."""
    @functools.wraps(make)
    def once(p, *args):
        if make not in p.cache:
            p.cache[make] = make(p, *args)
        return p.cache[make]
    return once


# --------------------------------------------------------------------------- timing

def _caller(fn: Callable, rotate: Optional[Sequence]) -> tuple[Callable[[int], Any], int]:
    """(call i, input sets): ``fn()``, or ``fn(x)`` with x cycling over ``rotate``."""
    if not rotate:
        return (lambda i: fn()), 1
    sets = list(rotate)
    return (lambda i: fn(sets[i % len(sets)])), len(sets)


def bench_ms(fn: Callable, *, warmup: int = 5, rep: int = 30) -> float:
    """Median milliseconds of one call of ``fn``."""
    ms = bench_interleaved({"fn": fn}, warmup=warmup, rep=rep)["fn"]
    if isinstance(ms, BaseException):
        raise ms
    return ms


def bench_interleaved(fns: dict, *, warmup: int = 5, rep: int = 30, rotate: Optional[Sequence] = None) -> dict:
    """Median ms of one call of each ``fns[name](x)``, timed in turns (a call of each per round,
    between CUDA events) so that drift in clocks, power or heat falls on all alike; each call takes
    the next input set of ``rotate``, so none finds its inputs in L2. A function that raises is
    dropped from later rounds; its entry is the exception."""
    calls = {name: _caller(fn, rotate)[0] for name, fn in fns.items()}
    names, result, events, count = list(calls), {}, {name: [] for name in calls}, itertools.count()
    new_event = functools.partial(torch.cuda.Event, enable_timing=True)
    for rounds, timed in ((warmup, False), (rep, True)):
        for i in range(rounds if names else 0):
            k = i % len(names)  # each round starts one further along: no fixed neighbour
            for name in [n for n in names[k:] + names[:k] if n not in result]:
                if timed:
                    events[name].append((new_event(), new_event()))
                    events[name][-1][0].record()
                try:
                    calls[name](next(count))
                except Exception as e:  # reported by the caller
                    result[name] = e
                if timed:
                    events[name][-1][1].record()
        torch.cuda.synchronize()
    for name, pairs in events.items():
        if name not in result:
            result[name] = statistics.median(s.elapsed_time(e) for s, e in pairs)
    return result


def bench_graph_interleaved(fns: dict, *, warmup: int = 3, rep: int = 30,
                            rotate: Optional[Sequence] = None) -> dict:
    """As ``bench_interleaved``, on replays of one CUDA graph per function (one call per input
    set in each); an entry is None when that function cannot be captured."""
    graphs = {name: _capture(fn, rotate) for name, fn in fns.items()}
    ms = bench_interleaved({name: g[0].replay for name, g in graphs.items() if g}, warmup=warmup, rep=rep)
    for t in ms.values():
        if isinstance(t, BaseException):
            raise t
    return {name: ms[name] / g[1] if g else None for name, g in graphs.items()}


def _capture(fn: Callable, rotate: Optional[Sequence]):
    """(graph holding one call per input set, number of calls), or None if capture fails."""
    call, n = _caller(fn, rotate)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on the capture side, as torch recommends
            for i in range(n):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                call(i)
        torch.cuda.synchronize()
    except Exception:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return None
    return graph, n


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_overhead_us(fn: Callable, iters: int = 100, warmup: int = 5) -> float:
    """CPU microseconds per call of ``fn`` (no synchronization inside the timed loop)."""
    for _ in range(warmup):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    _sync()
    return elapsed / iters * 1e6


def first_call_s(fn: Callable) -> tuple[float, Any]:
    """Wall seconds of a synchronized call (the first one includes any compile), and its result."""
    _sync()
    start = time.perf_counter()
    result = fn()
    _sync()
    return time.perf_counter() - start, result


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def rotation_count(set_bytes: int, cache_bytes: int, *, cap: int = 8) -> int:
    """Input copies to cycle through so that 3x the cache lies between two uses of one copy."""
    return max(1, min(cap, math.ceil(3 * cache_bytes / set_bytes))) if set_bytes > 0 else cap


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    """10^12 ``flops`` (or bytes) per second at ``ms`` a call."""
    return flops / (ms * 1e-3) / 1e12 if ms is not None and ms > 0 else None


# --------------------------------------------------------------------------- ceilings

def cublas_ceiling_tflops(dtype: torch.dtype, n: int = 8192) -> float:
    """Same-run ceiling: TFLOP/s of torch.matmul on random n x n matrices."""
    a, b, c = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(3))
    return tflops(2.0 * n**3, bench_ms(lambda: torch.matmul(a, b, out=c), rep=20))


def copy_bandwidth_tbps(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return tflops(2.0 * nbytes, bench_ms(lambda: dst.copy_(src), warmup=3, rep=20))


def ceilings_tflops(dtype_names) -> dict:
    """Same-run ceilings per dtype name, printed as measured: cuBLAS 8192^3 GEMM TFLOP/s, and for
    "fp8" row-wise torch._scaled_mm (perf/fp8_peers.py)."""
    from perf import fp8_peers

    result = {}
    for dt in dict.fromkeys(dtype_names):
        if dt == "fp8":
            result[dt] = fp8_peers.fp8_ceiling_tflops()
            print(f"torch._scaled_mm fp8 row-wise 8192^3 ceiling: {result[dt]:.0f} TFLOP/s", flush=True)
        else:
            result[dt] = cublas_ceiling_tflops(DTYPES[dt])
            print(f"cuBLAS {dt} 8192^3 GEMM ceiling: {result[dt]:.0f} TFLOP/s", flush=True)
    return result


# --------------------------------------------------------------------------- power

POWER_CAP_BIT = 0x4  # nvidia-smi clocks_throttle_reasons.active: software power cap


@functools.lru_cache(maxsize=None)
def _power_field(index: str) -> str:
    """power.draw is a one-second average on recent drivers; the instant reading follows a
    back-to-back loop more closely where the driver has it. Asked once (it takes a while)."""
    query = ["nvidia-smi", f"--id={index}", "--query-gpu=power.draw.instant", "--format=csv,noheader"]
    return "power.draw.instant" if _run(query) else "power.draw"


class PowerSampler:
    """(watts, SM MHz, throttle-reason bits) from nvidia-smi every 100 ms while the ``with``
    block runs, in ``samples`` afterwards (none without nvidia-smi)."""

    def __init__(self):
        self.samples: list[tuple[float, float, int]] = []
        self._proc = None

    def __enter__(self) -> "PowerSampler":
        index = _smi_index()
        query = [f"--query-gpu={_power_field(index)},clocks.sm,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "100"]
        with contextlib.suppress(OSError):
            self._proc = subprocess.Popen(["nvidia-smi", f"--id={index}", *query], text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.kill()
        try:
            out = self._proc.communicate(timeout=10)[0] or ""
        except subprocess.SubprocessError:
            out = ""
        for line in out.splitlines():
            parts = line.split(",")
            with contextlib.suppress(IndexError, ValueError):  # a line cut short by the kill
                self.samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))


def sustained(fn: Callable, seconds: float, *, warm_s: float = 1.5, rotate: Optional[Sequence] = None,
              device="cuda") -> dict:
    """``fn`` (``fn(x)`` for x cycling over ``rotate``) back to back: ``warm_s`` untimed, for clocks
    and power to settle, then ``seconds`` timed in chunks of about 10 ms between CUDA events
    (wall clock on a CPU ``device``), the host waiting two chunks back so the GPU never runs dry.
    Returns ms (median per call over the chunks), ms_mean, W, MHz, power_capped (nvidia-smi
    samples from 0.3 s before, the first and last dropped), mJ per call, samples and calls."""
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    call, _ = _caller(fn, rotate)
    if cuda:
        _power_field(_smi_index())  # asked now: it blocks for a while

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    _sync()
    start = time.perf_counter()
    call(0)  # sizes the chunks
    _sync()
    chunk = max(1, min(100_000, round(10.0 / max((time.perf_counter() - start) * 1e3, 1e-3))))
    marks, i, sampler, first = [], 1, None, None
    t_timed = time.perf_counter() + warm_s
    try:
        marks.append(mark())
        while True:
            for _ in range(chunk):
                call(i)
                i += 1
            marks.append(mark())
            now = time.perf_counter()
            if cuda and len(marks) > 2:
                marks[-3].synchronize()
            if sampler is None and now >= t_timed - 0.3:
                sampler = PowerSampler().__enter__()
            if first is None and now >= t_timed:
                first = len(marks) - 1  # chunks from this mark on are timed
            if first is not None and now >= t_timed + seconds and len(marks) - 1 > first:
                break
        _sync()
    finally:
        if sampler is not None:
            sampler.__exit__(None, None, None)
    chunks = [a.elapsed_time(b) if cuda else (b - a) * 1e3 for a, b in zip(marks[first:], marks[first + 1:])]
    calls = chunk * len(chunks)
    ms_mean = sum(chunks) / calls
    samples = sampler.samples if sampler is not None else []
    samples = samples[1:-1] if len(samples) > 4 else samples
    watts = statistics.fmean(s[0] for s in samples) if samples else None
    return {"ms": statistics.median(c / chunk for c in chunks), "ms_mean": ms_mean, "W": watts,
            "MHz": statistics.median(s[1] for s in samples) if samples else None,
            "power_capped": any(s[2] & POWER_CAP_BIT for s in samples) if samples else None,
            "mJ": watts * ms_mean if watts is not None else None, "samples": len(samples), "calls": calls}


def sustained_graph(fn: Callable, seconds: float, *, warm_s: float = 1.5) -> Optional[dict]:
    """``sustained`` on replays of a CUDA graph of ``fn``, as a serving stack that captures its
    model runs; None where ``fn`` cannot be captured."""
    captured = _capture(fn, None)
    return None if captured is None else sustained(captured[0].replay, seconds, warm_s=warm_s)


# --------------------------------------------------------------------------- accuracy

def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when ``out`` holds NaN/Inf or the shapes differ."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    diff = out.detach().double() - ref.detach().double()
    if not bool(torch.isfinite(diff).all()):
        return math.inf
    num = float(torch.linalg.vector_norm(diff))
    den = float(torch.linalg.vector_norm(ref.detach().double()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# --------------------------------------------------------------------------- environment

def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm",
               "clocks.max.mem", "power.limit", "temperature.gpu")


def _smi_index() -> str:
    """nvidia-smi's index of the GPU torch uses first."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"


def environment() -> dict:
    """What a result depends on: GPU, clocks, driver, library versions, commit, date."""
    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        **{dist: _version(dist) for dist in ("nvidia-cutlass-dsl", "flash-attn-4", "fa3-fwd")},
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}",
                   sm_count=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1),
                   l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
        out = _run(["nvidia-smi", f"--id={_smi_index()}", f"--query-gpu={','.join(_SMI_FIELDS)}",
                    "--format=csv,noheader,nounits"])
        values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
        if len(values) == len(_SMI_FIELDS):
            env.update({f"smi.{k}": v for k, v in zip(_SMI_FIELDS, values)})
        env["driver"] = env.get("smi.driver_version")
    # IKBO_GIT_COMMIT names the commit of a copied tree (e.g. shipped to a GPU machine), whose
    # .git may be missing or stale; it wins over what git reports.
    named = os.environ.get("IKBO_GIT_COMMIT")
    commit = _run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    env["git_commit"] = named or commit
    if commit is not None and not named:
        env["git_dirty"] = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT))
    return env


# --------------------------------------------------------------------------- results

def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf" / "nan": strict JSON has no spelling for them
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return str(x) if isinstance(x, (torch.dtype, Path)) else x


def result_paths(name: str, suffix: str, out_dir, stamp: str) -> tuple[Path, Path]:
    """(``<name>-<stamp><suffix>``, ``<name>-latest<suffix>``) under ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}-{stamp}{suffix}", out / f"{name}-latest{suffix}"


def write_results(name: str, payload: dict, out_dir, stamp: str) -> Path:
    """Write ``payload`` (plus ``environment()`` unless present) as JSON; returns the stamped path."""
    payload = dict(payload)
    payload.setdefault("environment", environment())
    text = json.dumps(_jsonable(payload), indent=1, allow_nan=False) + "\n"
    stamped, latest = result_paths(name, ".json", out_dir, stamp)
    stamped.write_text(text)
    latest.write_text(text)
    return stamped


class ContextLost(Exception):
    """A sticky CUDA error: nothing more can run in this process. Carries the rows so far."""

    def __init__(self, note: str, rows: list):
        super().__init__(note)
        self.rows = rows


class Run:
    """One run of a benchmark: ``start_benchmark``, the libraries its providers ``provs`` need (a
    note for each one missing), the environment, and the JSON, written again after every step so
    that partial results survive a crash. ``with run:`` stops at a lost CUDA context, keeping the
    rows measured before it."""

    def __init__(self, name: str, args, argv, provs, libraries: Sequence[str] = ("nvidia-cutlass-dsl",)):
        start_benchmark(name)
        self.name, self.out_dir = name, args.out_dir
        self.stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.timing = timing_settings(args)
        self.notes = LIBS.load(needed(provs))
        for note in self.notes:
            print(f"{name}: {note}", flush=True)
        env = self.env = environment()
        libs = " | ".join(f"{lib} {env.get(lib)}" for lib in libraries)  # the environment in one line
        print(f"{env.get('gpu')} | SM clock {env.get('smi.clocks.sm')} MHz (max {env.get('smi.clocks.max.sm')}) | "
              f"driver {env.get('driver')} | torch {env['torch']} | {libs} | "
              f"commit {str(env.get('git_commit'))[:12]}{' (dirty)' if env.get('git_dirty') else ''}", flush=True)
        self.argv = sys.argv[1:] if argv is None else list(argv)

    def begin(self, settings: dict, **fields) -> dict:
        """The payload (``fields``, then the timing and other ``settings``); the clock starts."""
        self.payload = {"benchmark": self.name, "argv": self.argv, "environment": self.env, **fields,
                        "settings": {**self.timing, **settings}, "notes": self.notes, "rows": []}
        self.start = time.perf_counter()
        return self.payload

    def note(self, text: str) -> None:
        print(f"{self.name}: {text}", flush=True)
        self.payload["notes"].append(text)

    def save(self) -> Path:
        return write_results(self.name, self.payload, self.out_dir, self.stamp)

    def add(self, rows: list) -> None:
        self.payload["rows"] += rows
        self.save()
        torch.cuda.empty_cache()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, kind, e, traceback) -> bool:
        if isinstance(e, ContextLost):
            self.payload["rows"] += e.rows
            self.note(f"the CUDA context is lost after {e}; stopping (results so far are saved)")
        self.payload["seconds"] = time.perf_counter() - self.start
        return isinstance(e, ContextLost)


# --------------------------------------------------------------------------- arguments

TIMINGS = {"interleaved": ["interleaved"], "sustained": ["sustained"], "graph": ["graph"],
           "both": ["interleaved", "sustained"], "all": ["interleaved", "sustained", "graph"]}  # -> modes
SUFFIX = {"interleaved": "", "sustained": "_sustained", "graph": "_graph"}  # of a mode's row fields


def mode_suffixes(timing: str) -> list:
    return [SUFFIX[m] for m in TIMINGS[timing]]


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as the description."""
    return argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(ap: argparse.ArgumentParser, timing: str = "interleaved") -> None:
    """--out-dir, --warmup, --rep, --seed, and the timing mode (default ``timing``) with its settings."""
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR,
                        help="where JSON (and plots) go (default: perf/results)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    ap.add_argument("--rep", type=int, default=30, help="timed calls (the median is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing", choices=list(TIMINGS), default=timing,
                        help="interleaved: providers in turns, one call each per round (host time "
                             "included where it exceeds the GPU's); sustained: each alone, back to back, at "
                             "the power limit; graph: replays of a CUDA graph of each, in turns (no host "
                             "time); both: interleaved and sustained; all: the three (default: %(default)s)")
    ap.add_argument("--sustained-warmup-s", type=float, default=2.0,
                        help="sustained: seconds back to back before timing (default: %(default)s)")
    ap.add_argument("--sustained-s", type=float, default=1.0,
                        help="sustained: seconds timed per provider (default: %(default)s)")


def timing_settings(args) -> dict:
    """The timing arguments: ``time_checked``'s keywords, and what a payload's settings record."""
    return {"warmup": args.warmup, "rep": args.rep, "timing": args.timing,
            "sustained_warmup_s": args.sustained_warmup_s, "sustained_s": args.sustained_s}


# --------------------------------------------------------------------------- printing

def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def print_table(rows: list[dict], columns: list[str], *, file=None) -> str:
    """Print ``rows`` as an aligned text table of ``columns`` (missing cells print '-')."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(vals):
        # text left-aligned in the first column, numbers right-aligned elsewhere
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    text = "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])
    print(text, file=file or sys.stdout, flush=True)
    return text


def point_table(rows: list, keys: Sequence, key_of: Callable, field: str,
                first: Callable[[tuple], dict]) -> list:
    """A line per key: ``first(key)``, then the ``field`` of each row at that key (``key_of(row)``)
    under its provider's name, or the row's status where it was not timed."""
    return [{**first(key), **{r["provider"]: r.get(field) if r["status"] == "ok" else r["status"]
                              for r in rows if key_of(r) == key}} for key in keys]


SUSTAINED_FIELDS = ["W", "MHz"]  # printed on sustained lines


def mode_lines(rows: list, columns: list, timed_columns: list, timing: str) -> tuple[list, list]:
    """Lines and columns to print ``rows``: a line per row and timing mode with that mode's fields
    under their plain names (ms, tflops, ...), the first also ``columns``; sustained lines carry W
    and MHz, and then a "timing" column names each line's mode."""
    modes = TIMINGS[timing]
    cols = list(columns) + list(timed_columns)
    if len(modes) > 1 or "sustained" in modes:
        cols = list(columns) + ["timing"] + list(timed_columns) + (SUSTAINED_FIELDS if "sustained" in modes else [])
    lines = []
    for r in rows:
        for k, mode in enumerate(modes):
            line = {c: r.get(c) for c in columns} if k == 0 else {}
            line["timing"] = mode
            line.update({c: r.get(c + SUFFIX[mode]) for c in timed_columns})
            if mode == "sustained":
                line.update({c: r.get(c) for c in SUSTAINED_FIELDS})
            lines.append(line)
    return lines, cols


def print_rows(title: str, rows: list, columns: list, timed_columns: Sequence = (),
               timing: str = "interleaved") -> None:
    """A problem's title line, its table (``mode_lines``), then each row's note."""
    print(f"\n{title}")
    print_table(*mode_lines(rows, columns, timed_columns, timing))
    for r in rows:
        if r.get("note"):
            print(f"  {row_name(r)}: {r['note']}")


# --------------------------------------------------------------------------- checking and timing providers

class Skip(Exception):
    """A provider does not apply or is not available; the message says why."""


def short_error(e: BaseException) -> str:
    """First line of an exception, for a table cell."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def context_lost(device="cuda") -> bool:
    """True when the CUDA context no longer works (a sticky error such as an illegal address)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device=device).add_(1).item() != 2.0
    except Exception:
        return True


def row_name(row: dict) -> str:
    """What a row times: its provider, or (bench_models) its model version."""
    return row.get("provider") or row.get("version") or "?"


def record_failure(row: dict, e: BaseException, rows: list, device="cuda") -> None:
    """Mark a provider's row skipped (Skip, not implemented yet) or error, and raise
    ContextLost, carrying ``rows``, when the CUDA context did not survive ``e``."""
    if isinstance(e, Skip):
        row.update(status="skipped", note=str(e))
    elif isinstance(e, (NotImplementedError, ImportError)):
        row.update(status="skipped", note=f"not available yet ({short_error(e)})")
    else:  # reported; the other providers go on
        row.update(status="error", note=short_error(e))
        if context_lost(device):
            raise ContextLost(f"{row_name(row)}: {row['note']}", rows) from e


def check_providers(provs: list, p, inp, *, fields: dict, rel_error_of: Callable, tol: float,
                    skip_note: Callable, device="cuda") -> tuple[list, dict]:
    """A row per provider (``fields``, its name and status), each checked before any timing:
    skipped where ``skip_note(prov)`` says why, else set up (``prov.setup(p, inp)``) and called
    once ("first_call_s", compile included); ``rel_error_of(prov, out)`` is its error against
    the reference (None: not checked), past ``tol`` the row is "wrong" and not timed.
    Returns (rows, timed: name -> (row, fn(x)) for ``time_checked``)."""
    rows, timed = [], {}
    for prov in provs:
        row = {**fields, "provider": prov.name, "status": "ok", "note": None}
        rows.append(row)
        note = skip_note(prov)
        if note:
            row.update(status="skipped", note=note)
            continue
        try:
            st = prov.setup(p, inp)
            row["first_call_s"], out = first_call_s(lambda: prov.run(p, st, inp))
            err = rel_error_of(prov, out)
            del out
            if err is not None:
                row["rel_err"] = err
                if not err <= tol:
                    row.update(status="wrong", note=f"rel. error {err:.3g} > {tol:g}: not timed")
                    continue
            timed[prov.name] = (row, functools.partial(prov.run, p, st))
        except Exception as e:
            record_failure(row, e, rows, device)
    return rows, timed


def time_checked(timed: dict, rows: list, *, warmup: int, rep: int, rotate: Optional[Sequence] = None,
                 device="cuda", timing: str = "interleaved", sustained_warmup_s: float = 2.0,
                 sustained_s: float = 1.0) -> dict:
    """Time the providers that passed their check (``timed``: name -> (row, fn(x))) in each mode
    of ``timing``: interleaved into the row's "ms"; sustained, each alone, into "ms_sustained",
    "W", "MHz", "power_capped" and "mJ"; graph into "ms_graph" (a note where it cannot be
    captured). A provider whose call fails gets its row marked by ``record_failure`` and is
    left out. Returns the providers timed in every mode."""
    done, modes = dict(timed), TIMINGS[timing]
    if "interleaved" in modes:
        times = bench_interleaved({n: fn for n, (_, fn) in done.items()}, warmup=warmup, rep=rep, rotate=rotate)
        for name, ms in times.items():
            if isinstance(ms, BaseException):
                record_failure(done.pop(name)[0], ms, rows, device)
            else:
                done[name][0]["ms"] = ms
    if "sustained" in modes:
        for name, (row, fn) in list(done.items()):
            try:
                r = sustained(fn, sustained_s, warm_s=sustained_warmup_s, rotate=rotate, device=device)
            except Exception as e:
                record_failure(done.pop(name)[0], e, rows, device)
                continue
            row.update(ms_sustained=r["ms"], W=r["W"], MHz=r["MHz"], power_capped=r["power_capped"], mJ=r["mJ"])
    if "graph" in modes:
        times = bench_graph_interleaved({n: fn for n, (_, fn) in done.items()}, warmup=warmup, rep=rep,
                                        rotate=rotate)
        for name, ms in times.items():
            row = done[name][0]
            if ms is None:
                row["note"] = "; ".join(filter(None, [row.get("note"), "could not be captured in a CUDA graph"]))
            else:
                row["ms_graph"] = ms
    return done


def compile_seconds(rows: list) -> None:
    """Each timed row's compile_s: its first call (``first_call_s``, removed) minus a steady call."""
    for r in rows:
        first, steady = r.pop("first_call_s", None), r.get("ms", r.get("ms_sustained"))
        if first is not None and steady is not None:
            r["compile_s"] = max(0.0, first - steady * 1e-3)


def derive_rates(rows: list, timing: str, *, flops: float, ceiling: float, peers: dict) -> None:
    """In each timing mode, for every row with a time: TFLOP/s of ``flops``, percent of the
    ``ceiling`` TFLOP/s and, for each peer provider (name -> column in ``peers``), that peer's
    ms / this row's ms; all with the mode's suffix, so that ratios compare times of one mode."""
    for s in mode_suffixes(timing):
        base = {r["provider"]: r.get("ms" + s) for r in rows if r["provider"] in peers}
        for r in rows:
            ms = r.get("ms" + s)
            if not ms:
                continue
            r["tflops" + s] = tflops(flops, ms)
            r["pct_ceiling" + s] = 100.0 * r["tflops" + s] / ceiling
            for name, col in peers.items():
                if base.get(name):
                    r[col + s] = base[name] / ms


# --------------------------------------------------------------------------- torch.compile peers

def torch_compiled(fn: Callable, mode: Optional[str] = None) -> Callable:
    """``torch.compile`` of ``fn`` as a torch user would deploy it for one problem: static shapes,
    one whole graph (a graph break raises instead of running partly eager) and Inductor's
    ``mode``. Build one per problem, after ``reset_compiled``."""
    return torch.compile(fn, mode=mode, dynamic=False, fullgraph=True)


def reset_compiled() -> None:
    """Drop every compiled graph: each problem then compiles its own, and a function compiled for
    many shapes never meets dynamo's recompile limit (past which it would run eagerly, unsaid)."""
    import torch._dynamo

    torch._dynamo.reset()
