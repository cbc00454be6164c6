"""CPU checks of perf/harness.py (errors, timing in turns, tables, results, environment,
device checks, arguments)."""
import json
import math
import time
from pathlib import Path

import pytest
import torch

from perf import harness


# --------------------------------------------------------------------------- harness

def test_rel_error():
    ref = torch.randn(4, 5, dtype=torch.float64)
    assert harness.rel_error(ref.clone(), ref) == 0.0
    noisy = ref + 1e-3 * torch.randn_like(ref)
    want = float(torch.linalg.vector_norm(noisy - ref) / torch.linalg.vector_norm(ref))
    assert harness.rel_error(noisy, ref) == pytest.approx(want, rel=1e-12)
    assert harness.rel_error(noisy.to(torch.bfloat16), ref) > 0  # any dtype
    bad = ref.clone()
    bad[1, 2] = float("nan")
    assert harness.rel_error(bad, ref) == math.inf
    bad[1, 2] = float("inf")
    assert harness.rel_error(bad, ref) == math.inf
    assert harness.rel_error(ref[:3], ref) == math.inf
    zero = torch.zeros(3)
    assert harness.rel_error(zero, zero) == 0.0
    assert harness.rel_error(torch.ones(3), zero) == math.inf


def test_tflops_and_rotation_count():
    assert harness.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert harness.tflops(1e12, None) is None
    l2 = 50 * 2**20
    assert harness.rotation_count(457 * 2**20, l2) == 1  # bigger than the cache: no copies
    assert harness.rotation_count(10 * 2**20, l2) == 8  # capped
    assert harness.rotation_count(60 * 2**20, l2) == 3
    assert harness.rotation_count(0, l2) == 8


class _FakeEvent:
    """torch.cuda.Event on the CPU: the wall-clock time of record(); synchronize() is counted."""
    waited = []

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        self.waited.append(self)

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_interleaved_calls_take_successive_input_sets(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    seen = []
    fns = {n: (lambda x, n=n: seen.append((n, x))) for n in "ab"}
    times = harness.bench_interleaved(fns, warmup=1, rep=2, rotate=[0, 1, 2])
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    # warm-up a b, then timed a b | b a: every call, whichever the function, takes the next set
    assert seen == [("a", 0), ("b", 1), ("a", 2), ("b", 0), ("b", 1), ("a", 2)]


def test_graph_replays_are_timed_in_turns_per_call(monkeypatch):
    """One replay of each graph per round, its time divided by the calls the graph holds; a
    function that cannot be captured gets None."""
    clock, replays = [0.0], []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            replays.append(self.name)
            clock[0] += 4.0 if self.name == "a" else 6.0  # ms on the GPU

    class Event(_FakeEvent):
        def record(self):
            self.t = clock[0] / 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(harness, "_capture", lambda fn, rotate: fn and (Graph(fn()), len(rotate)))
    ms = harness.bench_graph_interleaved({"a": lambda: "a", "b": lambda: "b", "c": None}, warmup=1, rep=2,
                                         rotate=[0, 1])
    assert ms == {"a": pytest.approx(2.0), "b": pytest.approx(3.0), "c": None}
    assert replays == ["a", "b", "a", "b", "b", "a"]


def test_record_failure_kinds():
    rows = [{"provider": "p"}]
    harness.record_failure(rows[0], harness.Skip("no page table"), rows, device="cpu")
    assert rows[0]["status"] == "skipped" and rows[0]["note"] == "no page table"
    harness.record_failure(rows[0], NotImplementedError("later"), rows, device="cpu")
    assert rows[0]["status"] == "skipped" and "not available yet" in rows[0]["note"]
    harness.record_failure(rows[0], RuntimeError("boom"), rows, device="cpu")
    assert rows[0]["status"] == "error" and "boom" in rows[0]["note"]


def test_time_checked_keeps_the_timed_and_marks_the_failed(monkeypatch):
    monkeypatch.setattr(harness, "bench_interleaved",
                        lambda fns, **k: {"a": 1.5, "b": RuntimeError("illegal instruction")})
    rows = [{"provider": "a", "status": "ok"}, {"provider": "b", "status": "ok"}]
    timed = {"a": (rows[0], lambda x: None), "b": (rows[1], lambda x: None)}
    done = harness.time_checked(timed, rows, warmup=1, rep=1, device="cpu")
    assert list(done) == ["a"] and rows[0]["ms"] == 1.5
    assert rows[1]["status"] == "error" and "illegal instruction" in rows[1]["note"] and "ms" not in rows[1]


def test_time_checked_in_each_timing_mode(monkeypatch):
    interleaved, sustained = [], []

    def fake_interleaved(fns, **k):
        interleaved.append(sorted(fns))
        return {name: 1.0 + i for i, name in enumerate(fns)}

    def fake_sustained(fn, seconds, *, warm_s, rotate, device):  # harness.sustained's signature
        sustained.append((fn(None), seconds, warm_s, rotate))
        if fn(None) == "b":
            raise RuntimeError("launch failed")
        return {"ms": 2.0, "ms_mean": 2.1, "W": 690.0, "MHz": 1450.0, "power_capped": True, "mJ": 1.4,
                "samples": 9, "calls": 50}

    monkeypatch.setattr(harness, "bench_interleaved", fake_interleaved)
    monkeypatch.setattr(harness, "sustained", fake_sustained)

    def run(timing):
        rows = [{"provider": n, "status": "ok"} for n in "ab"]
        timed = {r["provider"]: (r, lambda x, n=r["provider"]: n) for r in rows}
        done = harness.time_checked(timed, rows, warmup=1, rep=1, rotate=[0, 1], device="cpu", timing=timing,
                                    sustained_warmup_s=0.5, sustained_s=0.25)
        return rows, done

    rows, done = run("both")
    assert interleaved == [["a", "b"]] and [s[1:] for s in sustained] == [(0.25, 0.5, [0, 1])] * 2
    assert list(done) == ["a"] and rows[0]["ms"] == 1.0 and rows[0]["ms_sustained"] == 2.0
    assert (rows[0]["W"], rows[0]["MHz"], rows[0]["power_capped"], rows[0]["mJ"]) == (690.0, 1450.0, True, 1.4)
    assert rows[1]["status"] == "error" and "launch failed" in rows[1]["note"] and rows[1]["ms"] == 2.0
    interleaved.clear()
    rows, done = run("sustained")
    assert interleaved == [] and "ms" not in rows[0] and rows[0]["ms_sustained"] == 2.0
    rows, done = run("interleaved")
    assert len(interleaved) == 1 and len(sustained) == 4 and set(done) == {"a", "b"}
    assert all("ms_sustained" not in r for r in rows)


def test_time_checked_graph_mode(monkeypatch):
    """graph: CUDA-graph replays in turns into "ms_graph"; a provider that cannot be captured is
    noted, not dropped. all: the three modes."""
    calls = []

    def fake_graphs(fns, **k):
        calls.append(sorted(fns))
        return {name: (None if name == "b" else 0.5) for name in fns}

    monkeypatch.setattr(harness, "bench_graph_interleaved", fake_graphs)
    monkeypatch.setattr(harness, "bench_interleaved", lambda fns, **k: {n: 1.0 for n in fns})
    monkeypatch.setattr(harness, "sustained", lambda fn, seconds, **k: {"ms": 2.0, "W": 1.0, "MHz": 1.0,
                                                                        "power_capped": False, "mJ": 1.0})
    for timing, fields in (("graph", {"ms_graph"}), ("all", {"ms", "ms_sustained", "ms_graph"})):
        rows = [{"provider": n, "status": "ok"} for n in "ab"]
        timed = {r["provider"]: (r, lambda x: None) for r in rows}
        done = harness.time_checked(timed, rows, warmup=1, rep=1, device="cpu", timing=timing)
        assert set(done) == {"a", "b"} and fields <= set(rows[0])
        assert "ms_graph" not in rows[1] and "CUDA graph" in rows[1]["note"]
    assert calls == [["a", "b"], ["a", "b"]]
    assert harness.TIMINGS["all"] == ["interleaved", "sustained", "graph"]
    assert harness.mode_suffixes("graph") == ["_graph"]
    lines, cols = harness.mode_lines([{"provider": "a", "ms": 1.0, "ms_graph": 0.5}], ["provider"], ["ms"], "graph")
    assert cols == ["provider", "ms"] and lines == [{"provider": "a", "timing": "graph", "ms": 0.5}]


def test_mode_lines():
    rows = [{"provider": "a", "status": "ok", "ms": 1.0, "x": 2.0, "ms_sustained": 1.5, "x_sustained": 1.8,
             "W": 700.0, "MHz": 1400.0}]
    lines, cols = harness.mode_lines(rows, ["provider", "status"], ["ms", "x"], "both")
    assert cols == ["provider", "status", "timing", "ms", "x", "W", "MHz"]
    assert lines == [{"provider": "a", "status": "ok", "timing": "interleaved", "ms": 1.0, "x": 2.0},
                     {"timing": "sustained", "ms": 1.5, "x": 1.8, "W": 700.0, "MHz": 1400.0}]
    lines, cols = harness.mode_lines(rows, ["provider"], ["ms"], "interleaved")
    assert cols == ["provider", "ms"] and lines == [{"provider": "a", "timing": "interleaved", "ms": 1.0}]
    lines, cols = harness.mode_lines(rows, ["provider"], ["ms"], "sustained")
    assert cols == ["provider", "timing", "ms", "W", "MHz"] and lines[0]["ms"] == 1.5 and len(lines) == 1


def test_timing_arguments():
    import argparse
    ap = argparse.ArgumentParser()
    harness.add_common_args(ap, timing="both")
    args = ap.parse_args([])
    assert (args.timing, args.sustained_warmup_s, args.sustained_s) == ("both", 2.0, 1.0)
    assert harness.timing_settings(args) == {"warmup": 5, "rep": 30, "timing": "both", "sustained_warmup_s": 2.0,
                                             "sustained_s": 1.0}
    assert harness.TIMINGS["both"] == ["interleaved", "sustained"] and harness.mode_suffixes("sustained") == [
        "_sustained"]
    with pytest.raises(SystemExit):
        ap.parse_args(["--timing", "burst"])


def test_sustained_times_chunks_of_calls_on_the_cpu(monkeypatch):
    from conftest import FakePowerSampler

    monkeypatch.setattr(harness, "PowerSampler", FakePowerSampler)
    seen = []

    def fn(x):
        seen.append(x)
        time.sleep(0.002)

    r = harness.sustained(fn, 0.1, warm_s=0.05, rotate=["a", "b", "c"], device="cpu")
    assert seen[:4] == ["a", "b", "c", "a"] and set(seen) == {"a", "b", "c"}
    assert 2.0 <= r["ms"] < 20 and 2.0 <= r["ms_mean"] < 20  # a chunk's calls took 2 ms and more each
    assert r["calls"] >= 5 and len(seen) >= r["calls"] + 1  # an untimed call sizes the chunks, then the warm-up
    assert (r["W"], r["MHz"], r["power_capped"], r["samples"]) == (700.0, 1500.0, True, 10)
    assert r["mJ"] == pytest.approx(700.0 * r["ms_mean"])


def test_sustained_on_a_gpu_waits_two_chunks_back(monkeypatch):
    """The CUDA-event path, events faked: the host waits on the mark two chunks back."""
    from conftest import FakePowerSampler

    marks = []

    class Event(_FakeEvent):
        def record(self):
            super().record()
            marks.append(self)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(harness, "PowerSampler", FakePowerSampler)
    monkeypatch.setattr(harness, "_power_field", lambda index: "power.draw")
    _FakeEvent.waited.clear()
    r = harness.sustained(lambda: time.sleep(0.001), 0.05, warm_s=0.02, device="cuda")
    assert len(marks) >= 5 and _FakeEvent.waited == marks[:len(marks) - 2]
    assert r["ms"] >= 1.0 and r["W"] == 700.0 and r["calls"] >= 1


def test_torch_compiled_is_static_and_whole(compile_eagerly):
    def f(x):
        return x + 1

    assert harness.torch_compiled(f) is f and harness.torch_compiled(f, "max-autotune-no-cudagraphs") is f
    assert compile_eagerly == [{"fn": f, "mode": None, "dynamic": False, "fullgraph": True},
                               {"fn": f, "mode": "max-autotune-no-cudagraphs", "dynamic": False, "fullgraph": True}]


def test_print_table_aligns(capsys):
    rows = [{"provider": "ikbo", "ms": 0.123456, "tflops": 594.2, "n": 3},
            {"provider": "fa4 materialized", "ms": 12.5, "tflops": None, "status": "wrong"}]
    text = harness.print_table(rows, ["provider", "ms", "tflops", "n", "status"])
    lines = text.splitlines()
    assert capsys.readouterr().out.strip() == text
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert "0.123" in lines[2] and "594" in lines[2] and "-" in lines[3] and "wrong" in lines[3]
    assert lines[0].startswith("provider")


def test_fmt():
    assert harness.fmt(None) == "-"
    assert harness.fmt(1234.5) == "1234" or harness.fmt(1234.5) == "1235"
    assert harness.fmt(0.000123) == "0.000123"
    assert harness.fmt(math.inf) == "inf"
    assert harness.fmt(True) == "yes"


def test_write_results(tmp_path):
    payload = {"rows": [{"provider": "ikbo", "ms": 0.5, "rel_err": math.inf}], "dtype": torch.float16}
    path = harness.write_results("unit", payload, out_dir=tmp_path / "r", stamp="20260101T000000Z")
    assert path == tmp_path / "r" / "unit-20260101T000000Z.json"
    latest = tmp_path / "r" / "unit-latest.json"
    assert latest.read_text() == path.read_text()
    data = json.loads(path.read_text())
    assert data["rows"][0]["rel_err"] == "inf" and data["dtype"] == "torch.float16"
    assert "date_utc" in data["environment"] and "torch" in data["environment"]
    harness.write_results("unit", {"rows": []}, out_dir=tmp_path / "r", stamp="20260101T000001Z")
    assert json.loads(latest.read_text())["rows"] == []  # latest overwritten


def test_run_keeps_the_rows_of_a_lost_context(monkeypatch, tmp_path, capsys):
    """A run's JSON: the fields given, the timing settings, the rows of every step, and after a
    lost CUDA context the rows it carried and a note why the run stopped."""
    import argparse

    monkeypatch.setattr(harness, "start_benchmark", lambda name: None)
    args = argparse.Namespace(out_dir=tmp_path, warmup=1, rep=2, timing="both", sustained_warmup_s=0.5,
                              sustained_s=0.25)
    run = harness.Run("unit", args, ["--x"], [])
    run.begin({"tol": 0.01}, ceiling_tflops={"bf16": 700.0})
    with run:
        run.add([{"provider": "a"}])
        raise harness.ContextLost("b: illegal address", [{"provider": "b"}])
    assert json.loads((tmp_path / "unit-latest.json").read_text())["rows"] == [{"provider": "a"}]  # written per step
    data = json.loads(run.save().read_text())
    assert list(data)[:4] == ["benchmark", "argv", "environment", "ceiling_tflops"] and data["argv"] == ["--x"]
    assert data["settings"] == {"warmup": 1, "rep": 2, "timing": "both", "sustained_warmup_s": 0.5,
                                "sustained_s": 0.25, "tol": 0.01}
    assert [r["provider"] for r in data["rows"]] == ["a", "b"] and data["seconds"] >= 0
    assert data["notes"] == ["the CUDA context is lost after b: illegal address; stopping (results so far are saved)"]
    assert "unit: the CUDA context is lost" in capsys.readouterr().out


def test_environment_without_gpu():
    env = harness.environment()
    assert env["torch"] == torch.__version__
    assert env["date_utc"].endswith("+00:00")
    for key in ("nvidia-cutlass-dsl", "flash-attn-4", "git_commit", "python"):
        assert key in env
    if not torch.cuda.is_available():
        assert env["gpu"] is None


def test_environment_commit_can_be_named(monkeypatch):
    monkeypatch.setenv("IKBO_GIT_COMMIT", "0123abc")
    env = harness.environment()
    assert env["git_commit"] == "0123abc" and "git_dirty" not in env


def test_require_hopper_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        harness.require_hopper_or_exit(name="bench")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench: needs a Hopper (sm_90) GPU")
    assert "pip install -e '.[bench]'" in err


def test_require_hopper_names_the_wrong_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(SystemExit):
        harness.require_hopper_or_exit(name="bench")
    assert "NVIDIA A100 (sm_80)" in capsys.readouterr().err


def test_out_dir_argument():
    import argparse
    ap = argparse.ArgumentParser()
    harness.add_common_args(ap)
    assert ap.parse_args([]).out_dir == harness.RESULTS_DIR
    assert ap.parse_args(["--out-dir", "elsewhere"]).out_dir == Path("elsewhere")


def test_libraries_load_once_and_say_what_is_missing(monkeypatch):
    from perf.providers import LIBRARIES, Libraries, Library, Provider, needed, select

    monkeypatch.setitem(LIBRARIES, "maths", Library("math", "sqrt", "maths providers skipped"))
    monkeypatch.setitem(LIBRARIES, "old", Library("math", "no_such_op", "old providers skipped"))
    monkeypatch.setitem(LIBRARIES, "gone", Library("no_such_module_for_ikbo", "f", "gone providers skipped"))
    libs = Libraries()
    notes = libs.load(["maths", "old", "gone", "old"])
    assert notes == ["math.no_such_op does not exist; old providers skipped",
                     "no_such_module_for_ikbo not importable (ModuleNotFoundError: No module named "
                     "'no_such_module_for_ikbo'); gone providers skipped"]
    import math
    assert libs.get("maths") is math and libs.get("old") is None and libs.get("never") is None
    provs = [Provider("a", None, None, needs=("maths",)), Provider("b", None, None, needs=("maths", "gone")),
             Provider("c", None, None)]
    assert [libs.skip_note(pr) for pr in provs] == [None, notes[1], None]
    assert needed(provs) == ["maths", "gone"]
    assert [pr.name for pr in select(provs, ["c", "a"])] == ["a", "c"] and select(provs, None) == provs
    libs.modules["maths"] = "a stand-in"  # what tests do: load leaves it
    assert libs.load(["maths"]) == [] and libs.get("maths") == "a stand-in"
