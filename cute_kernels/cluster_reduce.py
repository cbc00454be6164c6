"""A tile's K split over the CTAs of a cluster: the partial accumulators summed in shared memory.
The exchange's pieces (``store_remote``, ``init_exchange``, ``release_peers``, ``cluster_end``)
also serve other exchanges between the CTAs of a cluster (the attention kernel's split pairs).

The ``ctas`` CTAs of a cluster compute one output tile, CTA r over the r-th slice of K, each
in the accumulator of one consumer warpgroup. The tile's epilogue sub-tiles are dealt out:
sub-tile s belongs to CTA ``s % ctas``. Every CTA sends its partial sums of the sub-tiles it
does not own to their owners (``st.async`` into the owner's shared memory, 16 bytes a store,
completing transaction bytes on the owner's ``full`` mbarrier), adds the other CTAs' partial
sums of its own sub-tiles to its accumulator, always in rank order, and runs the epilogue of
those sub-tiles alone. The clusters' CTAs are resident together (the hardware launches a
cluster whole), so the exchange needs no co-residency of the grid; nothing goes through
global memory; the sum is the same bits on every run.

Receive buffer (fp32, per CTA): ``[sender slot][owned sub-tile][row group][thread][4]``, a
thread's 4 neighbouring columns of one row in one 16-byte store: a warp's stores cover 512
contiguous bytes. Sender slot: the sender's rank, less one past the owner's.

Barriers (per CTA; initialized by one thread before the pipelines' init fence):

    | barrier | arrives | completes when |
    | --- | --- | --- |
    | full | 1 (the owner, arming the bytes it expects) + transaction bytes | every sender's partial sums of the tile have landed |
    | free | ctas - 1 (each owner, remotely) | every owner has read this CTA's previous contribution |

A CTA waits on its ``free`` before sending tile i > 0 (its owners may still be reading tile
i - 1 from the same buffers) and skips the owners' last release, so no remote arrive reaches
a CTA after its last tile. The kernel ends with a cluster barrier, so that no CTA exits while
its stores into a peer are in flight.

The accumulator is seen through ``cute_kernels.accumulator.acc_mn_view``: a sub-tile is
``cols`` neighbouring columns of that view (4: 16 output columns of a wgmma tile) for each of
its ``rows`` row groups.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import AddressSpace, Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, nvvm, vector
from cutlass.cute.typing import Pointer
from cutlass.cutlass_dsl import T, dsl_user_op

from .warp_specialized import WARPGROUP, bar_sync

VEC = 4  # fp32 values per st.async (16 bytes)


@dsl_user_op
def store_remote(base: Pointer, offset: int, values, mbar: Pointer, rank, *, loc: Optional[ir.Location] = None,
                 ip: Optional[ir.InsertionPoint] = None) -> None:
    """``st.async`` of 2 or 4 32-bit ``values`` (fp32, or their bits) to word ``offset`` (a
    compile-time count) past this CTA's shared-memory address ``base``, as mapped into CTA
    ``rank`` of the cluster, completing 8 or 16 transaction bytes on mbarrier ``mbar`` there.
    The mapping is of ``base``, the offset an immediate: one register per peer and base however
    many stores follow (mapping each store's address spilled at 4-CTA splits).
    ``cute.arch.store_async_dsmem`` also fences after every store, which an exchange ordered by
    the mbarrier alone does not need."""
    if len(values) not in (2, 4):
        raise ValueError(f"store_remote: 2 or 4 values a store, got {len(values)}")
    dsmem = llvm.PointerType.get(AddressSpace.dsmem)
    r = Int32(rank).ir_value(loc=loc, ip=ip)
    addr = nvvm.mapa(dsmem, base.to_llvm_ptr(loc=loc, ip=ip), r, loc=loc, ip=ip)
    if offset:
        addr = llvm.getelementptr(dsmem, addr, [], [offset * 4], T.i8(), no_wrap_flags="None", loc=loc, ip=ip)
    bar = nvvm.mapa(dsmem, mbar.to_llvm_ptr(loc=loc, ip=ip), r, loc=loc, ip=ip)
    words = [v.ir_value(loc=loc, ip=ip) if isinstance(v, Int32) else
             llvm.bitcast(T.i32(), Float32(v).ir_value(loc=loc, ip=ip), loc=loc, ip=ip) for v in values]
    vec = vector.from_elements(ir.VectorType.get([len(values)], T.i32()), words, loc=loc, ip=ip)
    nvvm.store_async(addr, vec, bar, loc=loc, ip=ip)


def init_exchange(full, free, ctas: int) -> None:
    """One thread, before the pipelines' init fence: the two mbarriers of a buffer that the
    other CTAs of a cluster of ``ctas`` fill by ``store_remote``. ``full`` (where the buffer
    is): one arrive, its owner arming the bytes it expects; ``free`` (in each sender): one
    arrive per owner it sends to, remotely, once that owner has read the previous exchange."""
    cute.arch.mbarrier_init(full, 1)
    cute.arch.mbarrier_init(free, ctas - 1)


@cute.jit
def release_peers(free, rank: Int32, ctas: int) -> None:
    """One thread of an owner, once every thread has read the exchange: arrive on ``free`` in
    every other CTA of the cluster."""
    for peer in cutlass.range_constexpr(ctas):
        if peer != rank:
            cute.arch.mbarrier_arrive(free, peer, scope=nvvm.MemScopeKind.CLUSTER)


def cluster_end() -> None:
    """Every thread of the CTA, last: no CTA of the cluster exits while a peer may still arrive
    on its barriers or write into its shared memory."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


class ExchangeMemory(NamedTuple):
    """A CTA's side of the exchange in shared memory (device values)."""

    buffer: cute.Tensor  # the receive buffer (``ClusterReduce.buffer_layout``)
    full: Pointer  # mbarrier: every sender's partial sums of the tile have landed
    free: Pointer  # mbarrier: every owner has read this CTA's previous contribution


@dataclasses.dataclass(frozen=True)
class ClusterReduce:
    """The exchange of one consumer warpgroup's partial accumulators across a K-split cluster."""

    ctas: int  # CTAs of the cluster (K slices)
    parts: int  # epilogue sub-tiles of a tile
    rows: int  # row groups of the accumulator view (2 per 64 rows of the tile)
    cols: int = VEC  # columns of the accumulator view per sub-tile
    threads: int = WARPGROUP

    def __post_init__(self):
        if self.ctas not in (2, 4, 8):
            raise ValueError(f"ClusterReduce: a K split over {self.ctas} CTAs; 2, 4 or 8 are supported")
        if self.parts % self.ctas:
            raise ValueError(f"ClusterReduce: {self.parts} sub-tiles do not deal evenly to {self.ctas} CTAs")
        if self.cols != VEC:
            raise ValueError(f"ClusterReduce: sub-tiles of {self.cols} accumulator columns per row; the "
                             f"exchange moves {VEC} (one 16-byte store)")

    @property
    def owned(self) -> int:
        """Sub-tiles each CTA owns."""
        return self.parts // self.ctas

    @property
    def words(self) -> int:
        """fp32 words of a CTA's receive buffer."""
        return (self.ctas - 1) * self.owned * self.rows * self.threads * VEC

    @property
    def tx_bytes(self) -> int:
        """Bytes a CTA receives per tile (what it arms its ``full`` barrier with)."""
        return self.words * 4

    def owner(self, part: int) -> int:
        """The rank that owns sub-tile ``part`` (a compile-time sub-tile)."""
        return part % self.ctas

    @property
    def buffer_shape(self) -> tuple:
        """(VEC, thread, row group, owned sub-tile, sender slot) of the receive buffer."""
        return (VEC, self.threads, self.rows, self.owned, self.ctas - 1)

    @property
    def buffer_stride(self) -> tuple:
        """fp32 words between neighbours of each mode of ``buffer_shape`` (compact, in mode order)."""
        strides, step = [], 1
        for extent in self.buffer_shape:
            strides.append(step)
            step *= extent
        return tuple(strides)

    def offset(self, coord) -> int:
        """The word of a compile-time coordinate of ``buffer_shape``."""
        return sum(c * d for c, d in zip(coord, self.buffer_stride))

    def buffer_layout(self):
        """The receive buffer's layout (device code)."""
        return cute.make_layout(self.buffer_shape, stride=self.buffer_stride)

    # ------------------------------------------------------------------ device
    def init_barriers(self, full, free) -> None:
        """One thread, before the pipelines' init fence (``pipelines_init_arrive``)."""
        init_exchange(full, free, self.ctas)

    @cute.jit
    def exchange(self, acc_mn, mem: "ExchangeMemory", rank: Int32, tile_i: Int32, more, tidx: Int32,
                 barrier_id: int):
        """Sum the tile's partial accumulators: send the sub-tiles other CTAs own, wait for the
        partial sums of the owned ones and add them to ``acc_mn`` in rank order, and, where this
        CTA has ``more`` tiles, release the buffer to the senders. ``tile_i``: the tile's position
        in this CTA's walk. ``barrier_id``: a named barrier of this warpgroup's threads."""
        buf, full, free = mem
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(full, self.tx_bytes)
        if tile_i > 0:
            cute.arch.mbarrier_wait(free, (tile_i - 1) % 2)
        for s in cutlass.range_constexpr(self.parts):
            owner = self.owner(s)
            if rank != owner:
                slot = rank  # the sender's slot at this owner
                if rank > owner:
                    slot = rank - 1
                base = buf[(None, tidx, 0, 0, slot)].iterator
                for m in cutlass.range_constexpr(self.rows):
                    offset = self.offset((0, 0, m, s // self.ctas, 0))
                    store_remote(base, offset, [acc_mn[m, s * self.cols + c] for c in range(VEC)], full, owner)
        cute.arch.mbarrier_wait(full, tile_i % 2)
        for s in cutlass.range_constexpr(self.parts):
            if rank == self.owner(s):
                for slot in cutlass.range_constexpr(self.ctas - 1):
                    for m in cutlass.range_constexpr(self.rows):
                        part = buf[(None, tidx, m, s // self.ctas, slot)].load()
                        for c in cutlass.range_constexpr(VEC):
                            acc_mn[m, s * self.cols + c] = acc_mn[m, s * self.cols + c] + part[c]
        if more:
            # Every thread has read its words: the senders may overwrite them.
            bar_sync(barrier_id, self.threads)
            if tidx == 0:
                release_peers(free, rank, self.ctas)

    @staticmethod
    def end() -> None:
        """Every thread of the CTA, last (``cluster_end``)."""
        cluster_end()
