"""The mechanisms of a warp-specialized Hopper kernel, written once for every kernel here.

A kernel of this shape has one producer warpgroup (TMA loads; warp 0 issues them) and
consumer warpgroups (wgmma). Each mechanism below is one small object built in the kernel's
``__init__`` (host side: its numbers are checked there) and used from the device code:

- :class:`RegisterSplit`: the producer gives up registers, the consumers take them
  (setmaxnreg); the budget is checked against the register file.
- named barriers: each kernel lists its ids in an ``IntEnum`` (0 is ``__syncthreads``);
  :func:`bar_sync` / :func:`bar_arrive` take one id and its thread count.
- :class:`PingPong`: the consumer warpgroups (two, or more in round robin) take turns issuing
  their wgmmas.
- :class:`PipelineSpec`: one TMA -> consumer mbarrier ring: its stages, transaction bytes and
  arrive counts, the counts checked against the roles that arrive (:meth:`PipelineSpec.check`),
  and the pipeline built from it (:meth:`PipelineSpec.make`); :func:`pipelines_init_arrive` /
  :func:`pipelines_init_wait` make every CTA's barriers visible before first use.

The persistent tile walk is :func:`cute_kernels.scheduler.strided_tiles`.

A kernel class states its contract in its docstring: the pipeline table (:func:`contract_table`'s
columns, counts written as expressions of the kernel's and its configuration's fields) and its
named barriers; :func:`contract_differences` compares both with what the kernel builds.
"""
from __future__ import annotations

import dataclasses
import enum
import re

import cutlass.cute as cute
import cutlass.pipeline as pipeline

WARP = 32
WARPGROUP = 128
REGISTER_FILE = 65536  # 32-bit registers per SM
NAMED_BARRIERS = 16  # hardware ids 0..15; 0 is __syncthreads


class Barrier(enum.IntEnum):
    """Base of a kernel's named-barrier ids. Subclass it with ids in [1, 15]; an id meant to be
    offset by a warpgroup index leaves room for the offsets (``check_barriers``)."""


def check_barriers(kernel: str, barriers: type[Barrier], spans: dict | None = None) -> None:
    """Every id of ``barriers`` (plus the warpgroup offsets ``spans[name]`` reserves) lies in
    [1, 15] and no two overlap; ValueError naming them otherwise."""
    spans = spans or {}
    used: dict[int, str] = {}
    for b in barriers:
        for i in range(spans.get(b.name, 1)):
            bid = int(b) + i
            if not 1 <= bid < NAMED_BARRIERS:
                raise ValueError(f"{kernel}: named barrier {b.name} + {i} = {bid} is outside [1, {NAMED_BARRIERS - 1}]")
            if bid in used:
                raise ValueError(f"{kernel}: named barrier id {bid} is both {used[bid]} and {b.name} + {i}")
            used[bid] = f"{b.name} + {i}"


def bar_sync(barrier_id, threads: int) -> None:
    """Wait on named barrier ``barrier_id`` until ``threads`` threads have arrived (this one too)."""
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)


def bar_arrive(barrier_id, threads: int) -> None:
    """Arrive on named barrier ``barrier_id`` (of ``threads`` threads) without waiting."""
    cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=threads)


@dataclasses.dataclass(frozen=True)
class RegisterSplit:
    """Registers per thread of the producer and consumer warpgroups (setmaxnreg)."""

    producer: int
    consumer: int
    producer_warpgroups: int = 1
    consumer_warpgroups: int = 2

    def __post_init__(self):
        for name in ("producer", "consumer"):
            regs = getattr(self, name)
            if regs % 8 or not 24 <= regs <= 256:
                raise ValueError(f"RegisterSplit: {name} = {regs} registers: setmaxnreg takes a multiple of 8 in [24, 256]")
        used = WARPGROUP * (self.producer * self.producer_warpgroups + self.consumer * self.consumer_warpgroups)
        if used > REGISTER_FILE:
            raise ValueError(
                f"RegisterSplit: 128 x ({self.producer} x {self.producer_warpgroups} + {self.consumer} x "
                f"{self.consumer_warpgroups}) = {used} registers exceed the SM's {REGISTER_FILE}"
            )

    @property
    def threads(self) -> int:
        return WARPGROUP * (self.producer_warpgroups + self.consumer_warpgroups)

    def enter_producer(self) -> None:
        """First step of a producer warpgroup: hand its registers over."""
        cute.arch.setmaxregister_decrease(self.producer)

    def enter_consumer(self) -> None:
        """First step of a consumer warpgroup: take the registers the producer freed."""
        cute.arch.setmaxregister_increase(self.consumer)


@dataclasses.dataclass(frozen=True)
class PingPong:
    """Consumer warpgroups that take turns on the tensor cores, in order 0, 1, ..., n - 1, 0, ...

    Warpgroup ``wg`` waits on barrier ``first + wg`` (two warpgroups' 256 threads: its own 128
    wait, the previous one's 128 arrive) before issuing its wgmmas, and hands the turn over by
    arriving on the next one's barrier once they are issued. Warpgroup 0 takes the first turn
    (``start``). The turns go round strictly, so every warpgroup must take the same number of
    turns, or the last hand-over is left pending at exit (harmless).
    """

    first: int  # barrier id of warpgroup 0's turn; warpgroup i's is first + i
    threads: int = 2 * WARPGROUP
    warpgroups: int = 2

    @cute.jit
    def start(self, wg) -> None:
        """Before the first turn: warpgroup 0 is let through its first wait."""
        if wg == 0:
            self.open_first_turn()

    def open_first_turn(self) -> None:
        """``start``'s arrive, for a caller already on warpgroup 0's path."""
        bar_arrive(self.first, self.threads)

    def wait(self, wg) -> None:
        """Wait for warpgroup ``wg``'s turn."""
        bar_sync(self.first + wg, self.threads)

    def hand_over(self, wg) -> None:
        """Warpgroup ``wg`` has issued its wgmmas: the next one's turn."""
        if self.warpgroups == 2:  # (compile time)
            bar_arrive(self.first + 1 - wg, self.threads)
        else:
            bar_arrive(self.first + (wg + 1) % self.warpgroups, self.threads)


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """One TMA -> consumer ring of mbarriers (PipelineTmaAsync).

    ``producer_arrives``: arrivals that fill a stage (one elected producer thread, with the
    stage's ``tx_bytes`` of TMA transactions); ``consumer_arrives``: arrivals that free it
    (one per consumer warp that releases it, in every CTA whose loads multicast into it).
    """

    name: str
    producer: str  # who loads, for the contract table
    consumer: str  # who releases
    stages: int
    tx_bytes: int
    producer_arrives: int
    consumer_arrives: int

    def check(self, kernel: str, *, releasing_threads: int, multicast_ctas: int = 1) -> "PipelineSpec":
        """The arrive counts are those of the roles: 1 producer arrive (PipelineTmaAsync's elected
        thread), and one consumer arrive per releasing warp per multicasting CTA. ValueError with
        the arithmetic otherwise (a wrong count would hang the GPU instead)."""
        if releasing_threads % WARP:
            raise ValueError(f"{kernel}: {self.name} pipeline released by {releasing_threads} threads, not whole warps")
        derived = releasing_threads // WARP * multicast_ctas
        if self.consumer_arrives != derived:
            raise ValueError(
                f"{kernel}: {self.name} pipeline declares {self.consumer_arrives} consumer arrives per stage, but "
                f"{releasing_threads} releasing threads / 32 x {multicast_ctas} multicasting CTAs = {derived}"
            )
        if self.producer_arrives != 1:
            raise ValueError(f"{kernel}: {self.name} pipeline declares {self.producer_arrives} producer arrives; "
                             f"a TMA producer arrives once per stage (with its transaction bytes)")
        if self.stages < 1 or self.tx_bytes <= 0:
            raise ValueError(f"{kernel}: {self.name} pipeline has {self.stages} stages of {self.tx_bytes} bytes")
        return self

    def row(self) -> str:
        """The contract as a table row: pipeline | producer -> consumer | full / empty arrives | stages."""
        return (f"| {self.name} | {self.producer} -> {self.consumer} | {self.producer_arrives} / "
                f"{self.consumer_arrives} | {self.stages} |")

    def make(self, barrier_storage, cta_layout_vmnk=None):
        """The pipeline over ``2 * stages`` mbarriers at ``barrier_storage`` (device side). Its
        barriers are initialized without a sync: see :func:`pipelines_init_arrive`."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barrier_storage,
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.producer_arrives),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_arrives),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cta_layout_vmnk,
            defer_sync=True,
        )


def pipelines_init_arrive(cluster_size: int) -> None:
    """After every pipeline's ``make``: fence the mbarrier inits (and, in a cluster, arrive on
    the cluster barrier without waiting, so independent setup overlaps the other CTAs')."""
    pipeline.pipeline_init_arrive(cluster_shape_mn=(cluster_size, 1), is_relaxed=True)


def pipelines_init_wait(cluster_size: int) -> None:
    """Before the first use of any pipeline: the CTA's (or the cluster's) barriers are initialized."""
    pipeline.pipeline_init_wait(cluster_shape_mn=(cluster_size, 1))


def contract_table(specs) -> str:
    """The pipelines as a markdown table (what a kernel's docstring states)."""
    head = "| pipeline | producer -> consumer | full / empty arrives | stages |\n| --- | --- | --- | --- |"
    return "\n".join([head] + [s.row() for s in specs])


_TABLE_ROW = re.compile(r"^\s*\|([^|]+)\|([^|]+)->([^|]+)\|([^|/]+)/([^|]+)\|([^|]+)\|\s*$")
_BARRIER_LINE = re.compile(r"^\s+([A-Z][A-Z0-9_]*)( \+ [a-z]\w*)? \((\d+) threads")


def _value(expr: str, names: dict) -> int:
    """A docstring count: an int, or a product/sum of the kernel's fields ("4 x cluster")."""
    expr = expr.strip().replace(" x ", " * ")
    if not re.fullmatch(r"[\w\s*+()-]+", expr):
        raise ValueError(f"not a count expression: {expr!r}")
    return eval(expr, {"__builtins__": {}}, names)  # noqa: S307 - a docstring of this package


def contract_differences(doc: str, kernel, barriers: type[Barrier]) -> list[str]:
    """Where ``doc`` (a kernel class docstring) states another contract than ``kernel`` (a built
    instance) has: every PipelineSpec of the kernel is one row of its table (name, producer ->
    consumer, full / empty arrives, stages; counts evaluated over the kernel's and its ``cfg``'s
    fields) and no row names another; every member of ``barriers`` is listed once under "Named
    barriers", as ``NAME (+ c) (N threads``, with N = ``kernel.BARRIER_THREADS[NAME]`` and "+ c"
    exactly where ``kernel.BARRIER_SPANS`` gives it several ids. Empty where they agree."""
    names = {**(vars(kernel.cfg) if hasattr(kernel, "cfg") else {}), **vars(kernel)}
    names.update({k: getattr(kernel, k) for k in dir(type(kernel)) if k.isupper()})
    specs = {v.name: v for v in vars(kernel).values() if isinstance(v, PipelineSpec)}
    found, rows = [], {}
    for line in doc.splitlines():
        m = _TABLE_ROW.match(line)
        if m and m.group(1).strip() != "pipeline":
            name, producer, consumer, full, empty, stages = (g.strip() for g in m.groups())
            rows[name] = (producer, consumer, full, empty, stages)
    for name in sorted(rows.keys() - specs.keys()):
        found.append(f"the table's pipeline {name!r} is none the kernel builds")
    for name, spec in sorted(specs.items()):
        if name not in rows:
            found.append(f"pipeline {name!r} is missing from the table")
            continue
        producer, consumer, full, empty, stages = rows[name]
        if (producer, consumer) != (spec.producer, spec.consumer):
            found.append(f"pipeline {name!r}: the table says {producer} -> {consumer}, the kernel "
                         f"{spec.producer} -> {spec.consumer}")
        for what, expr, value in (("full arrives", full, spec.producer_arrives),
                                  ("empty arrives", empty, spec.consumer_arrives), ("stages", stages, spec.stages)):
            if _value(expr, names) != value:
                found.append(f"pipeline {name!r}: {what}: the table's {expr!r} is {_value(expr, names)}, "
                             f"the kernel's {value}")
    section = doc.split("Named barriers", 1)[1].split("\n\n", 1)[0] if "Named barriers" in doc else ""
    listed = {}
    for line in section.splitlines():
        m = _BARRIER_LINE.match(line)
        if m:
            if m.group(1) in listed:
                found.append(f"barrier {m.group(1)} is listed twice")
            listed[m.group(1)] = (bool(m.group(2)), int(m.group(3)))
    for name in sorted(listed.keys() - {b.name for b in barriers}):
        found.append(f"the docstring's barrier {name} is not a member of {barriers.__name__}")
    for b in barriers:
        if b.name not in listed:
            found.append(f"barrier {b.name} is missing from the docstring")
            continue
        offset, threads = listed[b.name]
        if threads != kernel.BARRIER_THREADS[b.name]:
            found.append(f"barrier {b.name}: the docstring says {threads} threads, the kernel "
                         f"{kernel.BARRIER_THREADS[b.name]}")
        if offset != (kernel.BARRIER_SPANS.get(b.name, 1) > 1):
            found.append(f"barrier {b.name}: the docstring's per-warpgroup offset (+ c) and the kernel's "
                         f"{kernel.BARRIER_SPANS.get(b.name, 1)} ids disagree")
    return found
